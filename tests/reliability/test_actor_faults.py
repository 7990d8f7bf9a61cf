"""Actor faults on CPU/gloo (2 ranks, DP=2), each a probe case of issue 12 that failed before its fix:

- a checkpoint saved before the first optimizer step loads and resumes bit-identically, with the plain and the
  distributed optimizer (the save used to assert, the load used to raise KeyError optimizer.state.exp_avg);
- a crafted RNG pickle inside a checkpoint is refused by name and runs nothing;
- updates skipped in a row stop at trainer.max_skipped_steps with a message naming it (lr 1e30 and NaN inputs);
- non-finite weights after a step (lr inf) stop the update;
- a stopped (SIGSTOP) peer fails a collective after distributed.timeout_minutes, not after 30 minutes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.batch import ActorBatch
from megatron_dapo.config import ActorConfig
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import RolloutConfig
from megatron_dapo.config import RunConfig
from megatron_dapo.config import TrainerConfig
from megatron_dapo.config import load_config
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import VOCAB
from tests.actor._tiny_models import make_tiny_qwen2


def _config(hf_dir: str, *, dist_opt: bool, max_skipped: int = 10) -> RunConfig:
    return RunConfig(
        actor=ActorConfig(
            model_path=hf_dir,
            dtype="fp32",
            lr=1e-3,
            lr_warmup_steps=0,
            grad_clip=1.0,
            logprob_impl="reference",
            use_distributed_optimizer=dist_opt,
        ),
        trainer=TrainerConfig(
            prompts_per_step=4,
            gen_prompts_per_batch=4,
            mini_batch_prompts=4,
            micro_batch_size=2,
            max_skipped_steps=max_skipped,
        ),
        algorithm=AlgorithmConfig(group_size=2, overlong_buffer=4),
        rollout=RolloutConfig(engine="transformers", max_response_length=8),
    )


def _batch(b: int = 8, s: int = 10) -> ActorBatch:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (b, s), generator=gen)
    response = torch.zeros(b, s)
    response[:, 4:] = 1.0
    return ActorBatch(
        tokens=tokens, loss_mask=response.clone(), response_mask=response, advantages=torch.randn(b, generator=gen)
    )


def _weights(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in actor.model for p in chunk.parameters()]


class _Evil:
    """Unpickling this calls os.makedirs(marker): the stand-in for arbitrary code in a crafted checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _checkpoint_worker(hf_dir: str, work: str) -> dict:
    import torch.distributed as dist

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    groups = init_distributed(1, 1)
    rank = dist.get_rank()
    import megatron_dapo

    out: dict = {"module": megatron_dapo.__file__}
    batch = _batch()
    for dist_opt in (False, True):
        ckpt = f"{work}/before_step_{dist_opt}"
        fresh = MegatronActor(_config(hf_dir, dist_opt=dist_opt), groups, hf_dir=hf_dir)
        out[f"save_error_{dist_opt}"] = _error(lambda: fresh.save_checkpoint(ckpt))  # noqa: B023
        resumed = MegatronActor(_config(hf_dir, dist_opt=dist_opt), groups)  # random init, then the checkpoint
        out[f"load_error_{dist_opt}"] = _error(lambda: resumed.load_checkpoint(ckpt))  # noqa: B023
        batch.old_logp, _ = fresh.compute_logprobs(batch)
        for actor in (fresh, resumed):
            for _ in range(2):
                actor.update(batch)
        out[f"identical_{dist_opt}"] = all(torch.equal(a, b) for a, b in zip(_weights(fresh), _weights(resumed)))
        out[f"steps_{dist_opt}"] = (fresh.steps.num_steps, resumed.steps.num_steps)

    # A crafted RNG file in an otherwise valid checkpoint: refused by name, nothing runs.
    ckpt = f"{work}/crafted"
    actor = MegatronActor(_config(hf_dir, dist_opt=True), groups, hf_dir=hf_dir)
    actor.save_checkpoint(ckpt)
    marker = f"{work}/pwned_rank{rank}"
    rng_file = Path(ckpt) / f"rng_rank{rank:05d}_of2.pt"
    out["rng_file_existed"] = rng_file.exists()
    torch.save({"python": _Evil(marker), "torch": torch.get_rng_state()}, rng_file)
    out["crafted_error"] = _error(lambda: actor.load_checkpoint(ckpt))
    out["crafted_ran"] = os.path.exists(marker)

    # NaN inputs: skipped steps in a row stop at trainer.max_skipped_steps.
    actor = MegatronActor(_config(hf_dir, dist_opt=True, max_skipped=2), groups, hf_dir=hf_dir)
    bad = ActorBatch(**{k: (v.clone() if v is not None else None) for k, v in vars(batch).items()})
    bad.old_logp[2, 5] = float("nan")
    out["nan_first"] = _error(lambda: actor.update(bad))
    out["nan_second"] = _error(lambda: actor.update(bad))

    # lr 1e30 (accepted before the config check): one update blows the weights up, then every update is skipped.
    actor = MegatronActor(_config(hf_dir, dist_opt=True, max_skipped=2), groups, hf_dir=hf_dir)
    actor.config.actor.lr = 1e30
    out["huge_lr"] = [_error(lambda: actor.update(batch)) for _ in range(3)]

    # lr inf: the step writes non-finite weights; the check after the step stops it.
    actor = MegatronActor(_config(hf_dir, dist_opt=False), groups, hf_dir=hf_dir)
    actor.config.actor.lr = float("inf")
    out["inf_lr"] = _error(lambda: actor.update(batch))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("actor_faults")
    hf_dir = str(make_tiny_qwen2(root / "qwen2"))
    return run_distributed(_checkpoint_worker, 2, hf_dir, str(root), timeout_s=400)


