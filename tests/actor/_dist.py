"""Run a function on N gloo processes from inside pytest.

    results = run_distributed(fn, 2, arg1, arg2)   # -> [fn's return on rank 0, on rank 1]

`fn` must be a module-level function (it is imported by name in each worker); args and the return value must
pickle. Each worker is a fresh `python -m` subprocess with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT on a free port) and OMP_NUM_THREADS=1. If any rank raises, the others are stopped and
the failing rank's traceback (plus the tail of its stderr) is raised here as RankError.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_dapo.net import free_port


class RankError(RuntimeError):
    """A worker rank failed; the message holds its traceback."""


def run_distributed(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run fn(*args) on ranks 0..nprocs-1 (gloo, CPU) and return the per-rank results in rank order."""
    work = Path(tempfile.mkdtemp(prefix="dist_"))
    (work / "job.pkl").write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, args)))
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(nprocs),
        OMP_NUM_THREADS="1",
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs, logs = [], []
    for rank in range(nprocs):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(work / f"rank{rank}.log", "wb")
        logs.append(log)
        code = f"import sys; sys.path[:0] = {sys.path!r}; from {__name__} import _worker; _worker({str(work)!r})"
        cmd = [sys.executable, "-c", code]
        procs.append(subprocess.Popen(cmd, env=env_r, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failed is None and any(p.returncode != 0 for p in procs):
        raise RankError(f"timeout after {timeout_s:.0f}s; rank 0 log tail:\n{_tail(work / 'rank0.log')}")
    if failed is not None:
        err = work / f"rank{failed}.err"
        detail = err.read_text() if err.exists() else "(no traceback written)"
        raise RankError(f"rank {failed} failed:\n{detail}\n--- log tail ---\n{_tail(work / f'rank{failed}.log')}")
    return [pickle.loads((work / f"rank{r}.out").read_bytes()) for r in range(nprocs)]


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace") if path.exists() else ""


def _worker(work_dir: str) -> None:
    work = Path(work_dir)
    rank = int(os.environ["RANK"])
    try:
        from megatron_dapo.actor.cpu_compat import import_megatron_core

        import_megatron_core()  # before the job's modules import it: on CPU, megatron's fusions are not compiled
        module_name, qualname, args = pickle.loads((work / "job.pkl").read_bytes())
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        result = target(*args)
        (work / f"rank{rank}.out").write_bytes(pickle.dumps(result))
    except BaseException:
        (work / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
