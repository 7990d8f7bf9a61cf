"""The run-dir lock (issue 12, item 5: nothing stopped two jobs writing one run_dir). Fast cases; the job-level
ones (a second job refused, the next job after kill -9 taking the lock over) are in test_run_faults.py."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.launch import RunDirLock
from megatron_dapo.launch import StartupError

ROOT = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; from megatron_dapo.launch import RunDirLock; RunDirLock(sys.argv[1]).acquire(); " \
       "print('held', flush=True); time.sleep(120)"  # fmt: skip


@pytest.fixture
def holder(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_second_job_is_refused_naming_the_holder(tmp_path, holder):
    with pytest.raises(StartupError) as err:
        RunDirLock(tmp_path).acquire()
    message = str(err.value)
    assert f"{tmp_path} is in use by another job (host {socket.gethostname()} pid {holder.pid}, since " in message
    assert "\n" not in message


def test_lock_of_a_killed_job_is_taken_over_and_logged(tmp_path, holder):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lines: list[str] = []
    lock = RunDirLock(tmp_path, lines.append)
    lock.acquire()
    assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "taking over" in lines[0]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    RunDirLock(tmp_path, lines.append).acquire()  # a clean release leaves nothing to take over
    assert len(lines) == 1


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    lock_file = tmp_path / ".lock"
    lock_file.write_text(json.dumps({"host": host, "pid": os.getppid()}))  # alive
    with pytest.raises(StartupError, match=f"host {host} pid {os.getppid()}.*no flock on this filesystem"):
        RunDirLock(tmp_path).acquire()
    lock_file.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(StartupError, match="host elsewhere pid 1"):
        RunDirLock(tmp_path).acquire()
    lock_file.write_text(json.dumps({"host": host, "pid": int(dead.stdout)}))
    lines: list[str] = []
    RunDirLock(tmp_path, lines.append).acquire()
    assert len(lines) == 1 and f"stale lock of pid {int(dead.stdout)} on this host" in lines[0]


def test_deleting_the_lock_file_does_not_free_the_run_dir(tmp_path, holder):
    """The probe deleted run_dir/.lock during a run and a second job wrote the same run dir: the directory itself is
    locked too, so the second job is still refused (the holder's name went with the file)."""
    (tmp_path / ".lock").unlink()
    with pytest.raises(StartupError) as err:
        RunDirLock(tmp_path).acquire()
    assert f"{tmp_path} is in use by another job (the directory is locked; its .lock" in str(err.value)
    assert not (tmp_path / ".lock").exists() or not (tmp_path / ".lock").read_text()  # nothing of the refused job


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_lock_file_deleted_or_replaced_is_recreated_before_the_save(tmp_path, how):
    lines: list[str] = []
    lock = RunDirLock(tmp_path, lines.append)
    lock.acquire()
    (tmp_path / ".lock").unlink()
    if how == "replaced":
        (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    assert lock.check() is None
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert len(lines) == 1 and "was deleted or replaced during the run; re-created" in lines[0], lines
    assert lock.check() is None and len(lines) == 1  # intact now: nothing more
    with pytest.raises(StartupError):  # and still held: the file's flock and the directory's
        RunDirLock(tmp_path).acquire()
    lock.release()
    RunDirLock(tmp_path).acquire()


@pytest.fixture
def no_directory_flock(monkeypatch):
    """A filesystem that cannot flock a directory (NFS emulates flock with byte-range locks, which a read-only
    descriptor cannot take: EBADF); files still lock."""
    real = fcntl.flock

    def flock(fd, op):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_without_a_directory_lock_a_deleted_lock_file_stops_the_save(tmp_path, no_directory_flock):
    """Where the filesystem cannot flock a directory, .lock is the lock; deleting it lets a second job in, so the first
    job stops before its next save instead of writing over the second's files."""
    first = RunDirLock(tmp_path)
    first.acquire()
    assert first.check() is None
    (tmp_path / ".lock").unlink()
    RunDirLock(tmp_path).acquire()  # the bypass this filesystem allows
    problem = first.check()
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"{tmp_path / '.lock'} was deleted or replaced during the run") and "stopping" in problem


@pytest.mark.parametrize("lost", [False, True])
def test_a_background_save_checks_the_lock_again_before_it_completes(tmp_path, no_directory_flock, lost):
    """A background save (checkpoint.async_save) began while the run dir was this job's and completes a step later
    (DAPOTrainer._finish_save): the lock is checked again before its manifest and COMPLETE are written, so a second job
    that took the run dir in between (here: .lock deleted where directories cannot be flocked) does not get a finished
    checkpoint written into it; with the lock intact the save completes."""
    from megatron_dapo.errors import JobError
    from megatron_dapo.trainer import DAPOTrainer

    lock = RunDirLock(tmp_path)
    lock.acquire()
    finished: list[bool] = []
    trainer = DAPOTrainer.__new__(DAPOTrainer)  # only the parts the save's completion reads
    trainer.lock = lock
    trainer.groups = type("Groups", (), {"max_over_job": staticmethod(lambda t: t)})()
    trainer.ckpt = type("Ckpt", (), {"pending": object(), "finish_pending": lambda self: finished.append(True)})()
    if lost:
        (tmp_path / ".lock").unlink()
        RunDirLock(tmp_path).acquire()  # the second job
        with pytest.raises(JobError, match="was deleted or replaced during the run"):
            trainer._finish_save()
        assert not finished
    else:
        trainer._finish_save()
        assert finished == [True]
