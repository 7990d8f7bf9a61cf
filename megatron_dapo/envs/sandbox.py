"""A local Python sandbox for tool calls (issue 40 item 3): model-written code runs in a fresh process, contained.

    LocalSandbox(limits).run(code) -> SandboxResult(status, stdout, stderr, exit_code, seconds, truncated)

    layer                  what it stops                                         how
    fresh process          state between calls                                   one `python -I` per call, its own
                                                                                 temporary directory (removed after)
    Linux namespaces       the network (a new, empty net namespace: not even     `unshare --net --pid --fork` (with
                           loopback reaches the host), processes outliving the   --user --map-root-user when not
                           call (a pid namespace: its init's death ends them)    root); used when the probe works
    policy hook            fork / exec / subprocess / signals, sockets, ctypes   a PEP 578 audit hook installed before
                           and native loading, files outside its directory       the code runs (it cannot be removed);
                           (reads: its directory and the standard library;       a refused call raises PermissionError
                           writes: its directory)                                inside the code, an observation
    resource limits        CPU seconds, address space, file size, core dumps,    setrlimit in the child before the
                           processes (not enforced for root: the hook and the    code runs
                           pid namespace are what stop a fork bomb there)
    the caller's clock     wall time, output size                                the whole process group killed at
                                                                                 the deadline or past max_output_bytes
    environment            inherited secrets                                     a minimal environment (PATH, HOME in
                                                                                 its directory, LANG), nothing else

Not a security boundary against native exploits of the interpreter: the namespaces and limits are the OS part, the
hook a policy for Python-level code (PEP 578 hooks are not a sandbox by themselves). `isolation` says which layers
are in effect on this machine; `require_namespaces` refuses to run without them.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from dataclasses import dataclass
from functools import cache

STATUSES = ("ok", "error", "timeout", "cpu_limit", "output_limit", "unavailable")
"""SandboxResult.status values: exit 0; a non-zero exit (an exception, a refused call, code that cannot run: see
code_refusal; a process killed from outside); past the wall time; killed by the CPU-time limit; killed past the output
limit; the sandbox itself failed, so the code did not run (the remote service did not answer after its retries, or
this host could not start the call: no temporary directory, no interpreter)."""


CPU_EXIT = 152
"""The exit code of a call stopped by its CPU-time limit (128 + SIGXCPU): the child's SIGXCPU handler exits with it,
so the status survives `unshare`, which cannot re-raise the signal."""


MAX_STDIN = 65536
"""Largest stdin of a local call (one pipe buffer: written whole before the output is read)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed (status "timeout")."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU; status "cpu_limit")."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS): an allocation past it is a MemoryError inside the code."""
    max_output_bytes: int = 16384
    """stdout + stderr kept; past it the process is killed (status "output_limit", truncated)."""
    file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE)."""
    processes: int = 16
    """RLIMIT_NPROC for a non-root user (root ignores it; forks are refused by the policy hook anyway)."""
    max_code_bytes: int = 1 << 20
    """Largest code (UTF-8 bytes) a call accepts; longer code is refused before anything runs (status "error")."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"SandboxLimits.{name}: must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """One call's outcome. stdout / stderr: decoded (invalid bytes replaced), cut at the output limit."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float
    truncated: bool = False


def code_refusal(code: object, limits: SandboxLimits) -> SandboxResult | None:
    """The outcome of a call whose code cannot run at all, decided on the host before any process starts (status
    "error", one stderr line naming the problem), or None when the code may run."""
    problem = _code_problem(code, limits.max_code_bytes)
    return None if problem is None else SandboxResult("error", "", f"sandbox: {problem}; it did not run\n", None, 0.0)


def _code_problem(code: object, max_bytes: int) -> str | None:
    """Not a string; not encodable as UTF-8 (a lone surrogate, which JSON's "\\ud800" escape decodes to, cannot be
    written to main.py); a NUL character (the compiler refuses it); over max_bytes of UTF-8."""
    if not isinstance(code, str):
        return f"the code must be a string, got {type(code).__name__}"
    try:
        size = len(code.encode("utf-8"))
    except UnicodeEncodeError as err:
        return f"the code is not valid text: a lone surrogate {code[err.start]!r} at character {err.start}"
    if "\x00" in code:
        return f"the code contains a NUL character at character {code.index(chr(0))}"
    if size > max_bytes:
        return f"the code is {size} bytes, over the limit of {max_bytes}"
    return None


