"""Resuming a run_dir after a change the checkpoint cannot absorb (issue 20, item 5): the model directory replaced
at the same actor.model_path, actor.use_distributed_optimizer switched, a trainer state or RNG file crafted or taken
from another checkpoint (with a forged manifest). Each is one line at start-up naming the file or field, on every
rank, before the actor loads anything (before: a shape-mismatch, KeyError or unpickling traceback per rank)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo.checkpoint import MANIFEST
from megatron_dapo.checkpoint import checkpoint_files
from megatron_dapo.checkpoint import hash_files
from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.launch import StartupError
from megatron_dapo.resume import check_architecture
from tests.reliability.test_data_identity import Startup
from tests.reliability.test_data_identity import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("tiny_changes"), num_train=8, num_test=2)


def _saved_run(tiny, tmp_path, *overrides: str):
    """A run_dir with one checkpoint (trainer state only), its config and model directory (a copy we may edit)."""
    model = tmp_path / "model"
    shutil.copytree(tiny["model"], model)
    config = tiny_config({**tiny, "model": str(model)}, tmp_path / "run", *overrides)
    first = Startup(config)
    first.step = 1
    first.ckpt.save(1, first.trainer_state(), config.to_dict(), lambda d: d.mkdir())
    return model, config


def _resume(config) -> None:
    Startup(config).find()


def test_model_replaced_at_the_same_path_is_named(tiny, tmp_path):
    model, config = _saved_run(tiny, tmp_path)
    _resume(config)  # unchanged: resumes
    hf = json.loads((model / "config.json").read_text())
    layers = hf["num_hidden_layers"]
    hf["num_hidden_layers"] = layers + 2
    (model / "config.json").write_text(json.dumps(hf))
    with pytest.raises(StartupError) as err:
        _resume(config)
    assert "cannot resume, the model at actor.model_path is not the one this checkpoint was trained from" in str(
        err.value
    )
    assert f"num_hidden_layers: {layers} -> {layers + 2}" in str(err.value) and "\n" not in str(err.value)


def test_architecture_check_ignores_checkpoints_from_before_it():
    check_architecture(None, {"hidden_size": 64}, "ckpt")


def test_switching_the_distributed_optimizer_is_named(tiny, tmp_path):
    _, config = _saved_run(tiny, tmp_path, "--actor.use_distributed_optimizer=false")
    switched = tiny_config({**tiny, "model": config.actor.model_path}, Path(config.trainer.run_dir),
                           "--actor.use_distributed_optimizer=true")  # fmt: skip
    with pytest.raises(StartupError, match=r"actor.use_distributed_optimizer: False -> True"):
        _resume(switched)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _forge_manifest(ckpt: Path) -> None:
    """Re-hash the checkpoint's files into its manifest: the file was replaced by someone who forged it too."""
    files = hash_files(ckpt, checkpoint_files(ckpt))
    (ckpt / MANIFEST).write_text(json.dumps({"version": 1, "algorithm": "sha256", "files": files}))


RNG = "actor/rng_rank00000_of1.pt"  # the actor's RNG file of rank 0 in a one-process run (Startup)


@pytest.mark.parametrize("case", ["crafted_rng", "not_rng", "other_step_state", "garbage_state"])
def test_crafted_or_mismatched_state_files_are_named(tiny, tmp_path, case):
    _, config = _saved_run(tiny, tmp_path)
    ckpt = Path(config.trainer.run_dir) / "checkpoints" / "step_00000001"
    marker = tmp_path / "marker"
    name, expected = {
        "crafted_rng": (RNG, "rng_rank00000_of1.pt: refused to load it"),
        "not_rng": (RNG, "rng_rank00000_of1.pt: not an RNG state (expected torch, python, tracker)"),
        "other_step_state": ("trainer_state.pt", "trainer_state.pt: holds step 7, but it sits in step_00000001"),
        "garbage_state": ("trainer_state.pt", "trainer_state.pt: refused to load it"),
    }[case]
    if case == "crafted_rng":
        with open(ckpt / name, "wb") as f:
            pickle.dump(_Payload(marker), f)
    elif case == "not_rng":
        torch.save({"seed": 1}, ckpt / name)
    elif case == "other_step_state":
        state = torch.load(ckpt / name, weights_only=True)
        torch.save({**state, "step": 7}, ckpt / name)
    else:
        (ckpt / name).write_bytes(b"\x00" * 64)
    _forge_manifest(ckpt)
    with pytest.raises(StartupError) as err:
        _resume(config)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not marker.exists()
