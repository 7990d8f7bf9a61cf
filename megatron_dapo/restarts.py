"""Restarting a failed job from its last verified checkpoint, bounded by distributed.max_restarts, with one line
saying why (docs/reliability.md rows 64-67, docs/cluster.md "Restarts").

Who restarts: `megatron-dapo launch` runs torchrun with --max-restarts (its agents restart the whole worker group,
every node together); examples/slurm/job.sh reruns srun. Either way each attempt's processes know their attempt
number (TORCHELASTIC_RESTART_COUNT from torchrun, DAPO_RESTART_COUNT from job.sh) and the checkpoint.resume=auto logic
resumes the last verified checkpoint (on a restart also when checkpoint.resume names a path or is "never": the
restart continues this job's own run, not a new one).

What a restart knows about the attempt before it (files under run_dir/failures/):
    attempt-{k}.start.json    rank 0 at the start of attempt k: time, host, and the cgroup's OOM-kill count
    attempt-{k}.rank-{r}.json a rank whose training raised: the step, the error's type and first line, and whether a
                              restart can help (`retryable`: False for user errors, which a restart only repeats)
A process killed by a signal (the host's OOM killer, kill -9, a crash in native code, a lost node) writes nothing;
then the cgroup's OOM-kill counter, read again at the next start, tells an OOM kill from the rest.

At the start of attempt k > 0 every rank calls `previous_attempt(run_dir, k)`: rank 0 prints its line; an attempt
whose predecessor ended on an error that is not retryable exits 2 at once (torchrun may call a few more attempts,
each ends the same way in seconds).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

FAILURES_DIR = "failures"
ATTEMPT_ENV = ("TORCHELASTIC_RESTART_COUNT", "DAPO_RESTART_COUNT")
"""Where a process finds its attempt number: torchrun's agent sets the first, examples/slurm/job.sh the second."""

OOM_COUNTERS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
"""cgroup v2 and v1 files with an `oom_kill N` line: processes of this cgroup the kernel's OOM killer killed."""


def attempt_number(env: Mapping[str, str] | None = None) -> int:
    """This process's attempt (0: the job's first start) from the launcher's environment."""
    env = os.environ if env is None else env
    for name in ATTEMPT_ENV:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return 0


def oom_kills(paths: tuple[str, ...] = OOM_COUNTERS) -> int | None:
    """The OOM-kill count of this process's cgroup, or None where no counter is readable."""
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def _dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / FAILURES_DIR


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)


def record_start(run_dir: str | Path, attempt: int, world: int, paths: tuple[str, ...] = OOM_COUNTERS) -> None:
    """Rank 0, at the start of an attempt: what the next attempt compares against."""
    record = {"attempt": attempt, "time": time.time(), "host": socket.gethostname(), "world": world}
    _write(_dir(run_dir) / f"attempt-{attempt}.start.json", {**record, "oom_kills": oom_kills(paths)})


GPU_OOM_HINT = (
    " (GPU out of memory: check the layout with `megatron-dapo plan`; lower actor.max_tokens_per_microbatch or "
    "rollout.mem_fraction, or set actor.offload)"
)
"""Appended to a torch.OutOfMemoryError's line: a restart repeats the same step, so it says what to change."""