_BOOT = r"""
import json, os, resource, sys
limits, root, CPU_EXIT = json.loads(sys.argv[1]), os.getcwd(), int(sys.argv[2])
code = open("main.py", encoding="utf-8").read()
def _limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
import signal
def _out_of_cpu(signum, frame):
    sys.stderr.write("sandbox: CPU time limit reached\n")
    sys.stderr.flush()
    os._exit(CPU_EXIT)
signal.signal(signal.SIGXCPU, _out_of_cpu)
try:
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))  # SIGXCPU, then SIGKILL
except (ValueError, OSError):
    pass
_limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
_limit(resource.RLIMIT_FSIZE, limits["file_mb"] << 20)
_limit(resource.RLIMIT_CORE, 0)
if os.getuid() != 0:
    _limit(resource.RLIMIT_NPROC, limits["processes"])
import sysconfig
READ = tuple(os.path.realpath(p) for p in {root, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
DEVICES = ("/dev/null", "/dev/urandom", "/dev/zero")
DENIED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
          "os.kill", "os.killpg", "os.setsid", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
          "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.chdir", "os.chroot", "os.putenv", "os.unsetenv",
          "sys.remote_exec", "mmap.__new__", "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link"}
MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing", "socket", "_socket",
           "pty", "resource"}
PATHS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
         "shutil.rmtree", "os.listdir", "os.scandir"}
def _inside(path, roots):
    path = os.path.realpath(os.path.join(root, os.fsdecode(path)))
    return path in DEVICES or any(path == r or path.startswith(r + os.sep) for r in roots)
def _hook(event, args):
    if event in DENIED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in MODULES:
        raise PermissionError(f"sandbox: import {args[0]} is not allowed")
    if event == "open" and isinstance(args[0], (str, bytes)):
        writing = args[1] is not None and any(c in args[1] for c in "wax+")
        if not _inside(args[0], (root,) if writing else READ):
            raise PermissionError(f"sandbox: open {os.fsdecode(args[0])!r} is outside the sandbox")
    if event in PATHS and args and isinstance(args[0], (str, bytes)) and not _inside(args[0], (root,)):
        raise PermissionError(f"sandbox: {event} {os.fsdecode(args[0])!r} is outside the sandbox")
sys.addaudithook(_hook)
del json, resource, signal
try:
    exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as error:  # the code's own traceback, without this bootstrap's frame
    import traceback
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    sys.exit(1)
"""


