"""actor.offload on CPU/gloo (DP=2, distributed optimizer): the state round-trips bit for bit and training with
offload=all goes exactly as with none.

One 2-process launch (~20-30 s): after one update (Adam's state exists) every part is offloaded and reloaded with both
release modes ("poison", the CPU default: the storage is overwritten with NaN bytes while away; "free": the storage is
shrunk to 0 bytes as on CUDA), then two actors train two steps under MemoryChoreographer with offload "none" and "all".
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.actor._dist import run_distributed
from tests.actor._tiny_models import make_tiny_qwen2
from tests.actor.test_actor import _config
from tests.actor.test_actor import _make_batch


def _state_bytes(actor) -> dict[str, list[torch.Tensor]]:
    """A copy of every storage's bytes, per part."""
    out = {}
    for part, storages in actor.offloader.storages().items():
        out[part] = [torch.empty(0, dtype=torch.uint8).set_(s).clone() for s in storages]
    return out


def _same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in a
    )


def _train(hf_dir: str, batch, offload: str) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.memory import MemoryChoreographer

    groups = init_distributed(1, 1)
    actor = MegatronActor(_config(hf_dir, 1, 1, use_distributed_optimizer=True, grad_clip=1.0), groups, hf_dir=hf_dir)
    trace: list[str] = []
    chor = MemoryChoreographer(None, actor, offload=offload, trace=trace)
    losses, exported, offloaded_in_generation = [], [], []
    for _ in range(2):
        b = _make_batch(seed=1)

        def generation() -> None:
            offloaded_in_generation.append(actor.offloader.offloaded)

        def log_probs(b=b) -> None:
            b.old_logp, _ = actor.compute_logprobs(b, with_entropy=False)

        def update(b=b) -> None:
            losses.append(actor.update(b)["actor/loss"])

        def sync() -> None:
            exported.append({n: t.clone() for n, t in actor.export_hf_weights()})

        chor.run_step({"generation": generation, "log-probs": log_probs, "update": update, "sync": sync})
    away = actor.offloader.offloaded
    error = ""
    if away:
        try:
            actor.compute_logprobs(batch)
        except RuntimeError as err:
            error = str(err)
    actor.reload_state()
    params = [p.detach().clone() for p in actor.model[0].parameters()]
    return {
        "losses": losses,
        "exported": exported[-1],
        "params": params,
        "away": away,
        "error": error,
        "in_generation": offloaded_in_generation,
        "trace": trace,
    }


def _worker(hf_dir: str, batch) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.offload import ActorOffloader

    groups = init_distributed(1, 1)  # DP=2
    actor = MegatronActor(_config(hf_dir, 1, 1, use_distributed_optimizer=True, grad_clip=1.0), groups, hf_dir=hf_dir)
    batch.old_logp, _ = actor.compute_logprobs(batch, with_entropy=False)
    actor.update(batch)
    res: dict = {"part_bytes": {k: sum(s.nbytes() for s in v) for k, v in actor.offloader.storages().items()}}
    res["adam_states"] = sum(
        len(o.optimizer.state) for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    )
    before = _state_bytes(actor)
    moved = actor.offload_state(["params", "grads", "optimizer"])
    res["moved"] = moved
    res["poisoned"] = all(bool(torch.isnan(p).all()) for p in actor.model[0].parameters())
    res["reloaded"] = actor.reload_state()
    res["poison_roundtrip"] = _same(before, _state_bytes(actor))
    # release="free": the storages really shrink to 0 bytes, then come back with the same bytes.
    free = ActorOffloader(actor.model, actor.optimizer, actor.device, release="free")
    free.offload(["optimizer", "grads"])
    res["free_device_bytes"] = free.device_bytes()
    res["free_sizes"] = [s.nbytes() for s in free.storages()["optimizer"] + free.storages()["grads"]]
    free.reload()
    res["free_roundtrip"] = _same(before, _state_bytes(actor))
    # Training continues after the round trips exactly as it would have: compare with a fresh pair of runs.
    res["none"] = _train(hf_dir, batch, "none")
    res["all"] = _train(hf_dir, batch, "all")
    res["optimizer"] = _train(hf_dir, batch, "optimizer")
    return res


@pytest.fixture(scope="module")
def tiny_qwen2() -> str:
    return str(make_tiny_qwen2(Path(tempfile.mkdtemp(prefix="tiny_hf_")) / "qwen2"))


def test_offload_round_trips_and_training_is_unchanged(tiny_qwen2: str) -> None:
    ranks = run_distributed(_worker, 2, tiny_qwen2, _make_batch(seed=1))
    for r in ranks:
        parts = r["part_bytes"]
        assert r["adam_states"] > 0 and all(parts[p] > 0 for p in ("params", "grads", "optimizer")), parts
        assert r["moved"] == sum(parts.values()) == r["reloaded"]
        assert r["poisoned"], "offloaded parameters must not be readable (poison release)"
        assert r["poison_roundtrip"] and r["free_roundtrip"]
        assert r["free_device_bytes"]["optimizer"] == 0 and r["free_device_bytes"]["grads"] == 0
        assert all(n == 0 for n in r["free_sizes"])
        none, all_, opt = r["none"], r["all"], r["optimizer"]
        assert none["losses"] == all_["losses"] == opt["losses"] and len(none["losses"]) == 2
        for other in (all_, opt):
            assert all(torch.equal(a, b) for a, b in zip(none["params"], other["params"]))
            assert all(torch.equal(none["exported"][k], other["exported"][k]) for k in none["exported"])
        assert none["in_generation"] == [(), ()] and none["away"] == ()
        # "all": nothing of the actor on the device while generating (from the first step on), params after the sync.
        assert all_["in_generation"] == [("params", "grads", "optimizer")] * 2
        assert all_["away"] == ("params", "grads", "optimizer") and "is offloaded" in all_["error"]
        assert opt["in_generation"] == [("optimizer",)] * 2
        assert all_["trace"][0] == "start" and "start" not in none["trace"]
    assert ranks[0]["all"]["losses"] == ranks[1]["all"]["losses"]
