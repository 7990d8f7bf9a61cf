"""The commands that read a checkpoint verify it as a resume does (issue 38, item 2): `status` decides "finished"
only on a checkpoint train would accept, and `convert --to hf` exports only one that verifies.

The probe: with the newest checkpoint corrupt or without a manifest, `status --requeue` printed "finished" and did not
requeue, although train refused that checkpoint; without scontrol on PATH it was a traceback (hidden by job.sh's
`|| true`); `convert --to hf` never read MANIFEST.json and exported a shard resume refused. The checkpoints here
hold a real torch_dist actor directory (the tiny model, `convert --to megatron`), so the pickle checks and the item
layout are the ones a run writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.actor.checkpointing import checkpoint_items
from megatron_dapo.actor.safe_unpickle import load_dcp_metadata
from megatron_dapo.checkpoint import MANIFEST
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.checkpoint import checkpoint_root
from megatron_dapo.cli import EXIT_RESUMABLE
from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.dev.tiny import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    """A real actor checkpoint directory of the tiny model, and the tiny run's paths."""
    base = tmp_path_factory.mktemp("status")
    tiny = make_tiny_run(base / "tiny", num_train=8, num_test=4)
    out = base / "mcore"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_dapo.cli", "convert", "--config", CONFIG, "--to", "megatron", "--out",
         str(out), *tiny_overrides(tiny, base / "convert_run")],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, tiny


sealed = shutil.ignore_patterns(MANIFEST, "COMPLETE")  # convert's seal: a run's actor/ has neither


def _run_with_checkpoints(actor_dir, tmp_path, steps=(1, 2), total=2):
    """A run dir holding checkpoints `steps` as a run saves them (manifest with item hashes, COMPLETE)."""
    src, tiny = actor_dir
    run_dir = tmp_path / "run"
    mgr = CheckpointManager(
        checkpoint_root(run_dir), keep_last=5,
        layout=lambda path: {f"actor/{k}": v for k, v in checkpoint_items(path / "actor").items()},
    )  # fmt: skip
    for step in steps:
        mgr.save(step, {"step": step}, {"actor": {}}, lambda d: shutil.copytree(src, d, ignore=sealed))
    return run_dir, [*tiny_overrides(tiny, run_dir), f"--trainer.total_steps={total}"]


def _cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megatron_dapo.cli", *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _status(overrides, tmp_path, *extra, scontrol=True):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if scontrol:
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "slurm.log"}\n')
        (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:/bin", PYTHONPATH=str(ROOT), SLURM_JOB_ID="4242")
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "status", "--config", CONFIG, *overrides, *extra]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _flip_weight_byte(step_dir: Path) -> None:
    storage = load_dcp_metadata(step_dir / "actor" / ".metadata").storage_data
    info = next(v for k, v in storage.items() if k.fqn == "embedding.word_embeddings.weight")
    path = step_dir / "actor" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_intact_newest_checkpoint_at_the_last_step_is_finished(actor_dir, tmp_path):
    _, overrides = _run_with_checkpoints(actor_dir, tmp_path)
    proc = _status(overrides, tmp_path, "--requeue")
    assert proc.returncode == 0 and proc.stdout.startswith("finished: step 2 of 2"), proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "slurm.log").exists()


@pytest.mark.parametrize("damage", ["a weight byte", "no manifest", "an empty manifest", "no COMPLETE marker"])
def test_a_newest_checkpoint_train_refuses_is_not_finished(actor_dir, tmp_path, damage):
    """Each damage train refuses (a byte the load's item check catches; a manifest missing or listing nothing; an
    interrupted save) makes status name the checkpoint train falls back to, and requeue."""
    run_dir, overrides = _run_with_checkpoints(actor_dir, tmp_path)
    newest = checkpoint_root(run_dir) / "step_00000002"
    if damage == "a weight byte":
        _flip_weight_byte(newest)
    elif damage == "no manifest":
        (newest / MANIFEST).unlink()
    elif damage == "an empty manifest":
        (newest / MANIFEST).write_text(json.dumps({"version": 2, "algorithm": "sha256", "files": {}}))
    else:
        (newest / "COMPLETE").unlink()
    proc = _status(overrides, tmp_path, "--requeue")
    assert proc.returncode == EXIT_RESUMABLE, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith("resumable: step 1 of 2") and "step_00000001" in proc.stdout, proc.stdout
    assert "requeued: Slurm job 4242 (resumes from step 1)" in proc.stdout
    assert (tmp_path / "slurm.log").read_text() == "requeue 4242\n"
    assert "step_00000002" in proc.stderr  # the refused checkpoint is named


