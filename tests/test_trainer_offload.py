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
from tests.test_trainer_e2e import tiny  # noqa: F401 -- the module-scoped fixture


@pytest.mark.slow
def test_offload_all_trains_like_none(tiny, tmp_path):  # noqa: F811
    runs = {}
    for mode in ("none", "all"):
        run_dir = tmp_path / mode
        _train(tiny, run_dir, "--trainer.total_steps=2", f"--actor.offload={mode}")
        runs[mode] = run_dir
    assert _stable(_metrics(runs["all"])) == _stable(_metrics(runs["none"]))
    assert [r["step"] for r in _metrics(runs["all"])] == [0, 1, 2]
    final = {m: load_file(str(Path(d) / "hf_final" / "model.safetensors")) for m, d in runs.items()}
    assert all(torch.equal(final["none"][k], final["all"][k]) for k in final["none"])
    assert (runs["all"] / "checkpoints" / "step_00000002" / "COMPLETE").exists()
