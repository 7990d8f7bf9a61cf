"""The trainer with actor.offload=all under torchrun (TP=2, gloo, the transformers engine): the choreography's path
through train_step, the checkpoint save (state reloaded in the update's slot, then re-synced), eval and the final
export gives the same run as offload=none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_trainer_e2e import _metrics
from tests.test_trainer_e2e import _stable
from tests.test_trainer_e2e import _train


@pytest.mark.slow
def test_offload_all_trains_like_none(tiny, straight, tmp_path):
    """actor.offload=all (every part of the actor in host memory while the engine generates) gives the straight run's
    metrics and weights (the `straight` run: offload none, 4 steps)."""
    runs = {"none": straight, "all": tmp_path / "all"}
    _train(tiny, runs["all"], "--trainer.total_steps=4", "--actor.offload=all")
    assert _stable(_metrics(runs["all"])) == _stable(_metrics(runs["none"]))
    assert [r["step"] for r in _metrics(runs["all"])] == [0, 1, 2, 3, 4]
    final = {m: load_file(str(Path(d) / "hf_final" / "model.safetensors")) for m, d in runs.items()}
    assert all(torch.equal(final["none"][k], final["all"][k]) for k in final["none"])
    assert (runs["all"] / "checkpoints" / "step_00000004" / "COMPLETE").exists()
