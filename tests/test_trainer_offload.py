"""The trainer with actor.offload=all under torchrun (TP=2, gloo, the transformers engine): the choreography's path
through train_step, the checkpoint saves (the actor's files written in the step's update phase, the last one after
the engine is released for good; no save re-syncs the engine), eval and the final export gives the same run as
offload=none, across a hard kill and a resume from such a checkpoint."""

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
    offload = ("--trainer.total_steps=4", "--actor.offload=all")
    assert _train(tiny, runs["all"], *offload, fault="after_step:2", check=False).returncode != 0
    assert (runs["all"] / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    _train(tiny, runs["all"], *offload)
    assert "(step 2 of 4)" in Path(runs["all"]).with_suffix(".run.log").read_text()
    assert _stable(_metrics(runs["all"])) == _stable(_metrics(runs["none"]))
    assert [r["step"] for r in _metrics(runs["all"])] == [0, 1, 2, 3, 4]
    final = {m: load_file(str(Path(d) / "hf_final" / "model.safetensors")) for m, d in runs.items()}
    assert all(torch.equal(final["none"][k], final["all"][k]) for k in final["none"])
    assert (runs["all"] / "checkpoints" / "step_00000004" / "COMPLETE").exists()
