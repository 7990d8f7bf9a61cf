"""Whole-job faults of issue 12 on the tiny CPU run (examples/tiny_cpu.yaml) under torchrun with 2 ranks:

- start-up errors (TP x PP vs world, heads vs TP, missing model, sglang missing, no data, an over-long prompt):
  one `error:` line from rank 0, every worker exits 2 (before: one traceback per rank);
- 0x40 bytes written into a shard of the newest checkpoint plus a torn last metrics.jsonl line: resume names the
  corrupt checkpoint, takes the previous one and drops the torn line (before: silent weights change / every resume
  failed in json.loads);
- a second job on a run_dir in use fails naming the holder's host and pid; kill -9 of the launcher stops the
  workers (they save first); the next job takes the dead job's lock over, logged;
- SIGTERM during a step longer than torchrun's 30 s SIGTERM -> SIGKILL window: `megatron-dapo launch` gives the
  workers checkpoint.preempt_grace_s, the step finishes and is saved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.launch import RunDirLock

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("tiny_faults"), num_train=24, num_test=4)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}
    env.pop("MEGATRON_DAPO_FAULT", None)
    return env


def _args(tiny, run_dir, *overrides: str) -> list[str]:
    return [
        "--config",
        CONFIG,
        f"--actor.model_path={tiny['model']}",
        f"--data.train_files={tiny['train']}",
        f"--data.eval_files={tiny['test']}",
        f"--trainer.run_dir={run_dir}",
        "--logging.console=plain",
        "--logging.plots=false",
        "--trainer.eval_every=0",
        *overrides,
    ]


def _torchrun(tiny, run_dir, *overrides: str) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return run + ["-m", "megatron_dapo.cli", "train", *_args(tiny, run_dir, *overrides)]


def _launch(tiny, run_dir, *overrides: str, module: str = "megatron_dapo.cli") -> list[str]:
    run = [sys.executable, "-m", "megatron_dapo.cli", "launch", "--nproc-per-node=2", f"--module={module}"]
    return run + _args(tiny, run_dir, *overrides)


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def _model_with_heads(tiny, tmp_path, kv_heads: int) -> str:
    model = tmp_path / "model_kv3"
    shutil.copytree(tiny["model"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads)
    (model / "config.json").write_text(json.dumps(cfg))
    return str(model)


def _sglang_imports() -> bool:
    try:
        import sglang  # noqa: F401
    except Exception:
        return False
    return True


CASES = {
    "tp_pp_vs_world": (
        ["--actor.tensor_parallel=2", "--actor.pipeline_parallel=2"],
        "actor.tensor_parallel 2 x actor.pipeline_parallel 2 = 4 does not divide the world size 2",
    ),
    "heads_vs_tp": (["MODEL_KV3"], "actor.tensor_parallel 2 must divide the model's num_key_value_heads 3"),
    "missing_model": (["--actor.model_path=/nonexistent/model"], "actor.model_path: /nonexistent/model does not exist"),
    "sglang_missing": (["--rollout.engine=sglang"], "rollout.engine=sglang, but the sglang package"),
    "no_data_files": (["--data.train_files="], "data.train_files: no data files given"),
    "overlong_prompt": (["--data.max_prompt_length=8"], "train.jsonl row 0 (line 1): prompt has"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_startup_error_is_one_line_from_rank_0_and_exit_2(tiny, tmp_path, case):
    if case == "sglang_missing" and _sglang_imports():
        pytest.skip("sglang imports on this machine")
    overrides, expected = CASES[case]
    overrides = [f"--actor.model_path={_model_with_heads(tiny, tmp_path, 3)}" if o == "MODEL_KV3" else o
                 for o in overrides]  # fmt: skip
    proc = _run(_torchrun(tiny, tmp_path / "run", *overrides))
    out = proc.stdout + proc.stderr
    errors = _error_lines(out)
    assert len(errors) == 1 and expected in errors[0], out[-3000:]
    # torchrun's own ChildFailedError summary follows: every rank finds the same fault and exits 2, whichever is
    # first on a loaded machine (torchrun then stops the others); the workers add no traceback of their own.
    assert re.search(r"rank      : [01] \(local_rank: [01]\)\n  exitcode  : 2", out), out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]


@pytest.mark.slow
def test_launch_prints_the_error_once_without_starting_torchrun(tiny, tmp_path):
    proc = _run(_launch(tiny, tmp_path / "run", *CASES["tp_pp_vs_world"][0]))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"error: {CASES['tp_pp_vs_world'][1]} (processes launched)", proc.stderr


def _metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_corrupt_newest_checkpoint_and_torn_metrics_line_resume_from_the_previous(tiny, tmp_path):
    run_dir = tmp_path / "run"
    first = _run(_launch(tiny, run_dir, "--trainer.total_steps=2", "--checkpoint.save_every=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    shard = sorted((run_dir / "checkpoints" / "step_00000002" / "actor").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x40" * 0x40)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "actor/entro')
    resumed = _run(_launch(tiny, run_dir, "--trainer.total_steps=3", "--checkpoint.save_every=1"))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    # The shard's size is unchanged, so the bytes are found while loading (each read once: test_verified_load.py).
    assert f"step_00000002 is corrupt: checkpoint {shard.parent}/{shard.name} bytes " in out, out[-3000:]
    assert "fail their sha256 check (read while loading)" in out and "; trying the previous one" in out
    assert "resumed from" in out and "step_00000001 (step 1 of 3)" in out
    assert "metrics.jsonl line 3: not a metrics row" in out
    assert _metric_steps(run_dir) == [1, 2, 3]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.mark.slow
def test_run_dir_lock_and_workers_exit_when_the_launcher_dies(tiny, tmp_path):
    run_dir = tmp_path / "run"
    held = RunDirLock(run_dir)
    held.acquire()
    busy = _run(_launch(tiny, run_dir))
    held.release()
    expected = f"{run_dir} is in use by another job (host {socket.gethostname()} pid {os.getpid()}, since "
    assert busy.returncode == 2 and _error_lines(busy.stderr) and expected in busy.stderr, busy.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists()

    log = open(tmp_path / "long.log", "w")
    cmd = _launch(tiny, run_dir, "--trainer.total_steps=1000", "--checkpoint.save_every=0")
    launcher = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    workers: list[psutil.Process] = []
    try:
        _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and _metric_steps(run_dir), 180, "step 1")
        workers.extend(psutil.Process(launcher.pid).children())
        assert len(workers) == 2
        holder = json.loads((run_dir / ".lock").read_text())
        (run_dir / ".lock").unlink()  # the probe's bypass: the lock file deleted during the run (issue 38 item 3)
        second = _run(_launch(tiny, run_dir))
        assert second.returncode == 2 and f"{run_dir} is in use by another job" in second.stderr, second.stderr[-3000:]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait_for(lambda: not any(w.is_running() and w.status() != "zombie" for w in workers), 90, "workers to exit")
    finally:  # never leave an orphaned worker training on (what this test checks for)
        if launcher.poll() is None:
            workers.extend(psutil.Process(launcher.pid).children())
            launcher.kill()
        for worker in workers:
            if worker.is_running():
                worker.kill()
        log.close()
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "COMPLETE").exists(), (tmp_path / "long.log").read_text()[-3000:]
    step = int(saved[-1].name.split("_")[1])
    assert holder["pid"] == workers[0].pid or holder["pid"] == workers[1].pid

    # The workers released the lock on their way out; a job killed outright leaves its lock file behind.
    (run_dir / ".lock").write_text(json.dumps(holder))
    # Every group trains in this one-step session (with dynamic sampling a random model's step may keep none, and a
    # session that applied no update exits 2 by design: row 78).
    again = _run(_launch(tiny, run_dir, f"--trainer.total_steps={step + 1}", "--algorithm.dynamic_sampling=false"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"taking over the lock left by host {holder['host']} pid {holder['pid']}" in again.stderr
    assert _metric_steps(run_dir)[-1] == step + 1


@pytest.mark.slow
def test_sigterm_during_a_step_longer_than_30_s_still_saves_that_step(tiny, tmp_path):
    run_dir = tmp_path / "run"
    cmd = _launch(tiny, run_dir, "--trainer.total_steps=3", "--checkpoint.save_every=0",
                  "--checkpoint.preempt_grace_s=75", module="tests._hooks_driver")  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(SLOW_STEP="1:36"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        _wait_for(lambda: any("test hook: step 1 takes" in x for x in lines), 180, "the slow step")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=150)
        waited = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            children = psutil.Process(proc.pid).children()
            proc.kill()
            for child in children:
                if child.is_running():
                    child.kill()
    reader.join(10)
    out = "".join(lines)
    assert waited > 31, f"exited {waited:.0f} s after SIGTERM: the step was not longer than torchrun's window"
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM came" in out and "before this step boundary; saving, then exiting" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "step_00000001" / "COMPLETE").exists(), out[-3000:]
    assert _metric_steps(run_dir) == [1]
