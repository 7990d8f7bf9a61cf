"""Start-up checks that need no process group (megatron_dapo.launch.preflight), the fast cases; the same errors
under torchrun with 2 ranks (one `error:` line, exit 2) are in test_run_faults.py."""

from __future__ import annotations

import json

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.launch import StartupError
from megatron_dapo.launch import preflight


@pytest.fixture
def setup(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 3}))  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    return [f"--actor.model_path={model}", f"--data.train_files={data}", "--rollout.engine=transformers"]


def _check(overrides: list[str], world: int = 2) -> None:
    preflight(load_config(None, overrides), world)


def test_a_valid_layout_passes(setup):
    _check([*setup, "--actor.tensor_parallel=2"], world=4)
    _check([*setup, "--actor.tensor_parallel=2", "--rollout.engine_ranks=1", "--trainer.max_staleness=0"], world=3)


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (["--actor.tensor_parallel=2", "--actor.pipeline_parallel=2"], 6, "= 4 does not divide the world size 6"),
        (["--actor.tensor_parallel=4"], 4, "actor.tensor_parallel 4 must divide the model's num_key_value_heads 2"),
        (["--actor.pipeline_parallel=2"], 2, "actor.pipeline_parallel 2 must divide the model's num_hidden_layers 3"),
        (["--data.eval_files=/nope/test.jsonl"], 2, "data.eval_files[0]: /nope/test.jsonl does not exist"),
        (["--data.train_files=/nope/a.jsonl"], 2, "data.train_files[0]: /nope/a.jsonl does not exist"),
        (
            ["--actor.tensor_parallel=2", "--rollout.engine_ranks=1", "--trainer.max_staleness=0"],
            4,
            "= 2 does not divide the actor's 3 ranks (4 launched, rollout.engine_ranks 1)",
        ),
        (
            ["--rollout.engine_ranks=2", "--trainer.max_staleness=0"],
            2,
            "rollout.engine_ranks 2 leaves no actor rank of the 2 processes launched",
        ),
    ],
)
def test_layout_and_file_errors(setup, extra, world, message):
    with pytest.raises(StartupError) as err:
        _check([*setup, *extra], world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_model_dir_without_config_json(setup, tmp_path):
    (tmp_path / "model" / "config.json").unlink()
    with pytest.raises(StartupError, match="has no config.json"):
        _check(setup)


def test_engine_package_missing(setup, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StartupError, match=r"rollout.engine=vllm, but the vllm package is not installed"):
        _check([*setup, "--rollout.engine=vllm"])
