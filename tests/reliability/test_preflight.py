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


def _model(tmp_path, **fields) -> str:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    base = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    (model / "config.json").write_text(json.dumps({**base, **fields}))
    return f"--actor.model_path={model}"


DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 48}  # fmt: skip
GLM = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "n_routed_experts": 8,
       "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
       "first_k_dense_replace": 1}  # fmt: skip


@pytest.mark.parametrize(
    "model, extra, world, message",
    [
        (DENSE, ["--actor.expert_parallel=2"], 2, "actor.expert_parallel: 2 needs a mixture-of-experts model; llama is "
                                                  "dense"),
        (DENSE, ["--actor.routing_replay=r3"], 2, "actor.routing_replay: r3 needs a mixture-of-experts model"),
        (MOE, ["--actor.expert_parallel=3"], 3, "actor.expert_parallel: 3 must divide the model's num_experts 8"),
        (GLM, ["--actor.pipeline_parallel=2", "--actor.routing_replay=r3"], 2, "actor.pipeline_parallel: 2 leaves "
                                                                               "the first stage only dense layers"),
        (MOE, ["--actor.expert_parallel=2"], 3, "actor.tensor_parallel 1 x actor.expert_parallel 2 x "
                                                "actor.pipeline_parallel 1 = 2 does not divide the actor's 3 ranks"),
        (MOE, ["--actor.expert_parallel=2", "--rollout.engine_ranks=1", "--trainer.max_staleness=0"], 4,
         "= 2 does not divide the actor's 3 ranks"),
    ],
)  # fmt: skip
def test_expert_layout_mistakes_are_found_before_launch(setup, tmp_path, model, extra, world, message):
    """Issue 38 item 4: expert parallelism not dividing the world, on a dense model, or not dividing the experts, and
    routing replay on a dense model passed `megatron-dapo check` and then failed in every rank's actor build (a
    traceback per rank, retried by launch and job.sh). The build's own check (actor.model.check_moe) now runs first."""
    overrides = [*setup, _model(tmp_path, **model), "--actor.tensor_parallel=1", *extra]
    with pytest.raises(StartupError) as err:
        _check(overrides, world=world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_valid_expert_layouts_pass(setup, tmp_path):
    _check([*setup, _model(tmp_path, **MOE), "--actor.tensor_parallel=1", "--actor.expert_parallel=2",
            "--actor.routing_replay=r3"], world=2)  # fmt: skip
    _check([*setup, _model(tmp_path, **DENSE), "--actor.tensor_parallel=1"], world=3)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"architectures": ["SomethingElse"], "model_type": "something"}, "model_type 'something' not supported; "
                                                                         "supported: ["),
        ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}, "not supported (Gemma 3's (1 + weight) "
                                                                               "RMSNorms, norms after attention"),
        ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "text_config": {"model_type": "gemma3_text", "num_attention_heads": 8}}, "sliding-window layers"),
    ],
)  # fmt: skip
def test_an_unsupported_architecture_is_refused_before_launch(setup, tmp_path, model, message):
    """Issue 41 item 5: a model the actor cannot build is refused by the start-up check in one line naming what is
    missing (Gemma 3: the layer-spec features megatron-core 0.16.1 lacks), not by a traceback in every rank's build;
    a multimodal config is judged by its text model."""
    with pytest.raises(StartupError) as err:
        _check([*setup, _model(tmp_path, **model), "--actor.tensor_parallel=1"], world=2)
    assert message in str(err.value) and "\n" not in str(err.value) and "config.json" in str(err.value)


def _saved_checkpoint(run_dir, config, step: int = 1):
    """A complete checkpoint directory as far as the resume check reads it: its config.yaml and COMPLETE marker."""
    import yaml

    from megatron_dapo.checkpoint import COMPLETE
    from megatron_dapo.checkpoint import MANIFEST
    from megatron_dapo.checkpoint import checkpoint_root
    from megatron_dapo.checkpoint import hash_files

    path = checkpoint_root(run_dir) / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    files = hash_files(path, ["config.yaml"])
    (path / MANIFEST).write_text(json.dumps({"version": 1, "algorithm": "sha256", "files": files}))
    (path / COMPLETE).write_text("done\n")
    return path


@pytest.mark.parametrize(
    "saved, now, message",
    [
        (["--actor.expert_parallel=2"], ["--actor.expert_parallel=1"], "actor.expert_parallel: 2 -> 1 (saved TP 1 x "
                                                                        "EP 2 x PP 1, now TP 1 x EP 1 x PP 1"),
        (["--actor.expert_parallel=1"], ["--actor.expert_parallel=2"], "actor.expert_parallel: 1 -> 2"),
        (["--algorithm.group_size=8"], ["--algorithm.group_size=4"], "algorithm.group_size: 8 -> 4"),
    ],
)  # fmt: skip
def test_a_resume_the_ranks_would_refuse_is_found_before_launch(setup, tmp_path, saved, now, message):
    """Issue 38 item 4: the checkpoint a resume would start from is checked against the config by `check`, `launch`
    and the sbatch check (was: only by every rank at start-up, after the launch). The newest complete checkpoint for
    checkpoint.resume=auto, or the one it names; resume=never and a compatible layout pass."""
    run_dir = tmp_path / "run"
    base = [*setup, _model(tmp_path, **MOE), "--actor.tensor_parallel=1", f"--trainer.run_dir={run_dir}"]
    path = _saved_checkpoint(run_dir, load_config(None, [*base, *saved]))
    with pytest.raises(StartupError) as err:
        _check([*base, *now], world=2)
    assert message in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value), str(err.value)
    with pytest.raises(StartupError, match="cannot resume"):
        _check([*base, *now, f"--checkpoint.resume={path}"], world=2)
    _check([*base, *now, "--checkpoint.resume=never"], world=2)
    _check([*base, *saved], world=2)


def test_a_damaged_newest_checkpoint_is_left_to_trains_fallback(setup, tmp_path):
    """A newest checkpoint whose config.yaml fails its manifest (or has none) is one train falls back past: the check
    looks at the previous one instead of refusing the launch."""
    run_dir = tmp_path / "run"
    base = [*setup, _model(tmp_path, **MOE), "--actor.tensor_parallel=1", f"--trainer.run_dir={run_dir}"]
    _saved_checkpoint(run_dir, load_config(None, [*base, "--actor.expert_parallel=2"]), step=1)
    newest = _saved_checkpoint(run_dir, load_config(None, [*base, "--actor.expert_parallel=1"]), step=2)
    (newest / "config.yaml").write_text("actor: {expert_parallel: 1, garbage: [")  # damaged: train falls back to 1
    with pytest.raises(StartupError, match="step_00000001: cannot resume.*actor.expert_parallel: 2 -> 1"):
        _check([*base, "--actor.expert_parallel=1"], world=2)
    (newest / "config.yaml").unlink()
    with pytest.raises(StartupError, match="step_00000001: cannot resume"):
        _check([*base, "--actor.expert_parallel=1"], world=2)


def test_expert_parallel_changed_above_one_reshards(setup, tmp_path):
    run_dir = tmp_path / "run"
    base = [*setup, _model(tmp_path, **MOE), "--actor.tensor_parallel=1", f"--trainer.run_dir={run_dir}"]
    _saved_checkpoint(run_dir, load_config(None, [*base, "--actor.expert_parallel=2"]))
    _check([*base, "--actor.expert_parallel=4"], world=4)  # EP 2 -> 4 resumes (measured: row 113)
