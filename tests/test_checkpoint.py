import os
import signal

import pytest
import torch

from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.checkpoint import PreemptionFlag
from megatron_dapo.checkpoint import check_compatible
from megatron_dapo.checkpoint import latest_checkpoint
from megatron_dapo.checkpoint import list_checkpoints
from megatron_dapo.config import RunConfig


def _save(mgr, step, cfg, **kw):
    def save_actor(d):
        d.mkdir()
        torch.save({"w": torch.full((2,), float(step))}, d / "w.pt")

    return mgr.save(step, {"step": step, "data": {"epoch": 0, "position": step * 4}}, cfg, save_actor, **kw)


def test_save_keep_last_and_load(tmp_path):
    cfg = RunConfig().to_dict()
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3):
        _save(mgr, step, cfg)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_00000002", "step_00000003"]
    _save(mgr, 4, cfg)
    loaded = {}
    state = mgr.load(latest_checkpoint(tmp_path / "ck"), cfg, lambda d, items: loaded.update(torch.load(d / "w.pt")))
    assert state["step"] == 4 and state["data"]["position"] == 16 and loaded["w"][0] == 4.0
    # The RNG states are the actor's (actor/rng_rank*_of*.pt, restored by its load): the manager writes none.
    assert not list(latest_checkpoint(tmp_path / "ck").glob("rng*"))


def test_crash_during_write_leaves_previous_loadable(tmp_path):
    cfg = RunConfig().to_dict()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1, cfg)

    def crash(point):
        if point == "in_save":
            raise KeyboardInterrupt("killed while saving")

    with pytest.raises(KeyboardInterrupt):
        _save(mgr, 2, cfg, test_hook=crash)
    assert (tmp_path / "step_00000002.partial").exists()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert mgr.load(latest_checkpoint(tmp_path), cfg)["step"] == 1
    _save(mgr, 2, cfg)  # the next save cleans the partial one up
    assert not (tmp_path / "step_00000002.partial").exists() and latest_checkpoint(tmp_path).name == "step_00000002"


def test_a_save_begun_in_the_step_completes_at_its_boundary(tmp_path):
    """begin (directory + actor files, where the actor's state is) then complete (trainer state, manifest): a
    checkpoint equal to one `save` writes; until complete it is only `.partial`, and a complete without its begin
    is refused."""
    cfg = RunConfig().to_dict()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1, cfg)
    mgr.begin(2, lambda d: (d.mkdir(), torch.save({"w": torch.full((2,), 2.0)}, d / "w.pt")))
    assert mgr.has_begun(2) and not mgr.has_begun(1)
    assert (tmp_path / "step_00000002.partial").is_dir() and latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(RuntimeError, match="step 3's save was not begun"):
        mgr.complete(3, {"step": 3}, cfg)
    mgr.begin(2, lambda d: (d.mkdir(), torch.save({"w": torch.full((2,), 2.0)}, d / "w.pt")))
    mgr.complete(2, {"step": 2, "data": {"epoch": 0, "position": 8}}, cfg)
    assert not mgr.has_begun(2) and not (tmp_path / "step_00000002.partial").exists()
    assert mgr.verify(tmp_path / "step_00000002") == []
    loaded = {}
    state = mgr.load(latest_checkpoint(tmp_path), cfg, lambda d, items: loaded.update(torch.load(d / "w.pt")))
    assert state["step"] == 2 and loaded["w"][0] == 2.0


def test_incompatible_config_is_named(tmp_path):
    saved = RunConfig().to_dict()
    current = RunConfig().to_dict()
    current["algorithm"]["group_size"] = 8
    current["trainer"]["total_steps"] = 5  # allowed
    with pytest.raises(ValueError, match=r"algorithm.group_size: 16 -> 8"):
        check_compatible(saved, current, "ck")
    mgr = CheckpointManager(tmp_path, keep_last=1)
    path = _save(mgr, 1, saved)
    with pytest.raises(ValueError, match="cannot resume"):
        mgr.load(path, current)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        mgr.load(tmp_path / "nope", saved)


def test_preemption_flag_catches_signals():
    old = {s: signal.getsignal(s) for s in PreemptionFlag.SIGNALS}
    try:
        flag = PreemptionFlag()
        flag.install()
        assert not flag.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requested() and flag.signum == signal.SIGUSR1
        assert flag.requested(lambda t: t * 0 + 1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_moe_checkpoint_refuses_expert_parallel_between_1_and_more():
    """check_compatible's MoE rule: expert_parallel may change among values above 1 (megatron reshards), not between
    1 and more (a chained optimizer for the experts exists only with expert parallelism); dense models never mind."""

    def config(ep: int) -> dict:
        c = RunConfig().to_dict()
        c["actor"].update(expert_parallel=ep, tensor_parallel=1)
        return c

    check_compatible(config(2), config(4), "ck", moe=True)
    check_compatible(config(1), config(2), "ck", moe=False)
    for saved, now in ((2, 1), (1, 2), (1, 8)):
        with pytest.raises(ValueError, match=rf"actor.expert_parallel: {saved} -> {now} \(saved TP 1 x EP {saved} x "):
            check_compatible(config(saved), config(now), "ck", moe=True)
    with pytest.raises(ValueError, match="config.yaml is not a run config"):
        check_compatible(["not", "a", "dict"], config(1), "ck")
