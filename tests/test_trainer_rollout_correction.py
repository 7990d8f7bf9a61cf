"""The trainer with FP8 rollout weights and MIS on the tiny model (one process, CPU): the step logs the mismatch and
correction metrics (one step, ~45 s). The fp32 path's mismatch < 1e-4 and the bytes of the FP8 sync are tested in
tests/rollout (test_actor_sync.py, test_fp8_weights.py)."""

from __future__ import annotations

import math

import pytest

from megatron_dapo.dev.tiny import make_tiny_run
from tests.test_trainer_e2e import _metrics
from tests.test_trainer_e2e import _train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("tiny"), num_train=16, num_test=4)


@pytest.mark.slow
def test_fp8_rollout_with_mis_logs_mismatch_and_correction(tiny, tmp_path):
    common = ("--trainer.total_steps=1", "--trainer.eval_every=0", "--checkpoint.save_every=0")
    _train(tiny, tmp_path / "fp8", *common, "--rollout.weight_dtype=fp8", "--algorithm.rollout_correction=mis", nproc=1)
    (row,) = _metrics(tmp_path / "fp8")
    for key in ("rollout_corr/kl_k3", "rollout_corr/log_ppl_diff", "rollout_corr/masked_fraction",
                "rollout_corr/is_weight_mean", "actor/loss"):  # fmt: skip
        assert math.isfinite(row[key]), key
    assert row["rollout_corr/kl_k3"] > 1e-6  # the FP8 engine samples from a different policy than the actor
    assert row["rollout/logprob_mismatch"] > 1e-4
    assert row["weight_sync/num_tensors"] > 0
