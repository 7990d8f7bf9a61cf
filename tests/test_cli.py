"""The megatron-dapo command line: eval, plot, convert (HF -> Megatron -> HF) and config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.dev.tiny import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("tiny_cli"), num_train=8, num_test=4)


def _cli(*args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "megatron_dapo.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)  # fmt: skip


def _overrides(tiny, run_dir):
    return tiny_overrides(tiny, run_dir)


def test_config_error_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  eps_hgih: 0.3\n")
    proc = _cli("train", "--config", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown key 'eps_hgih' in section [algorithm]" in proc.stderr


def test_eval_and_plot(tiny, tmp_path):
    proc = _cli("eval", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), *_overrides(tiny, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert result["eval/num_prompts"] == 4.0 and 0.0 <= result["eval/avg@4"] <= result["eval/pass@4"] <= 1.0
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/acc": 0.5}) + "\n")
    proc = _cli("plot", str(tmp_path))
    assert proc.returncode == 0 and (tmp_path / "plots" / "accuracy.png").exists()


def test_eval_reads_prompts_with_the_trainers_length_checks(tiny, tmp_path):
    """megatron-dapo eval loads the evaluation prompts as training does: one that does not fit data.max_prompt_length
    is a one-line error naming the file and row (it used to skip the tokenizer's checks), exit 2."""
    proc = _cli("eval", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), *_overrides(tiny, tmp_path),
                "--data.max_prompt_length=2")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {tiny['test']} row 0") and "prompt has" in line, line


@pytest.mark.slow
def test_convert_round_trip_is_bit_exact(tiny, tmp_path):
    config = str(ROOT / "examples" / "tiny_cpu.yaml")
    mcore = tmp_path / "mcore"
    proc = _cli("convert", "--config", config, "--to", "megatron", "--out", str(mcore), *_overrides(tiny, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    back = tmp_path / "hf"
    proc = _cli("convert", "--config", config, "--to", "hf", "--checkpoint", str(mcore), "--out", str(back),
                *_overrides(tiny, tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_file(str(Path(tiny["model"]) / "model.safetensors"))
    converted = load_file(str(back / "model.safetensors"))
    assert set(original) == set(converted)
    assert all(torch.equal(original[k], converted[k]) for k in original)
    # --to megatron seals its output, and --to hf verifies it: one flipped byte is a one-line error, exit 2
    assert (mcore / "MANIFEST.json").exists() and (mcore / "COMPLETE").exists()
    from megatron_dapo.actor.safe_unpickle import load_dcp_metadata

    storage = load_dcp_metadata(mcore / ".metadata").storage_data  # a byte of a weight the load reads
    info = next(v for k, v in storage.items() if k.fqn == "embedding.word_embeddings.weight")
    target = mcore / info.relative_path
    data = bytearray(target.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    target.write_bytes(bytes(data))
    proc = _cli("convert", "--config", config, "--to", "hf", "--checkpoint", str(mcore), "--out", str(tmp_path / "x"),
                *_overrides(tiny, tmp_path))  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error:") and "sha256" in line, line


def test_a_user_error_is_exit_2_whichever_rank_torchrun_stopped_first():
    import signal

    from megatron_dapo.cli import user_error_exit

    assert user_error_exit([2, -signal.SIGTERM])  # rank 0 exited 2, torchrun stopped rank 1
    assert user_error_exit([-signal.SIGTERM, 2])  # the race the other way round (was: exit 1)
    assert user_error_exit([2, 2])
    assert not user_error_exit([1, -signal.SIGTERM])  # a crash is not a user error
    assert not user_error_exit([2, -signal.SIGKILL])  # a rank killed by something else
    assert not user_error_exit([-signal.SIGTERM])
