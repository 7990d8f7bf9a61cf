"""Megatron's checkpoint-writer helper process, shielded from preemption signals and tied to its trainer's life.

megatron-core 0.16.1's torch_dist save (dist_checkpointing/strategies/filesystem_async.py,
`_get_write_results_queue`) collects the writers' results through a `multiprocessing.Manager().Queue()` whose
server process is spawned at the first save and reused by every later one. That process runs with default signal
dispositions in the trainer worker's process group. torchrun stops a job with `os.killpg(worker, SIGTERM)` (its
subprocess handler starts each worker in a new session), so a preemption signal kills the manager while the trainer
(which only sets a flag, checkpoint.PreemptionFlag) goes on to save: the save then fails on every rank with
BrokenPipeError and leaves `step_N.partial`. And a trainer killed with -9 leaves the manager running.

`install_writer_queue()` starts that manager ourselves, with an initializer that ignores the preemption signals (the
trainer decides when to stop; SIGKILL still ends it) and asks the kernel to SIGKILL it when the trainer dies
(PR_SET_PDEATHSIG), then hands megatron its queue. Must be called from the main thread (the death signal follows the
thread that started the process).

The helper is forked, not spawned: a spawned one re-imports the trainer's main module and, to unpickle the write
results it stores, torch and torch.distributed.checkpoint (~2.8 s of one core per rank, on the first save's critical
path, measured on CPU). A fork has them already (imported here before it) and starts in milliseconds. Megatron forks
its writer processes from the trainer on every save anyway (`write_preloaded_data_multiproc`, "fork" context); the
helper only serves a queue of pickled results and never touches CUDA. `cli.train` calls this first thing, before the
trainer opens sockets, takes the run directory's lock or starts threads, so the fork inherits none of them; a later
call (`MegatronActor.save_checkpoint`, for a trainer built another way) forks from wherever it is.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
from multiprocessing.managers import SyncManager
from typing import Any

SHIELDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
"""Signals the writer helper ignores: the trainer handles preemption and stops it when it exits."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_manager: SyncManager | None = None


def die_with_parent(parent_pid: int) -> None:
    """In a child: ask for SIGKILL when the thread that started it exits (with its process; Linux; elsewhere
    nothing); exit at once when parent_pid is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody would send the signal
        os._exit(0)


def _shield(parent_pid: int) -> None:
    """Initializer of the helper process (runs in it)."""
    for sig in SHIELDED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid)


def _megatron_writer_module() -> Any:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


def install_writer_queue() -> bool:
    """Give megatron's torch_dist writer a results queue served by a shielded helper (idempotent). Returns True
    when this call started the helper. Raises RuntimeError if megatron's module no longer has the hook we set."""
    global _manager
    module = _megatron_writer_module()
    if not hasattr(module, "_results_queue") or not hasattr(module, "_get_write_results_queue"):
        raise RuntimeError(
            "megatron.core.dist_checkpointing.strategies.filesystem_async has no _results_queue: the checkpoint "
            "writer's helper process cannot be shielded from preemption signals (megatron_dapo/actor/ckpt_writer.py)"
        )
    if _manager is not None and module._results_queue is not None:
        return False
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=_shield, initargs=(os.getpid(),))
    module._results_queue = manager.Queue()
    _manager = manager
    return True


def writer_pid() -> int | None:
    """Process id of the helper this module started (None before `install_writer_queue`)."""
    return None if _manager is None else _manager._process.pid
