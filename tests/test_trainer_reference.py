"""The trainer with GRPO's KL to a frozen reference model under torchrun (TP=2, gloo, the transformers engine): the
reference is built, its log-probs reach the loss every step (actor/ref_kl), and with actor.offload=all it leaves and
returns with the actor's parameters without changing the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_trainer_e2e import _metrics
from tests.test_trainer_e2e import _stable
from tests.test_trainer_e2e import _train
from tests.test_trainer_e2e import tiny  # noqa: F401 -- the module-scoped fixture

KL = ("--algorithm.policy_loss=grpo", "--loss.kl_coef=0.5", "--trainer.total_steps=2")


@pytest.mark.slow
def test_grpo_with_kl_trains_with_its_reference_offloaded_or_not(tiny, tmp_path):  # noqa: F811
    runs = {}
    for mode in ("none", "all"):
        runs[mode] = tmp_path / mode
        _train(tiny, runs[mode], *KL, f"--actor.offload={mode}")
    rows = [r for r in _metrics(runs["none"]) if r["step"] > 0]
    kls = [r["actor/ref_kl"] for r in rows]
    assert len(kls) == 2 and all(math.isfinite(k) and k >= 0 for k in kls), kls
    assert kls[1] > 0, "after a step the policy differs from its reference"
    assert _stable(_metrics(runs["all"])) == _stable(_metrics(runs["none"]))
    final = {m: load_file(str(Path(d) / "hf_final" / "model.safetensors")) for m, d in runs.items()}
    assert all(torch.equal(final["none"][k], final["all"][k]) for k in final["none"])
