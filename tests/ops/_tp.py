"""Helpers for the ops tests: the per-dtype tolerance table and two-process gloo runs (torch.multiprocessing).

Worker functions live here (not in test modules) so that spawned processes can import them by name.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.net import free_port

# (rtol, atol) per input dtype, flash-attn's cross-entropy table (STYLE.md section 5).
TOLERANCES = {
    torch.float32: (1e-5, 2e-5),
    torch.float16: (1e-3, 1e-4),
    torch.bfloat16: (1e-2, 3e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """Compare in float64 with the tolerance of the input dtype."""
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, dist.group.WORLD, *args)
    finally:
        dist.destroy_process_group()


def run_gloo(fn, *args, world: int = 2) -> None:
    """Run fn(rank, world, group, *args) on `world` gloo processes; an exception in any rank fails the caller."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def shard(full: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """Megatron vocab layout: rank r holds the r-th contiguous slice along dim."""
    return full.chunk(world, dim=dim)[rank]
