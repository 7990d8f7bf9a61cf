"""Hangs of issue 12 item 4, each bounded by a configurable limit that the test sets low.

- dynamic sampling with the default config stops at its cap of sampled prompts (max_gen_batches 10 x
  gen_prompts_per_batch) when every group is all-correct or all-wrong, with the counts; before, the default
  (0 = unlimited) spun silently forever. No cap in prompts needs one in time (algorithm.max_gen_minutes), and either
  bound ends the job with one line on every rank; SIGTERM stops a spinning step at once (issue 20, item 3a);
- a rank stopped (SIGSTOP) during generation ends the job within distributed.timeout_minutes, named and killed
  (issue 20, item 3b).
The verifier's time limit (reward.verify_timeout_s, on any thread) is in test_verifier_faults.py; the stopped-rank
case (distributed.timeout_minutes) is in test_actor_faults.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms.dynamic_sampling import DynamicSamplingError
from megatron_dapo.algorithms.dynamic_sampling import Group
from megatron_dapo.config import load_config
from tests.reliability.test_run_faults import ROOT
from tests.reliability.test_run_faults import _env
from tests.reliability.test_run_faults import _error_lines
from tests.reliability.test_run_faults import _launch
from tests.reliability.test_run_faults import _run
from tests.reliability.test_run_faults import _torchrun
from tests.reliability.test_run_faults import _wait_for


def test_default_dynamic_sampling_is_bounded_and_says_by_what():
    """Every group all-wrong: the step stops at the cap of sampled prompts (max_gen_batches x
    gen_prompts_per_batch, the default 10 batches) with the counts, instead of sampling forever."""
    overrides = ["--trainer.gen_prompts_per_batch=4", "--trainer.prompts_per_step=4", "--trainer.mini_batch_prompts=4"]
    cfg = load_config(None, overrides)
    step = DynamicSampler.from_config(cfg.algorithm, cfg.trainer).start()
    offered = 0
    while not step.done:
        assert offered < 1000, "dynamic sampling still undecided after 1000 prompts"
        step.offer(offered, Group(accs=torch.zeros(4, dtype=torch.bool), payload=offered))
        offered += 1
    assert offered == 40
    with pytest.raises(
        DynamicSamplingError,
        match=r"cap of 40 sampled prompts \(algorithm.max_gen_batches=10 x trainer.gen_prompts_per_batch=4\): "
        r"kept 0 of 4 prompts after sampling 40 \(0 all-correct, 40 all-wrong groups\)",
    ):
        step.result()


def test_unlimited_sampling_needs_a_bound_in_time():
    with pytest.raises(ValueError, match=r"algorithm.max_gen_batches: 0 \(no cap\) needs a bound in time"):
        load_config(None, ["--algorithm.max_gen_batches=0"])
    cfg = load_config(None, ["--algorithm.max_gen_batches=0", "--algorithm.max_gen_minutes=30"])
    assert DynamicSampler.from_config(cfg.algorithm, cfg.trainer).max_sampled_prompts == 0
    load_config(None, ["--algorithm.max_gen_batches=0", "--algorithm.dynamic_sampling=false"])  # no sampling loop


def test_a_cut_found_while_sampling_ends_the_step_and_says_by_what():
    cfg = load_config(None, ["--algorithm.max_gen_batches=0", "--algorithm.max_gen_minutes=0.5"])
    step = DynamicSampler.from_config(cfg.algorithm, cfg.trainer).start()
    for position in range(5):
        step.offer(position, Group(accs=torch.zeros(4, dtype=torch.bool), payload=position))
    assert not step.done and step.cap == 0
    step.stop_at(7, "algorithm.max_gen_minutes=0.5 (the queue was cut at 7 prompts)")
    step.stop_at(9, "a later, larger cut changes nothing")
    assert step.cap == 7 and not step.done
    for position in (5, 6):
        step.offer(position, Group(accs=torch.zeros(4, dtype=torch.bool), payload=position))
    assert step.done and step.decided == 7
    with pytest.raises(DynamicSamplingError, match=r"reached algorithm.max_gen_minutes=0.5 \(the queue was cut at 7 "
                       r"prompts\): kept 0 of \d+ prompts after sampling 7 .*; raise it or set"):  # fmt: skip
        step.result()


# ------------------------------------------------------------------------------------------ whole jobs, torchrun
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_dapo.dev.tiny import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("tiny_hangs"), num_train=24, num_test=4)


def _all_wrong(tiny, tmp_path) -> str:
    """The tiny train file with every ground truth a number the random model never writes: every group all-wrong."""
    rows = [json.loads(line) for line in Path(tiny["train"]).read_text().splitlines() if line.strip()]
    for row in rows:
        row["reward_model"]["ground_truth"] = "-987654321"
    out = tmp_path / "all_wrong.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


def _start(cmd: list[str], **env: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(cmd, env=_env(**env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            p.kill()


@pytest.mark.slow
def test_sampling_bounds_end_the_job_with_one_line_on_every_rank(tiny, tmp_path):
    """An all-wrong dataset: the prompt cap (on_max_gen_batches=error) and, with no prompt cap, the time bound end
    the job with one `error:` line and exit 2 on every rank (before: a DynamicSamplingError traceback per rank; with
    max_gen_batches=0, a spin that never ended; with partial, exit 0 after training on nothing)."""
    data = f"--data.train_files={_all_wrong(tiny, tmp_path)}"
    cases = {
        # the prompt cap with on_max_gen_batches=error
        "cap": (["--algorithm.max_gen_batches=2", "--algorithm.on_max_gen_batches=error"],
                "dynamic sampling reached its cap of 8 sampled prompts"),
        # the time bound with partial: each step trains on what was kept, none here, so the run trained nothing and
        # says so instead of exiting 0 (the time bound's own error line is checked in
        # test_a_cut_found_while_sampling_ends_the_step_and_says_by_what)
        "time": (["--algorithm.max_gen_batches=0", "--algorithm.max_gen_minutes=0.05",
                  "--algorithm.on_max_gen_batches=partial"],
                 "no optimizer update was applied in this run's 2 steps"),
    }  # fmt: skip
    for name, (overrides, expected) in cases.items():
        proc = _run(_torchrun(tiny, tmp_path / name, data, *overrides))
        out = proc.stdout + proc.stderr
        errors = _error_lines(out)
        assert len(errors) == 1 and expected in errors[0], out[-3000:]
        assert "exitcode  : 2" in out and out.count("Traceback (most recent call last)") == 1, out[-3000:]


@pytest.mark.slow
def test_a_resumed_attempt_that_keeps_no_group_ends_a_run_that_trained_with_exit_0(tiny, tmp_path):
    """The no-update rule is the run's, not the attempt's (issue 38 item 5): step 1 applies an update (dynamic
    sampling off: every group trains), then the resumed attempt's step 2 keeps no group (an answer format the model
    never writes, one sampling batch, on_max_gen_batches=partial). The run trained, so it finishes with exit 0 (was:
    exit 2, "nothing was trained", and a requeue loop marked the healthy job failed). A fresh run with step 2's
    settings still exits 2: test_sampling_bounds_end_the_job_with_one_line_on_every_rank."""
    run_dir = tmp_path / "run"
    first = _run(_torchrun(tiny, run_dir, "--trainer.total_steps=1", "--algorithm.dynamic_sampling=false"))
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["actor/num_updates"] - row["actor/skipped_steps"] >= 1, row
    nothing = [
        "--reward.answer_format=boxed",
        "--algorithm.max_gen_batches=1",
        "--algorithm.on_max_gen_batches=partial",
    ]
    resumed = _run(_torchrun(tiny, run_dir, "--trainer.total_steps=2", *nothing))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and not _error_lines(out), out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["sampling/prompts_kept"] == 0, rows[-1]


@pytest.mark.slow
def test_sigterm_stops_unbounded_sampling_at_once(tiny, tmp_path):
    """max_gen_batches=0 with an hour's time bound on an all-wrong dataset: SIGTERM stops generation within
    seconds (before: the flag was read only between steps, so nothing stopped the spin)."""
    unbounded = ["--algorithm.max_gen_batches=0", "--algorithm.max_gen_minutes=60", "--trainer.total_steps=1"]
    cmd = _launch(tiny, tmp_path / "run", f"--data.train_files={_all_wrong(tiny, tmp_path)}", *unbounded)
    proc, lines = _start(cmd)
    try:
        _wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists() or any("step 0" in x for x in lines), 240,
                  "the job to start")  # fmt: skip
        time.sleep(4)  # well into the spin (the job has started: step 0 was logged)
        assert proc.poll() is None, "".join(lines)[-3000:]
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        waited = time.monotonic() - signalled
    finally:
        _stop(proc)
    out = "".join(lines)
    assert "a preemption signal came before step 1's update; the step is dropped" in out, out[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert waited < 60, f"{waited:.0f} s from SIGTERM to exit"


def _stop_a_rank(
    cmd: list[str], hook: dict[str, str], ready: str, rank: str, sig: int = signal.SIGSTOP
) -> tuple[str, psutil.Process, float]:
    """Run `cmd` under tests._hooks_driver with the slow `hook`; once a line holds `ready`, send `sig` (SIGSTOP) to
    the worker of RANK `rank` and wait for the job's end. Returns (its output, that process, seconds from the signal
    to the end); a stopped process is continued if it survived, and no process of the job may outlive it."""
    cmd[cmd.index("megatron_dapo.cli")] = "tests._hooks_driver"
    proc, lines = _start(cmd, **hook)
    target, family = None, []
    try:
        _wait_for(lambda: any(ready in x for x in lines), 240, repr(ready))
        family = psutil.Process(proc.pid).children(recursive=True)
        workers = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == rank]
        assert len(workers) == 1
        target = workers[0]
        target.send_signal(sig)
        signalled = time.monotonic()
        proc.wait(timeout=180)
        waited = time.monotonic() - signalled
    finally:
        if target is not None and target.is_running():
            target.send_signal(signal.SIGCONT)
        _stop(proc)
    time.sleep(1)
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running after the job: {[(p.pid, p.cmdline()[:6]) for p in alive]}"
    return "".join(lines), target, waited


@pytest.mark.slow
def test_a_stopped_rank_during_generation_ends_the_job_naming_it(tiny, tmp_path):
    """SIGSTOP of rank 1 while it generates: rank 0 sees its heartbeat stand still for distributed.timeout_minutes
    (0.25 here: the beat is a thread's, so slow work never stands it still; before, rollout.generation_timeout_minutes
    =60 applied), ends the job with one line naming rank 1 and kills the stopped process (same host)."""
    cmd = _torchrun(tiny, tmp_path / "run", "--distributed.timeout_minutes=0.25", "--trainer.total_steps=3",
                    "--algorithm.max_gen_batches=10")  # fmt: skip
    out, stopped, waited = _stop_a_rank(cmd, {"SLOW_GEN": "2:2"}, "generation of step 2 is slow", "1")
    errors = _error_lines(out)
    assert len(errors) == 1, out[-3000:]
    assert f"rank 1 (host {socket.gethostname()}, pid {stopped.pid}, killed) made no progress for 15 s" in errors[0]
    assert waited < 120, f"{waited:.0f} s from SIGSTOP to the end of the job"
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE


SPLIT = ["--rollout.engine_ranks=1", "--trainer.max_staleness=0", "--actor.tensor_parallel=1", "--trainer.eval_every=0",
         "--trainer.total_steps=3", "--algorithm.max_gen_batches=10"]  # fmt: skip
"""A split launch of the tiny job: actor rank 0, engine rank 1."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "stopped, hook, waiter",
    [
        # the engine rank, while it generates step 2: actor rank 0 waits for that generation
        ("1", {"SLOW_GEN": "1:2"}, "engine rank 1 (host {host}, pid {pid}, killed) made no progress for 15 s while "
                                   "rank 0 waited for step 2's generation"),
        # actor rank 0, in step 1's log-probs: the engine rank (lockstep, max_staleness 0) waits for step 2's weights
        ("0", {"SLOW_LOGP": "1:4"}, "actor rank 0 (host {host}, pid {pid}, killed) made no progress for 15 s while "
                                    "rank 1 waited for the weights of step 2"),
        # the engine rank, stopped while actor rank 0 is in step 1's log-probs: the actor then waits for it to join
        # step 1's weight push (was: inside gloo's broadcast until its timeout, then a traceback)
        ("1", {"SLOW_LOGP": "1:4"}, "engine rank 1 (host {host}, pid {pid}, killed) made no progress for 15 s while "
                                    "rank 0 waited for the engine ranks to join the weight push of step 1"),
    ],
)  # fmt: skip
def test_a_stopped_rank_of_a_split_launch_ends_the_job_naming_it(tiny, tmp_path, stopped, hook, waiter):
    """Issue 38 item 3: on a split launch a stopped engine rank held the actor for rollout.generation_timeout_minutes
    (60 min), and a stopped actor left the engine ranks waiting for weights for ever. Every rank beats
    (placement.launch_watch) and each wait checks the peers it waits on: distributed.timeout_minutes (0.25 here) after
    the SIGSTOP the waiting rank ends the job with one line naming the stopped rank's role, rank, host and pid, and
    kills it (same host)."""
    cmd = _torchrun(tiny, tmp_path / "run", *SPLIT, "--distributed.timeout_minutes=0.25")
    out, target, waited = _stop_a_rank(cmd, hook, "test hook:", stopped)
    errors = _error_lines(out)
    assert len(errors) == 1, out[-3000:]
    assert waiter.format(host=socket.gethostname(), pid=target.pid) in errors[0], errors[0]
    assert waited < 90, f"{waited:.0f} s from SIGSTOP to the end of the job"
    assert not target.is_running() or target.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize(
    "killed, hook, role",
    [("1", {"SLOW_GEN": "1:2"}, "the engine rank, generating step 2"),
     ("0", {"SLOW_LOGP": "1:4"}, "actor rank 0, in step 1's log-probs")],
)  # fmt: skip
def test_a_killed_rank_of_a_split_launch_ends_the_job_at_once(tiny, tmp_path, killed, hook, role):
    """The SIGKILL neighbour of the stopped-rank cases (issue 38 item 6): with the default distributed timeout, a rank
    of either role killed mid-step ends the whole job within a minute (torchrun sees the death and signals the
    others; the actor gives up on a dead engine's answer after placement.STOP_ANSWER_S, an engine rank leaves when
    actor rank 0's beat stops), no process outlives it, and torchrun's summary names the killed rank."""
    cmd = _torchrun(tiny, tmp_path / "run", *SPLIT)
    out, target, waited = _stop_a_rank(cmd, hook, "test hook:", killed, sig=signal.SIGKILL)
    assert waited < 60, f"{waited:.0f} s from the SIGKILL of {role} to the end of the job"
    assert f"rank      : {killed}" in out and "exitcode  : -9" in out, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]  # torchrun's summary only
    if role.startswith("the engine rank, generating"):  # the actor, signalled while it waited, dropped the step
        assert "a preemption signal came before step 2's update; the step is dropped" in out, out[-3000:]
    elif role.startswith("the engine rank, before"):  # signalled while it waited for the dead engine to join
        assert "step 1: a preemption signal came while an engine rank had not joined the weight push" in out, out[
            -3000:
        ]


