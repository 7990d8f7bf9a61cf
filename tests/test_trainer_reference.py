"""The trainer with GRPO's KL to a frozen reference model under torchrun (TP=2, gloo, the transformers engine), with
actor.offload=all (the reference leaves and returns with the actor's parameters every step): the reference is built,
its log-probs reach the loss every step (actor/ref_kl), and the run completes with its checkpoint and export. That
offloading changes nothing bit for bit is shown at the actor level (tests/actor/test_reference.py) and for the
choreography by tests/test_trainer_offload.py."""

from __future__ import annotations

import math

import pytest

from tests.test_trainer_e2e import _metrics
from tests.test_trainer_e2e import _train

KL = ("--algorithm.policy_loss=grpo", "--loss.kl_coef=0.5", "--trainer.total_steps=2", "--actor.offload=all")


@pytest.mark.slow
def test_grpo_with_kl_trains_with_its_reference_offloaded(tiny, tmp_path):
    run_dir = tmp_path / "run"
    _train(tiny, run_dir, *KL)
    rows = [r for r in _metrics(run_dir) if r["step"] > 0]
    kls = [r["actor/ref_kl"] for r in rows]
    assert len(kls) == 2 and all(math.isfinite(k) and k >= 0 for k in kls), kls
    assert kls[1] > 0, "after a step the policy differs from its reference"
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    assert (run_dir / "hf_final" / "model.safetensors").exists()
