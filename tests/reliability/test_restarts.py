"""What a restarted attempt says about the one before it, and whether it trains (megatron_dapo/restarts.py; the
launches themselves: test_preemption.py (torchrun's restart after a SIGKILL) and test_slurm_job.py (the sbatch
loop after an exception))."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from megatron_dapo import restarts
from megatron_dapo.config import ConfigError
from megatron_dapo.errors import JobError
from megatron_dapo.launch import NO_SHARED_STORE
from megatron_dapo.launch import StartupError
from megatron_dapo.launch import check_restart_store


def _counter(tmp_path, name: str, text: str) -> tuple[str, ...]:
    path = tmp_path / name
    path.write_text(text)
    return (str(tmp_path / "missing"), str(path))


V1 = "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n"  # cgroup v1 memory.oom_control
V2 = "low 0\nhigh 0\nmax 3\noom 2\noom_kill {}\noom_group_kill 0\n"  # cgroup v2 memory.events


def test_attempt_number_from_either_launcher():
    assert restarts.attempt_number({}) == 0
    assert restarts.attempt_number({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restarts.attempt_number({"DAPO_RESTART_COUNT": "1"}) == 1
    assert restarts.attempt_number({"TORCHELASTIC_RESTART_COUNT": "", "DAPO_RESTART_COUNT": "3"}) == 3


@pytest.mark.parametrize("text", [V1, V2])
def test_oom_kill_counter_of_either_cgroup_version(tmp_path, text):
    assert restarts.oom_kills(_counter(tmp_path, "c", text.format(7))) == 7
    assert restarts.oom_kills((str(tmp_path / "none"),)) is None


def test_which_errors_a_restart_can_get_past():
    assert restarts.is_retryable(RuntimeError("[gloo] Connection closed by peer"))
    assert restarts.is_retryable(torch.OutOfMemoryError("CUDA out of memory"))
    assert restarts.is_retryable(JobError("rank 1 made no progress", retryable=True))
    assert not restarts.is_retryable(JobError("no optimizer update was applied"))
    assert not restarts.is_retryable(StartupError("data.train_files[0]: x does not exist"))
    assert not restarts.is_retryable(ConfigError("algorithm.group_size: must be in [2, ...]"))


def _attempt0(tmp_path, world: int, oom_before: int, paths) -> None:
    restarts.record_start(tmp_path, 0, world, paths=paths)
    assert json.loads((tmp_path / "failures" / "attempt-0.start.json").read_text())["oom_kills"] == oom_before


def test_an_exception_names_the_rank_step_and_error_and_the_silent_ranks(tmp_path):
    paths = _counter(tmp_path, "c", V1.format(0))
    _attempt0(tmp_path, 4, 0, paths)
    restarts.record_failure(tmp_path, 0, 2, 7, torch.OutOfMemoryError("CUDA out of memory. Tried\nmore"), True)
    restarts.record_failure(tmp_path, 0, 0, 7, RuntimeError("[gloo] Connection closed by peer"), True)
    got = restarts.previous_attempt(tmp_path, 1, 2, paths=paths)
    host = socket.gethostname()
    assert got.retry and got.refusal is None
    assert got.line == (
        f"restart 1 of 2 (distributed.max_restarts): attempt 0 ended: rank 2 (host {host}) at step 7: "
        f"OutOfMemoryError: CUDA out of memory. Tried{restarts.GPU_OOM_HINT} (1 more rank raised after it); ranks 1, 3 "
        "recorded nothing "
        "(killed by a signal (kill -9, the OOM killer, a crash in native code), lost with its node, or stopped by the "
        "launcher after the first failure); resuming from the last verified checkpoint"
    )


def test_a_kill_by_the_oom_killer_is_told_from_other_signals(tmp_path):
    paths = _counter(tmp_path, "c", V2.format(3))
    _attempt0(tmp_path, 2, 3, paths)
    silent = restarts.previous_attempt(tmp_path, 1, 2, paths=paths)
    assert silent.retry and "no rank recorded an error: a process was killed by a signal" in silent.line
    assert "OOM killer killed" not in silent.line
    (tmp_path / "c").write_text(V2.format(4))  # the kernel killed one process of the cgroup since attempt 0 began
    oom = restarts.previous_attempt(tmp_path, 1, 2, paths=paths)
    assert oom.retry and "attempt 0 ended: the kernel's OOM killer killed 1 process of this job's cgroup" in oom.line
    assert "no rank recorded" not in oom.line


def test_an_error_a_restart_repeats_ends_every_later_attempt_with_one_line(tmp_path):
    paths = _counter(tmp_path, "c", V1.format(0))
    _attempt0(tmp_path, 2, 0, paths)
    err = JobError("no optimizer update was applied in this run's 2 steps")
    restarts.record_failure(tmp_path, 0, 0, 2, err, restarts.is_retryable(err))
    first = restarts.previous_attempt(tmp_path, 1, 3, paths=paths)
    assert not first.retry
    assert first.line == (
        "not restarting: attempt 0 ended on an error a restart repeats (rank 0: JobError: no optimizer update was "
        "applied in this run's 2 steps)"
    )
    for rank in (0, 1):
        restarts.carry_refusal(tmp_path, 1, rank, first)
    second = restarts.previous_attempt(tmp_path, 2, 3, paths=paths)
    assert not second.retry and second.line == ""  # said once, by attempt 1
    assert second.refusal["error"] == first.refusal["error"]


def test_a_failure_record_never_hides_the_error(tmp_path):
    blocked = tmp_path / "run"
    blocked.write_text("a file where the run directory should be")
    restarts.record_failure(blocked, 0, 0, 1, RuntimeError("boom"), True)  # no raise


@pytest.mark.parametrize(
    "env, refused",
    [
        ({}, False),  # not under torchrun
        ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}, False),  # no restart
        ({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # megatron-dapo launch
        ({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),  # plain torchrun
    ],
)
def test_restarts_on_the_shared_rendezvous_store_are_refused(env, refused):
    """torchrun keeps its shared rendezvous store across restarts: a restarted attempt can read the previous one's
    gloo addresses (seen here: 'Gloo connectFullMesh failed ... Connection refused' at start-up of attempt 1)."""
    if refused:
        with pytest.raises(StartupError, match=rf"^torchrun --max-restarts=2 .* export {NO_SHARED_STORE}=1 "):
            check_restart_store(env)
    else:
        check_restart_store(env)