def test_runs_the_worktree_copy(results):
    assert results[0]["module"].startswith(str(Path(__file__).resolve().parents[2])), results[0]["module"]


@pytest.mark.parametrize("dist_opt", [False, True], ids=["plain_optimizer", "distributed_optimizer"])
def test_checkpoint_saved_before_first_step_resumes(results, dist_opt):
    for r in results:
        assert r[f"save_error_{dist_opt}"] is None, r[f"save_error_{dist_opt}"]
        assert r[f"load_error_{dist_opt}"] is None, r[f"load_error_{dist_opt}"]
        assert r[f"steps_{dist_opt}"] == (2, 2)
        assert r[f"identical_{dist_opt}"], "a run resumed from a step-0 checkpoint must continue bit-identically"


def test_crafted_rng_pickle_runs_nothing(results):
    for rank, r in enumerate(results):
        assert r["rng_file_existed"]
        assert not r["crafted_ran"], "unpickling the checkpoint ran code"
        assert r["crafted_error"] is not None and f"rng_rank{rank:05d}_of2.pt" in r["crafted_error"], r["crafted_error"]


def test_skipped_updates_stop_at_max_skipped_steps(results):
    for r in results:
        assert r["nan_first"] is None
        assert r["nan_second"] is not None and "trainer.max_skipped_steps=2" in r["nan_second"], r["nan_second"]
        first, second, third = r["huge_lr"]
        assert first is None and second is None, (first, second)
        assert third is not None and "trainer.max_skipped_steps=2" in third, third


def test_non_finite_weights_stop_the_update(results):
    for r in results:
        assert r["inf_lr"] is not None and "non-finite weights after optimizer step 1" in r["inf_lr"], r["inf_lr"]


def _stalled_peer_worker(override: str) -> dict:
    import torch.distributed as dist

    from megatron_dapo.actor.distributed import init_distributed

    cfg = load_config(None, [override])
    groups = init_distributed(1, 1, timeout_s=cfg.distributed.timeout_s)
    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stalled until rank 0 sends SIGCONT
        return {}
    out = {}
    for name, group in (("world", groups.world_group), ("megatron_dp", groups.dp_group)):
        start = time.monotonic()
        out[f"{name}_error"] = _error(lambda: dist.all_reduce(torch.ones(1), group=group))  # noqa: B023
        out[f"{name}_s"] = time.monotonic() - start
    os.kill(pids[1], signal.SIGCONT)
    return out


def test_stopped_rank_fails_collectives_after_configured_timeout():
    start = time.monotonic()
    r0, _ = run_distributed(_stalled_peer_worker, 2, "--distributed.timeout_minutes=0.05", timeout_s=120)
    for name in ("world", "megatron_dp"):
        assert r0[f"{name}_error"] is not None, name
        assert 2.0 < r0[f"{name}_s"] < 30.0, (name, r0[f"{name}_s"])  # configured 3 s, not the 1800 s default
    assert time.monotonic() - start < 110
