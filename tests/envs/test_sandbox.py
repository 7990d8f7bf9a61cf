"""The local Python sandbox (megatron_dapo/envs/sandbox.py): ordinary code runs, hostile code is contained and comes
back as an observation (a status and the code's own error line), never as a crash or a hang of the caller."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from megatron_dapo.envs import sandbox
from megatron_dapo.envs.sandbox import LocalSandbox
from megatron_dapo.envs.sandbox import SandboxLimits


@pytest.fixture(scope="module")
def box() -> LocalSandbox:
    return LocalSandbox(SandboxLimits(wall_s=20.0, cpu_s=1, memory_mb=256, max_output_bytes=4096))


def test_ordinary_code_runs_with_stdin_and_its_own_directory(box):
    code = "import math, fractions, statistics, sys, os\nprint(math.comb(10, 3), sys.stdin.read().strip())\n"
    code += "open('scratch.txt', 'w').write('kept'); print(open('scratch.txt').read(), os.getcwd())"
    result = box.run(code, stdin="from stdin")
    assert result.status == "ok" and result.exit_code == 0, result
    first, second = result.stdout.splitlines()
    assert first == "120 from stdin" and second.startswith("kept ")
    assert not os.path.exists(second.split(" ", 1)[1])  # the call's directory is gone after it


def test_an_exception_is_an_error_observation(box):
    result = box.run("print('before')\n1 / 0")
    assert result.status == "error" and result.exit_code == 1 and result.stdout == "before\n"
    assert result.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"


def test_no_secret_of_the_caller_is_inherited(box, monkeypatch):
    monkeypatch.setenv("MDAPO_TEST_SECRET", "hunter2")
    result = box.run("import os; print(sorted(os.environ))")
    assert result.status == "ok" and "MDAPO_TEST_SECRET" not in result.stdout
    assert result.stdout.strip() == "['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING']"


@pytest.mark.parametrize(
    "code,refused",
    [
        ("import os\nwhile True:\n    os.fork()", "os.fork is not allowed"),  # fork bomb
        ("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", "is not allowed"),
        ("import os\nos.system('echo hi')", "os.system is not allowed"),
        ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec is not allowed"),
        ("import ctypes", "import ctypes is not allowed"),
        ("import os, signal\nos.kill(1, signal.SIGKILL)", "os.kill is not allowed"),
        ("print(open('/etc/passwd').read())", "open '/etc/passwd' is outside the sandbox"),
        ("open('/tmp/mdapo_sandbox_escape', 'w').write('x')", "is outside the sandbox"),
        ("open('../escape.txt', 'w').write('x')", "is outside the sandbox"),
        ("import os\nprint(os.listdir('/'))", "os.listdir '/' is outside the sandbox"),
    ],
)
def test_hostile_calls_are_refused_inside_the_code(box, code, refused):
    result = box.run(code)
    assert result.status == "error", result
    assert refused in result.stderr.strip().splitlines()[-1], result.stderr
    assert not os.path.exists("/tmp/mdapo_sandbox_escape")


def test_files_of_the_caller_cannot_be_removed_or_renamed(box, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("kept")
    for code in (f"import os\nos.remove({str(victim)!r})", f"import os\nos.rename({str(victim)!r}, 'mine.txt')"):
        result = box.run(code)
        assert result.status == "error" and "is outside the sandbox" in result.stderr, result
    assert victim.read_text() == "kept"


def test_no_network_even_to_the_callers_loopback(box):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(5.0)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    thread.start()
    attempts = [
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
        f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
        f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
    ]
    for code in attempts:
        result = box.run(code)
        assert result.status == "error", (code, result)
    thread.join()
    server.close()
    assert accepted == [None]  # nothing ever connected


def _accept(server: socket.socket) -> object:
    try:
        conn, _ = server.accept()
        conn.close()
        return "connected"
    except TimeoutError:
        return None


def test_an_endless_loop_stops_at_its_cpu_limit(box):
    result = box.run("while True:\n    pass")
    assert result.status == "cpu_limit" and result.exit_code is None, result
    assert "CPU time limit" in result.stderr


def test_a_sleeping_call_stops_at_its_wall_limit():
    result = LocalSandbox(SandboxLimits(wall_s=1.0)).run("import time\ntime.sleep(60)")
    assert result.status == "timeout" and result.exit_code is None and 1.0 <= result.seconds < 10.0, result


def test_a_memory_bomb_is_a_memory_error(box):
    result = box.run("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))")
    assert result.status == "error" and result.stderr.strip().splitlines()[-1] == "MemoryError", result


def test_huge_output_is_cut_and_the_call_killed(box):
    result = box.run("while True:\n    print('x' * 1000)")
    assert result.status == "output_limit" and result.truncated, result
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= 4096


def test_namespaces_isolate_the_call_when_the_machine_allows_them(box, monkeypatch):
    if box.prefix is None:  # then only the policy hook keeps sockets and forks out (documented)
        assert box.isolation == ("policy hook", "rlimits")
    else:
        assert box.isolation[0] == "namespaces"
        assert box.run("import os; print(os.getpid())").stdout.strip() == "1"  # its own pid namespace
    monkeypatch.setattr(sandbox, "namespace_prefix", lambda: None)
    with pytest.raises(RuntimeError, match="does not work here"):
        LocalSandbox(require_namespaces=True)


def test_bad_limits_and_oversized_stdin_are_one_line_errors(box):
    with pytest.raises(ValueError, match=r"SandboxLimits\.wall_s: must be a positive number, got 0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="stdin is over 65536 bytes"):
        box.run("print(1)", stdin="x" * 70000)


@pytest.mark.parametrize(
    "code,problem",
    [
        (b"print(1)", "the code must be a string, got bytes"),
        (None, "the code must be a string, got NoneType"),
        ("print('\ud800')", "the code is not valid text: a lone surrogate '\\ud800' at character 7"),
        ("print(1)\x00", "the code contains a NUL character at character 8"),
        ("#" * 2049, "the code is 2049 bytes, over the limit of 2048"),
    ],
)
def test_code_that_cannot_run_is_refused_before_any_process(code, problem, monkeypatch):
    box = LocalSandbox(SandboxLimits(max_code_bytes=2048))
    monkeypatch.setattr(sandbox.subprocess, "Popen", _no_process)
    result = box.run(code)
    assert result.status == "error" and result.exit_code is None and result.stdout == "", result
    assert result.stderr == f"sandbox: {problem}; it did not run\n"
    assert box.run("#" * 2047 + "\n").status == "unavailable"  # at the limit it is not refused: it got to Popen


def _no_process(*args, **kwargs):
    raise OSError("no process may start in this test")


def test_a_call_the_host_cannot_start_is_unavailable_and_leaves_nothing(box, monkeypatch, tmp_path):
    def full_disk(prefix=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", full_disk)
    result = box.run("print(1)")
    assert result.status == "unavailable" and result.exit_code is None, result
    assert result.stderr == "sandbox: the call could not start (OSError: [Errno 28] No space left on device)\n"
    monkeypatch.undo()
    before = set(os.listdir(tempfile.gettempdir()))
    monkeypatch.setattr(sandbox.subprocess, "Popen", _no_process)  # the directory exists, the interpreter does not
    assert LocalSandbox().run("print(1)").status == "unavailable"
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("mdapo_sandbox_")}


@pytest.mark.parametrize("whom", ["the code's process", "the whole group"])
def test_a_call_killed_from_outside_is_an_error_that_says_so(whom, monkeypatch):
    """The OOM killer or an operator kills the code (under unshare: the child, which unshare cannot pass on) or the
    whole group: status "error", the signal named in the last stderr line, the output so far kept."""
    started: list[subprocess.Popen] = []

    class _Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    def kill_when_it_printed():
        while not started:
            time.sleep(0.02)
        pid = started[0].pid
        time.sleep(1.0)
        children = f"/proc/{pid}/task/{pid}/children"
        if whom == "the code's process" and os.path.exists(children) and open(children).read().split():
            os.kill(int(open(children).read().split()[0]), signal.SIGKILL)
        else:
            os.killpg(pid, signal.SIGKILL)

    monkeypatch.setattr(sandbox.subprocess, "Popen", _Recorded)
    killer = threading.Thread(target=kill_when_it_printed, daemon=True)
    killer.start()
    result = LocalSandbox(SandboxLimits(wall_s=30.0)).run("import time\nprint('hi', flush=True)\ntime.sleep(25)")
    killer.join()
    assert result.status == "error" and result.stdout == "hi\n" and result.seconds < 20, result
    assert result.stderr == "sandbox: the process was killed by SIGKILL\n", result.stderr
