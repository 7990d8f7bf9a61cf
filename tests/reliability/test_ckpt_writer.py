"""megatron's checkpoint-writer helper (issue 20, items 1 and 4), as torchrun treats a worker: the worker runs in its
own session and is stopped with killpg(SIGTERM). The helper the trainer starts (actor/ckpt_writer.py) ignores the
signal, so the results queue megatron saves through still works afterwards; and it dies with a worker killed -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

WORKER = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: print("worker: SIGTERM", flush=True))  # the trainer's flag, in short
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron_dapo.actor.ckpt_writer import install_writer_queue, writer_pid
assert install_writer_queue() and not install_writer_queue()
assert filesystem_async._get_write_results_queue() is filesystem_async._results_queue
print(f"helper {writer_pid()}", flush=True)
sys.stdin.readline()  # the test signals, then writes a line
q = filesystem_async._get_write_results_queue()
q.put("after the signal")
print(f"queue: {q.get(timeout=10)}", flush=True)
time.sleep(600)
"""


def _start() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith("helper "), line
    return proc, int(line.split()[1])


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def test_helper_survives_the_launchers_killpg_and_dies_with_its_worker():
    proc, helper = _start()
    try:
        assert psutil.Process(helper).ppid() == proc.pid
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun's SubprocessHandler.close
        time.sleep(1.0)
        assert psutil.Process(helper).is_running() and psutil.Process(helper).status() != psutil.STATUS_ZOMBIE
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "worker: SIGTERM\n"
        assert proc.stdout.readline() == "queue: after the signal\n"  # megatron's queue still answers
        proc.kill()  # kill -9 of the worker
        proc.wait(10)
        assert _gone(helper, 10), "the writer helper outlived its worker"
    finally:
        if proc.poll() is None:
            proc.kill()
        if psutil.pid_exists(helper):
            psutil.Process(helper).kill()