@cache
def namespace_prefix() -> tuple[str, ...] | None:
    """The `unshare` command line that gives a call its own network and pid namespaces on this machine (root: plain;
    otherwise through a user namespace), or None when neither works (no unshare, user namespaces disabled)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    candidates = [(unshare, "--net", "--pid", "--fork", "--kill-child")]
    if os.getuid() != 0:
        candidates.insert(0, (unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"))
    for prefix in candidates:
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


class LocalSandbox:
    """Runs Python code in a fresh, contained process per call (module docstring).

    limits: SandboxLimits. require_namespaces: raise at construction when this machine cannot give a call its own
    network and pid namespaces (then the policy hook alone keeps sockets and forks out).
    """

    def __init__(self, limits: SandboxLimits | None = None, *, require_namespaces: bool = False) -> None:
        self.limits = limits or SandboxLimits()
        self.prefix = namespace_prefix()
        if self.prefix is None and require_namespaces:
            raise RuntimeError("LocalSandbox: `unshare --net --pid` does not work here (no unshare, or user namespaces "
                               "are disabled); the sandbox would rely on its policy hook alone")  # fmt: skip
        self.isolation = ("namespaces", "policy hook", "rlimits") if self.prefix else ("policy hook", "rlimits")
        """The layers in effect on this machine."""

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run `code` as a script (its own temporary directory as the working directory); returns its outcome.
        stdin: at most MAX_STDIN bytes (written before the output is read: one pipe buffer)."""
        if len(stdin.encode("utf-8")) > MAX_STDIN:
            raise ValueError(f"LocalSandbox.run: stdin is over {MAX_STDIN} bytes")
        refused = code_refusal(code, self.limits)
        if refused is not None:
            return refused
        start, workdir = time.monotonic(), None
        try:
            workdir = tempfile.mkdtemp(prefix="mdapo_sandbox_")
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
            argv = [*(self.prefix or ()), sys.executable, "-I", "-c", _BOOT, json.dumps(asdict(self.limits)),
                    str(CPU_EXIT)]  # fmt: skip
            start = time.monotonic()
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        except OSError as err:  # this host's failure (disk full, no interpreter), not the code's: it did not run
            message = f"sandbox: the call could not start ({type(err).__name__}: {err})\n"
            return SandboxResult("unavailable", "", message, None, time.monotonic() - start)
        else:
            return self._collect(proc, stdin, start)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen, stdin: str, start: float) -> SandboxResult:
        """Read both pipes up to the output limit and the wall deadline, killing the group at either."""
        lim = self.limits
        try:
            proc.stdin.write(stdin.encode("utf-8"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        out = {out_fd: bytearray(), err_fd: bytearray()}
        open_fds, status = set(out), None
        deadline = start + lim.wall_s
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            ready, _, _ = select.select(list(open_fds), [], [], min(left, 0.5))
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.discard(fd)
                out[fd] += chunk
            if sum(len(b) for b in out.values()) > lim.max_output_bytes:
                status = "output_limit"
                break
        if status is not None:
            _kill_group(proc)
        code, cpu_s = _wait(proc, max(deadline, time.monotonic() + 1.0))
        if code is None:  # the pipes closed but the process lives on past the deadline
            _kill_group(proc)
            (code, cpu_s), status = _wait(proc, None), "timeout"
        proc.stdout.close()
        proc.stderr.close()
        if status is None and code != 0 and (code == CPU_EXIT or cpu_s >= lim.cpu_s):
            status = "cpu_limit"  # by its handler's exit code, or (a handler the code replaced) by the CPU it used
        stdout, stderr = bytes(out[out_fd]), bytes(out[err_fd])
        if status is None and code != 0:
            status, stderr = self._outside_end(code, stderr)
        status = status or ("ok" if code == 0 else "error")
        cap = lim.max_output_bytes
        truncated = len(stdout) + len(stderr) > cap
        stdout = stdout[:cap]
        stderr = stderr[: max(cap - len(stdout), 0)]
        return SandboxResult(status, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"),
                             code if status in ("ok", "error") else None, time.monotonic() - start,
                             truncated)  # fmt: skip

    def _outside_end(self, code: int, stderr: bytes) -> tuple[str | None, bytes]:
        """A non-zero exit the sandbox did not cause: (status, stderr); (None, stderr) for the code's own exit. Killed
        by a signal from outside (the OOM killer, an operator): "error" and a line saying so. `unshare` cannot pass on
        its child's SIGKILL (it exits 1 with "sigprocmask unblock failed"); any other last line of its own means it
        failed before the code ran: "unavailable"."""
        head, _, last = stderr.rstrip(b"\n").rpartition(b"\n")
        if self.prefix is not None and last.startswith(b"unshare: "):
            if b"sigprocmask" not in last:
                return "unavailable", stderr
            name, stderr = "SIGKILL", head + b"\n" if head else b""
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
        else:
            return None, stderr
        return "error", stderr + f"sandbox: the process was killed by {name}\n".encode()


def _wait(proc: subprocess.Popen, deadline: float | None) -> tuple[int | None, float]:
    """(exit code, CPU seconds of the call's processes) once it exits, or (None, 0) at the deadline (None: no
    deadline). wait4's usage counts the descendants that were waited for: the code's process under `unshare`."""
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            return None, 0.0
        time.sleep(0.01)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the call's whole process group (and with it the pid namespace's init and everything under it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class RemoteSandbox:
    """Runs Python code on a sandbox service over HTTP, in SandboxFusion's run_code shape:

        POST {url}/run_code  {"code", "language": "python", "run_timeout", "compile_timeout", "memory_limit_MB",
                              "stdin", "files": {}, "fetch_files": []}
        200 -> {"status": "Success" | "Failed" | "SandboxError", "message", "compile_result",
                "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time",
                               "return_code", "stdout", "stderr"}, "files"}

    The service enforces the limits it is given (run_timeout = wall_s, memory_limit_MB = memory_mb); the output cap
    is applied here. A service that does not answer (refused, reset, HTTP 5xx, a body that is not that shape) is
    retried `retries` times with a doubling pause, then the call is status "unavailable", an observation like the
    others: a sandbox outage never ends a rank.
    """

    def __init__(self, url: str, limits: SandboxLimits | None = None, *, retries: int = 2, backoff_s: float = 0.5):
        self.url = url.rstrip("/") + "/run_code"
        self.limits = limits or SandboxLimits()
        self.retries, self.backoff_s = retries, backoff_s

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        lim = self.limits
        refused = code_refusal(code, lim)
        if refused is not None:
            return refused
        request = {"code": code, "language": "python", "run_timeout": lim.wall_s, "compile_timeout": lim.wall_s,
                   "memory_limit_MB": lim.memory_mb, "stdin": stdin, "files": {}, "fetch_files": []}  # fmt: skip
        body = json.dumps(request)
        start, problem = time.monotonic(), ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                post = urllib.request.Request(self.url, body.encode(), {"Content-Type": "application/json"})
                with urllib.request.urlopen(post, timeout=lim.wall_s + 30.0) as response:
                    return self._result(json.loads(response.read()), time.monotonic() - start)
            except (OSError, ValueError, KeyError, TypeError) as err:  # URLError / HTTPError are OSErrors
                problem = f"{type(err).__name__}: {err}"
        message = f"sandbox service {self.url} did not answer after {self.retries + 1} tries ({problem})"
        return SandboxResult("unavailable", "", message, None, time.monotonic() - start)

    def _result(self, reply: dict, seconds: float) -> SandboxResult:
        run = reply.get("run_result") or {}
        if reply.get("status") == "SandboxError" or not isinstance(run, dict) or "status" not in run:
            raise ValueError(f"no run_result in the reply (status {reply.get('status')!r}: {reply.get('message')!r})")
        code = run.get("return_code")
        finished = "ok" if code == 0 else "error"
        status = {"Finished": finished, "TimeLimitExceeded": "timeout"}.get(run["status"], "error")
        stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        cap = self.limits.max_output_bytes
        truncated = len(stdout.encode()) + len(stderr.encode()) > cap
        if truncated:
            stdout = stdout.encode()[:cap].decode("utf-8", "ignore")
            stderr = stderr.encode()[: max(cap - len(stdout.encode()), 0)].decode("utf-8", "ignore")
        exit_code = code if status in ("ok", "error") and isinstance(code, int) else None
        return SandboxResult(status, stdout, stderr, exit_code, float(run.get("execution_time") or seconds), truncated)
