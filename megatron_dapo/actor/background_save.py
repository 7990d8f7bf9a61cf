"""The actor's checkpoint written in the background (checkpoint.async_save): training goes on while the files are
written; the save is finished (made a checkpoint) at the next step boundary.

megatron-core 0.16.1's torch_dist strategy already splits a save in three (dist_checkpointing/serialization.py
`save(..., async_sharded_save=True)`, strategies/torch.py `async_save`): the plan (collective: every rank agrees what
goes where; common and sharded-object files are written here), the write of each rank's tensors
(`FileSystemWriterAsync.write_preloaded_data_multiproc`: no collective) and the finalisation (collective: the write
results gathered, the global `.metadata` written by rank 0, a barrier). Megatron's own scheduler for the middle part
(`AsyncCallsQueue`) is written for CUDA (it all-reduces a CUDA tensor and synchronises streams), so this module runs
it itself:

    BackgroundWrite(request)   the rank's tensors copied to host memory now (training may change them from here on:
                               the copy is what gets written), then the write in a thread
    .wait()                    join the thread; the error text of a failed write, or None
    .finalize()                megatron's finalisation (collective; call on every rank, after `wait`)

Memory: one host copy of this rank's share of the checkpoint (model + optimizer, as the distributed optimizer shards
it) while the write runs; `Checkpointer` finishes a save before it starts the next, so there is never a second copy.

The write forks processes (megatron's writers) from the thread. A trainer killed mid-write (kill -9, the OOM killer)
would leave them running, holding the run directory's lock and writing into a `.partial` nobody finishes: every
process forked from the writer thread asks the kernel for SIGKILL when its parent thread dies (PR_SET_PDEATHSIG,
set in an at-fork hook that acts only in that thread's children and their own children).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from megatron_dapo.actor.ckpt_writer import die_with_parent

__all__ = ["WRITER_THREAD", "BackgroundWrite", "stage_write_buckets"]

WRITER_THREAD = "ckpt-write"
"""The writer thread's name; forks from it (and, in its children, from their main thread, which keeps the name)
die with their parent."""
_forking_pid = [0]


def _before_fork() -> None:
    _forking_pid[0] = os.getpid()


def _after_fork_in_child() -> None:
    if threading.current_thread().name == WRITER_THREAD:
        die_with_parent(_forking_pid[0])


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def stage_write_buckets(buckets: list[Any]) -> list[Any]:
    """Megatron's write buckets [(file, key, (bytes items, [(item, tensor)]))] with every tensor copied to host
    memory (a copy even when it is there already: the live one changes with the next optimizer step)."""
    staged = []
    for file_name, storage_key, (bytes_data, tensor_data) in buckets:
        tensors = [(item, tensor.detach().to("cpu", copy=True)) for item, tensor in tensor_data]
        staged.append((file_name, storage_key, (bytes_data, tensors)))
    return staged


class BackgroundWrite:
    """One rank's part of a checkpoint being written (see the module docstring)."""

    def __init__(self, request: Any):
        self._finalize_fns = list(request.finalize_fns)
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        if request.async_fn is None:  # nothing to write on this rank
            return
        args = list(request.async_fn_args)
        args[1] = stage_write_buckets(args[1])  # (rank, write_buckets, results_queue)
        self._thread = threading.Thread(
            target=self._run, args=(request.async_fn, args, dict(request.async_fn_kwargs)), name=WRITER_THREAD,
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _run(self, fn: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as err:  # reported by wait(), on the main thread
            self._error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str | None:
        """Wait for the write; the first line of its error, or None."""
        if self._thread is not None:
            self._thread.join()
        return self._error

    def finalize(self) -> None:
        """Megatron's finalisation of the save (collective: every rank, after every rank's `wait`)."""
        torch.distributed.barrier()
        for fn in self._finalize_fns:
            fn()
