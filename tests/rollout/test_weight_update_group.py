"""The trainer side of SGLang's weight-update group, exercised over gloo on CPU (NCCL needs GPUs)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.net import free_port
from megatron_dapo.rollout.sglang_engine import init_weight_update_group


def _worker(world_rank: int, world_port: int, group_port: int, out: dict) -> None:
    # A default world as in a torchrun trainer; the update group is separate and has its own rank order:
    # world rank 1 plays the trainer (update-group rank 0), world rank 0 a receiver (rank 1).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=world_rank, world_size=2)
    group_rank = 1 - world_rank
    pg = init_weight_update_group("127.0.0.1", group_port, 2, "test_weights", rank=group_rank, backend="gloo")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 7 if group_rank == 0 else torch.zeros(2, 3)
    dist.broadcast(t, group_src=0, group=pg)
    out[world_rank] = t.tolist()
    dist.destroy_process_group(pg)
    dist.destroy_process_group()


def test_broadcast_from_trainer_rank_zero_over_custom_group():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        # Both processes need the same ports.
        ports = (free_port(), free_port())
        procs = [ctx.Process(target=_worker, args=(r, *ports, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
        expected = (torch.arange(6, dtype=torch.float32).reshape(2, 3) * 7).tolist()
        assert out[0] == expected and out[1] == expected
