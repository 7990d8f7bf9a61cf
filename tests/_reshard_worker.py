"""Worker of test_reshard.py under `torchrun --rdzv-backend c10d`: direct resharding between a Megatron actor and
engine ranks, the split launch's own groups and channel (placement.init_role, DirectChannel).

    torchrun ... tests/_reshard_worker.py OUT_DIR ENGINE_RANKS TP PP EP NAME=HF_DIR[,NAME=HF_DIR...]

Per model, three pushes: version 1 full, version 2 after every parameter moved (a delta push), version 3 with nothing
moved (a delta of no element). Actor rank 0 also walks the rank-0 export (export_hf_weights, collective over the
actor ranks) after each push and saves it as OUT_DIR/<model>.<version>.export.pt; each engine rank saves what it
rebuilt as <model>.<version>.engine<e>.pt, and every actor rank its metrics as <model>.<version>.actor<r>.pt.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from megatron_dapo.placement import DirectChannel
from megatron_dapo.placement import init_role
from megatron_dapo.rollout.delta import DeltaEncoder

BUCKET_BYTES = 4096
"""Small buckets: every sender's pieces span several."""


def _actor(out: Path, placement, store, tp: int, pp: int, ep: int, models: dict[str, Path]) -> None:
    from transformers import AutoConfig

    from megatron_dapo.actor import reshard
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.hf_weights import export_hf_weights
    from megatron_dapo.actor.hf_weights import load_hf_into_model
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.config import ActorConfig
    from megatron_dapo.rollout.exchange import RolloutExchange

    groups = init_distributed(tp, pp, expert_parallel=ep)
    exchange = RolloutExchange(groups.world_size, timeout_s=120.0)
    layout = reshard.Layout.gather(groups)
    channel = DirectChannel(placement, store, 120.0)
    version = 0
    for name, path in models.items():
        hf_config = AutoConfig.from_pretrained(path)
        model = build_gpt_model(hf_config, ActorConfig(model_path=str(path), tensor_parallel=tp, pipeline_parallel=pp,
                                                       expert_parallel=ep, dtype="fp32"), groups)  # fmt: skip
        load_hf_into_model([model], path, hf_config, groups)
        plan = reshard.transfer_plan(hf_config, layout)
        encoder = DeltaEncoder()
        for moved in (False, True, False):
            version += 1
            if moved:  # every parameter moves (the same on every replica: seeded by name)
                with torch.no_grad():
                    for pname, p in model.named_parameters():
                        gen = torch.Generator().manual_seed(sum(map(ord, pname)))
                        p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
            pieces = reshard.owned_shards([model], hf_config, groups, plan)
            metrics = channel.push(version, pieces, BUCKET_BYTES, encoder,
                                   gather=lambda x: exchange.all_gather([x], "test push"))  # fmt: skip
            torch.save({"metrics": metrics, "planned": plan.numels}, out / f"{name}.{version}.actor{groups.rank}.pt")
            exported = {n: t.clone() for n, t in export_hf_weights([model], hf_config, groups)}
            if groups.rank == 0:
                torch.save(exported, out / f"{name}.{version}.export.pt")
        exchange.barrier()


def _engine(out: Path, placement, store, tp: int, models: dict[str, Path]) -> None:
    from transformers import AutoConfig

    version = 0
    channels = {}
    for name, path in models.items():
        hf_config = AutoConfig.from_pretrained(path)
        if not channels:  # one channel (its groups) for the launch; the model's config per model
            channels["c"] = DirectChannel(placement, store, 120.0, hf_config=hf_config, actor_tp=tp, delta=True)
        channel = channels["c"]
        channel.hf_config = hf_config  # each model's first push is full (a fresh encoder): no base is needed
        for _ in range(3):
            version += 1
            while channel.pending() != version:
                time.sleep(0.01)
            got, buckets = channel.receive_buckets()
            assert got == version
            torch.save(dict(buckets[0]), out / f"{name}.{version}.engine{placement.role_rank}.pt")


def main() -> None:
    out, engines, tp, pp, ep = sys.argv[1], *map(int, sys.argv[2:6])
    models = {name: Path(path) for name, path in (item.split("=", 1) for item in sys.argv[6].split(","))}
    placement, store = init_role(engines, timeout_s=120.0)
    if placement.is_engine:
        _engine(Path(out), placement, store, tp, models)
    else:
        _actor(Path(out), placement, store, tp, pp, ep, models)
    os._exit(0)  # megatron's groups and gloo threads: no teardown to wait on


if __name__ == "__main__":
    main()