def record_failure(
    run_dir: str | Path, attempt: int, rank: int, step: int | None, err: BaseException, retryable: bool
) -> None:
    """A rank whose training raised `err` (at `step`, None before the trainer existed); never raises itself."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    record = {
        "attempt": attempt,
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "step": step,
        "error": f"{type(err).__name__}: {first}"[:400]
        + (GPU_OOM_HINT if type(err).__name__ == "OutOfMemoryError" else ""),
        "retryable": retryable,
    }
    try:
        _write(_dir(run_dir) / f"attempt-{attempt}.rank-{rank}.json", record)
    except OSError:
        pass  # a full or read-only disk must not hide the original error


def is_retryable(err: BaseException) -> bool:
    """Whether a restart can help: user errors (a bad config or input, found at start or while training) repeat on
    every restart, so they end the job; everything else (a bug that depends on timing, an out-of-memory error, a
    peer that died or stalled, a failed write) is worth one more try from the last checkpoint."""
    from megatron_dapo.config import ConfigError
    from megatron_dapo.errors import JobError
    from megatron_dapo.launch import StartupError

    if isinstance(err, JobError):
        return err.retryable
    return not isinstance(err, (StartupError, ConfigError))


@dataclass(frozen=True, slots=True)
class PreviousAttempt:
    """What ended attempt k - 1: `line`, the one line rank 0 prints (empty: already printed by an earlier attempt);
    `retry`, whether attempt k should train; `refusal`, the record of the error a restart repeats (carried forward by
    `carry_refusal`, so that every later attempt torchrun calls ends the same way, quietly)."""

    line: str
    retry: bool
    refusal: dict | None = None


def carry_refusal(run_dir: str | Path, attempt: int, rank: int, previous: PreviousAttempt) -> None:
    """Attempt `attempt` ends at start because of `previous.refusal`: record it again as this attempt's."""
    if previous.refusal is not None:
        record = {**previous.refusal, "attempt": attempt, "rank": rank, "carried": True}
        try:
            _write(_dir(run_dir) / f"attempt-{attempt}.rank-{rank}.json", record)
        except OSError:
            pass


def _load(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def previous_attempt(
    run_dir: str | Path, attempt: int, max_restarts: int, paths: tuple[str, ...] = OOM_COUNTERS
) -> PreviousAttempt:
    """Why attempt `attempt - 1` ended (attempt > 0), from its records and the cgroup's OOM-kill counter."""
    folder, before = _dir(run_dir), attempt - 1
    head = f"restart {attempt} of {max_restarts} (distributed.max_restarts)"
    ranks = sorted(
        (r for r in (_load(p) for p in folder.glob(f"attempt-{before}.rank-*.json")) if r),
        key=lambda r: (r.get("time", 0.0), r.get("rank", 0)),
    )
    refused = [r for r in ranks if not r.get("retryable", True)]
    if refused:
        first = refused[0]
        line = (
            f"not restarting: attempt {before} ended on an error a restart repeats (rank {first.get('rank')}: "
            f"{first.get('error')})"
        )
        return PreviousAttempt("" if first.get("carried") else line, retry=False, refusal=first)
    start = _load(folder / f"attempt-{before}.start.json")
    now, then = oom_kills(paths), start.get("oom_kills")
    oom = now - then if isinstance(now, int) and isinstance(then, int) and now > then else 0
    causes = []
    if ranks:
        first = ranks[0]
        step = first.get("step")
        where = f" at step {step}" if step is not None else " at start-up"
        others = len(ranks) - 1
        more = f" ({others} more rank{'s' if others > 1 else ''} raised after it)" if others else ""
        causes.append(f"rank {first.get('rank')} (host {first.get('host')}){where}: {first.get('error')}{more}")
    if oom:
        causes.append(
            f"the kernel's OOM killer killed {oom} process{'es' if oom > 1 else ''} of this job's cgroup (host out "
            "of memory: fewer rollout.max_running_requests, actor.offload, or more host memory)"
        )
    killed = "killed by a signal (kill -9, the OOM killer, a crash in native code), lost with its node"
    if not causes:
        causes.append(f"no rank recorded an error: a process was {killed}; the launcher's log names the exit code")
    elif isinstance(start.get("world"), int):
        silent = sorted(set(range(start["world"])) - {r.get("rank") for r in ranks})
        if silent:
            causes.append(
                f"{_ranks(silent)} recorded nothing ({killed}, or stopped by the launcher after the first failure)"
            )
    return PreviousAttempt(f"{head}: attempt {before} ended: {'; '.join(causes)}; resuming from the last verified "
                           "checkpoint", retry=True)  # fmt: skip


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1, 2, 5', or 'ranks 1-7, 9' for a long list."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(runs)