@pytest.mark.slow
def test_sigterm_while_the_engine_rank_is_stopped_saves_and_exits_within_the_grace(tiny, tmp_path):
    """Issue 38 item 3: torchrun's SIGTERM (a preemption) reached actor rank 0 while it waited for a stopped engine
    rank's generation; it asked the engines to stop and waited for their answer until SIGKILLed 30 s later. Now the
    answer is awaited placement.STOP_ANSWER_S at most: the step is dropped, the last step saved, and the actor exits
    cleanly well within the launcher's 30 s."""
    from megatron_dapo.placement import STOP_ANSWER_S

    run_dir = tmp_path / "run"
    cmd = _torchrun(tiny, run_dir, *SPLIT, "--checkpoint.save_every=0")
    cmd[cmd.index("megatron_dapo.cli")] = "tests._hooks_driver"
    proc, lines = _start(cmd, SLOW_GEN="1:2")
    engine = None
    try:
        _wait_for(lambda: any("test hook:" in x for x in lines), 240, "step 2's slow generation")
        engine = next(p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1")
        actor = next(p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "0")
        engine.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker, as a scheduler's preemption does
        signalled = time.monotonic()
        _wait_for(lambda: not actor.is_running() or actor.status() == psutil.STATUS_ZOMBIE, 60, "the actor's exit")
        actor_s = time.monotonic() - signalled
        proc.wait(timeout=60)
    finally:
        if engine is not None and engine.is_running():
            engine.send_signal(signal.SIGCONT)
        _stop(proc)
    out = "".join(lines)
    assert "a preemption signal came before step 2's update; the step is dropped" in out, out[-3000:]
    assert STOP_ANSWER_S <= actor_s < 30, f"the actor exited {actor_s:.0f} s after SIGTERM"
    assert (run_dir / "checkpoints" / "step_00000001" / "COMPLETE").exists()  # the last step, saved on the way out


_BUSY_HEARTBEAT = """
import torch.distributed as dist
from datetime import timedelta
from megatron_dapo.rollout import stream
stream.HEARTBEAT_S = 0.0  # the thread is inside the store call almost all the time
master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
watch = stream.PeerWatch(master, rank=0, world_size=1, stall_s=60.0)
{ending}
"""


@pytest.mark.parametrize("ending", ["pass", "watch.close()"])
def test_the_heartbeat_thread_does_not_abort_the_process_at_exit(ending):
    """A daemon thread left in a TCPStore call when the interpreter finalizes aborts the process after a clean run
    ("terminate called without an active exception"; seen once in CI at the end of a DP=2 job). The heartbeat joins
    at exit whether or not the job closed it."""
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", _BUSY_HEARTBEAT.format(ending=ending)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
