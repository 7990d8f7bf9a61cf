"""The local Python sandbox (megatron_dapo/envs/sandbox.py): ordinary code runs, hostile code is contained and comes
back as an observation (a status and the code's own error line), never as a crash or a hang of the caller."""

from __future__ import annotations

import os
import socket
import threading

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