def test_no_usable_checkpoint_is_one_line_exit_2(actor_dir, tmp_path):
    run_dir, overrides = _run_with_checkpoints(actor_dir, tmp_path, steps=(1,))
    (checkpoint_root(run_dir) / "step_00000001" / MANIFEST).unlink()
    proc = _status(overrides, tmp_path, "--requeue")
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("error: ") and "allow_unverified" in proc.stdout
    assert not (tmp_path / "slurm.log").exists()
    allowed = _status([*overrides, "--checkpoint.allow_unverified=true"], tmp_path)  # as train would, with a warning
    assert allowed.returncode == EXIT_RESUMABLE and allowed.stdout.startswith("resumable: step 1 of 2"), allowed.stdout


def test_no_scontrol_on_path_is_one_line(actor_dir, tmp_path):
    _, overrides = _run_with_checkpoints(actor_dir, tmp_path, steps=(1,))
    proc = _status(overrides, tmp_path, "--requeue", scontrol=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith("error: scontrol requeue 4242:"), proc.stdout


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/megatron_dapo_convert_pwned",))


def _hostile_common(actor: Path) -> None:
    import torch

    torch.save({"payload": Exploit()}, actor / "common.pt")


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist"),
        ("a file", "not a directory"),
        ("an empty directory", "no MANIFEST.json"),
        ("a byte flipped in the step's shard", "sha256"),
        ("the step's manifest emptied", "MANIFEST.json does not list"),
        ("the step's manifest of the wrong shape", "MANIFEST.json is malformed"),
        ("a code-running pickle, unsealed, allow_unverified", "refused to unpickle 'posix.system'"),
        ("a code-running pickle under the step's manifest", "actor/common.pt has"),
        ("no --checkpoint", "needs --checkpoint"),
    ],
)
def test_convert_to_hf_exports_only_a_checkpoint_that_verifies(actor_dir, tmp_path, case, expected):
    """Every way a checkpoint handed to `convert --to hf` can be missing or hostile: one `error:` line, exit 2, no
    export, nothing run. The checkpoint is given as a run's step directory or its actor/ (both verify)."""
    run_dir, overrides = _run_with_checkpoints(actor_dir, tmp_path, steps=(1,))
    step = checkpoint_root(run_dir) / "step_00000001"
    target: Path | None = step / "actor"
    extra: list[str] = []
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "a file":
        target = step / "config.yaml"
    elif case == "an empty directory":
        target = tmp_path / "empty"
        target.mkdir()
    elif case.startswith("a byte flipped"):
        _flip_weight_byte(step)
    elif case.endswith("emptied"):
        (step / MANIFEST).write_text(json.dumps({"version": 2, "algorithm": "sha256", "files": {}}))
        target = step
    elif case.endswith("wrong shape"):
        (step / MANIFEST).write_text(json.dumps({"version": 2, "algorithm": "sha256", "files": []}))
    elif case.endswith("allow_unverified"):
        target = tmp_path / "unsealed"
        shutil.copytree(step / "actor", target)
        _hostile_common(target)
        extra = ["--checkpoint.allow_unverified=true"]
    elif case.endswith("manifest"):
        _hostile_common(step / "actor")
    elif case == "no --checkpoint":
        target = None
    out = tmp_path / "hf"
    marker = Path("/tmp/megatron_dapo_convert_pwned")
    marker.unlink(missing_ok=True)
    where = ["--checkpoint", str(target)] if target is not None else []
    proc = _cli("convert", "--config", CONFIG, "--to", "hf", *where, "--out", str(out), *overrides, *extra)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and not marker.exists()


