"""Preemption signals after the first checkpoint (issue 20, item 1), launched as users launch (plain torchrun and
`megatron-dapo launch`, 2 ranks, the tiny CPU job, one phase slowed by tests/_hooks_driver.py):

- in a save: that save completes (before: megatron's checkpoint-writer helper, started at the first save in the
  worker's process group, died of torchrun's killpg(SIGTERM) and the save failed with BrokenPipeError on every rank,
  leaving step_N.partial); the next step stops in its generation and the job exits on that save;
- in generation: the stream stops at once, the step is abandoned and the job exits on the last saved state;
- in the log-probs pass (before the step's first optimizer step, issue 22 item 1): the step is abandoned at the end
  of the pass, as in generation (a signal during the update lets the step finish and save it:
  test_run_faults.py::test_sigterm_during_a_step_longer_than_30_s_still_saves_that_step);

then nothing is left `.partial`, no process of the job outlives it, and the resumed job ends identical (metrics and
weights) to one that was never interrupted.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.reliability.test_run_faults import _args
from tests.reliability.test_run_faults import _env
from tests.reliability.test_run_faults import _metric_steps
from tests.reliability.test_run_faults import _wait_for
from tests.test_trainer_e2e import _metrics
from tests.test_trainer_e2e import _stable

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "tests._hooks_driver"
STEPS = ("--trainer.total_steps=4", "--checkpoint.save_every=1", "--checkpoint.keep_last=4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_dapo.dev.tiny import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("tiny_preempt"), num_train=48, num_test=4)


def _torchrun(tiny, run_dir) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", DRIVER]
    return run + ["train", *_args(tiny, run_dir, *STEPS)]


def _launch(tiny, run_dir) -> list[str]:
    run = [sys.executable, "-m", "megatron_dapo.cli", "launch", "--nproc-per-node=2", f"--module={DRIVER}"]
    return run + [*_args(tiny, run_dir, *STEPS), "--checkpoint.preempt_grace_s=120"]


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    proc = subprocess.run(_torchrun(tiny, run_dir), env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def _interrupt(cmd: list[str], sig: signal.Signals, hook: dict[str, str], when: str) -> tuple[int, str, list]:
    """Run `cmd`, send `sig` to the launcher once a line containing `when` appears; returns (exit code, output, the
    job's processes seen just before the signal)."""
    proc = subprocess.Popen(cmd, env=_env(**hook), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    family: list[psutil.Process] = []
    try:
        _wait_for(lambda: any(when in x for x in lines), 240, repr(when))
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                p.kill()
    reader.join(10)
    return proc.returncode, "".join(lines), family


CASES = {
    # name: (launcher, signal, slow phase, the line after which the signal is sent, last checkpoint saved, resumed
    # here). Plain torchrun's SIGTERM reaches the writer helper in the save case (started by step 1's save, used by
    # step 2's). The generation case leaves the state the log-probs case leaves (step 1's checkpoint, nothing after
    # it), whose resume is checked there.
    "launch_sigusr1_in_logprobs": (_launch, signal.SIGUSR1, {"SLOW_LOGP": "2:5"}, "log-probs of step 2", 1, True),
    "torchrun_sigterm_in_a_save": (_torchrun, signal.SIGTERM, {"SLOW_SAVE": "2:5"}, "the save of step 2", 2, True),
    "launch_sigterm_in_generation": (_launch, signal.SIGTERM, {"SLOW_GEN": "2:4"}, "generation of step 2", 1, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_preemption_after_the_first_checkpoint_saves_and_resumes_exactly(tiny, straight, tmp_path, case):
    launcher, sig, hook, when, saved, resume = CASES[case]
    run_dir = tmp_path / "run"
    code, out, family = _interrupt(launcher(tiny, run_dir), sig, hook, when)
    # megatron-dapo launch exits 128 + signal; plain torchrun exits 1 with its own SignalException traceback.
    assert code == (128 + sig if launcher is _launch else 1), out[-4000:]
    assert "BrokenPipeError" not in out, out[-4000:]
    assert out.count("Traceback") == out.count("SignalException: Process"), out[-4000:]  # no worker traceback
    ckpts = run_dir / "checkpoints"
    assert not list(ckpts.glob("*.partial")), sorted(p.name for p in ckpts.iterdir())
    newest = max(int(p.name.split("_")[1]) for p in ckpts.iterdir() if (p / "COMPLETE").exists())
    assert newest == saved, out[-4000:]
    assert _metric_steps(run_dir) == list(range(1, saved + 1))
    dropped = "a preemption signal came before step 2's update; the step is dropped, the last one saved, exiting"
    assert (dropped in out) == (saved == 1), out[-4000:]
    time.sleep(2)
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running after the job: {[(p.pid, p.cmdline()[:4]) for p in alive]}"
    if not resume:
        return
    resumed = subprocess.run(_torchrun(tiny, run_dir), env=_env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _stable(_metrics(run_dir)) == _stable(_metrics(straight))
    final, expected = (load_file(str(d / "hf_final" / "model.safetensors")) for d in (run_dir, straight))
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_a_rank_killed_mid_step_restarts_the_job_which_ends_as_if_uninterrupted(tiny, straight, tmp_path):
    """Rank 1 alone SIGKILLed (as the OOM killer would) while writing step 3's checkpoint: `megatron-dapo launch`
    restarts the job (distributed.max_restarts), rank 0 says why in one line, and the restarted attempt resumes from
    step 2's checkpoint and ends with the metrics and weights of a run that was never interrupted (issue 22, item 3)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(_launch(tiny, run_dir), env=_env(MEGATRON_DAPO_CRASH="before_manifest:3:1:kill"), cwd=ROOT,
                          capture_output=True, text=True, timeout=420)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = [x for x in out.splitlines() if "restart 1 of 2 (distributed.max_restarts): attempt 0 ended:" in x]
    assert len(lines) == 1, out[-4000:]
    assert "no rank recorded an error" in lines[0] or "rank 1 recorded nothing (killed by a signal" in lines[0]
    assert lines[0].endswith("resuming from the last verified checkpoint")
    assert re.search(r"checkpoint \S*step_00000003.partial is incomplete", out), out[-4000:]  # killed mid-save
    assert re.search(r"resumed from \S*step_00000002 \(step 2 of 4\)", out), out[-4000:]
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    assert _metric_steps(run_dir) == [1, 2, 3, 4]
    assert _stable(_metrics(run_dir)) == _stable(_metrics(straight))
    final, expected = (load_file(str(d / "hf_final" / "model.safetensors")) for d in (run_dir, straight))
    assert all(torch.equal(final[k], expected[k]) for k in expected)