def test_convert_to_hf_of_a_run_step_is_the_actor_it_saved(actor_dir, tmp_path):
    """The positive neighbour: a run's step directory (MANIFEST.json beside actor/) exports, with the item checks."""
    from safetensors.torch import load_file

    run_dir, overrides = _run_with_checkpoints(actor_dir, tmp_path, steps=(1,))
    out = tmp_path / "hf"
    step = checkpoint_root(run_dir) / "step_00000001"
    proc = _cli("convert", "--config", CONFIG, "--to", "hf", "--checkpoint", str(step), "--out", str(out), *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_file(str(Path(actor_dir[1]["model"]) / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert set(original) == set(converted) and all(original[k].equal(converted[k]) for k in original)


@pytest.fixture(scope="module")
def hf_export(actor_dir, tmp_path_factory):
    """A Hugging Face export of this package (`convert --to hf`: sealed with MANIFEST.json and COMPLETE)."""
    base = tmp_path_factory.mktemp("hf_export")
    run_dir, overrides = _run_with_checkpoints(actor_dir, base, steps=(1,))
    out = base / "hf"
    step = checkpoint_root(run_dir) / "step_00000001"
    proc = _cli("convert", "--config", CONFIG, "--to", "hf", "--checkpoint", str(step), "--out", str(out), *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / MANIFEST).exists() and (out / "COMPLETE").exists()
    return out, step, overrides


def _eval(model: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    few = ["--trainer.eval_max_prompts=2", "--trainer.eval_samples=2", "--rollout.max_response_length=8",
           "--algorithm.overlong_buffer=4"]  # fmt: skip
    return _cli("eval", "--config", CONFIG, "--model", str(model), *overrides, *few)


def _damaged(export: Path, step: Path, tmp_path: Path, case: str) -> Path:
    """A copy of the sealed export with `case` done to it (or another path standing for it)."""
    model = tmp_path / "model"
    shutil.copytree(export, model)
    if case == "missing":
        return tmp_path / "nope"
    if case == "a file":
        return model / "config.json"
    if case == "a Megatron checkpoint":
        return step
    if case.startswith("a byte flipped"):
        data = bytearray((model / "model.safetensors").read_bytes())
        data[-3] ^= 0x01
        (model / "model.safetensors").write_bytes(bytes(data))
    elif case.endswith("emptied"):
        (model / MANIFEST).write_text(json.dumps({"version": 1, "algorithm": "sha256", "files": {}}))
    elif case.endswith("wrong shape"):
        (model / MANIFEST).write_text(json.dumps({"version": 1, "algorithm": "sha256", "files": []}))
    elif case.endswith("pickle added"):
        import torch

        torch.save({"payload": Exploit()}, model / "pytorch_model.bin")
    else:
        (model / "COMPLETE").unlink()
    return model


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist"),
        ("a file", "not a directory"),
        ("a Megatron checkpoint", "a Megatron checkpoint, not a Hugging Face model"),
        ("a byte flipped in the weights", "model.safetensors fails its sha256 check"),
        ("the manifest emptied", "MANIFEST.json does not list"),
        ("the manifest of the wrong shape", "MANIFEST.json is malformed"),
        ("a code-running pickle added", "MANIFEST.json does not list pytorch_model.bin"),
        ("no COMPLETE marker", "no COMPLETE marker"),
    ],
)
def test_eval_verifies_the_model_it_loads(hf_export, tmp_path, case, expected):
    """What `megatron-dapo eval --model` checks before loading (checkpoint.verified_hf_model): an export of this
    package verified as resume verifies a checkpoint; every damage is one line naming what fails, and nothing runs."""
    from megatron_dapo.checkpoint import CheckpointError
    from megatron_dapo.checkpoint import verified_hf_model

    export, step, _ = hf_export
    marker = Path("/tmp/megatron_dapo_convert_pwned")
    marker.unlink(missing_ok=True)
    with pytest.raises(CheckpointError) as err:
        verified_hf_model(_damaged(export, step, tmp_path, case), log=pytest.fail)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not marker.exists()


def test_eval_of_a_damaged_export_is_one_line_exit_2(hf_export, tmp_path):
    """The same check through the CLI: one `error:` line, exit 2, before any model loads."""
    export, step, overrides = hf_export
    proc = _eval(_damaged(export, step, tmp_path, "a code-running pickle added"), overrides)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "MANIFEST.json does not list pytorch_model.bin" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not Path("/tmp/megatron_dapo_convert_pwned").exists()


def test_eval_of_a_sealed_export_and_of_a_model_from_elsewhere(hf_export, actor_dir):
    """The positive neighbours: the export verifies and evaluates; a model without a manifest (the base model) loads
    as it is, with a notice saying so."""
    export, _, overrides = hf_export
    for model, notice in ((export, False), (Path(actor_dir[1]["model"]), True)):
        proc = _eval(model, overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "avg@" in proc.stdout or "pass@" in proc.stdout, proc.stdout[-2000:]
        assert ("no MANIFEST.json (not an export of this package); loaded as it is" in proc.stderr) == notice
