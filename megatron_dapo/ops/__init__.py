"""Fused ops. Dispatch (one place, see docs/kernels.md): CUDA tensors run the compiled Triton kernels (or the
CUDA C++ twins when selected), CPU tensors run the chunked pure-torch references in ops/reference.py, or the Triton
interpreter when TRITON_INTERPRET=1 is set before import (tests).

The public functions are imported on first use (PEP 562), so `megatron_dapo.ops.tiling` (plain Python, read by the
planner) can be imported without torch or Triton."""

import importlib

_PUBLIC = {
    "clipped_pg_loss": "megatron_dapo.ops.pg_loss",
    "linear_logprobs_and_entropy": "megatron_dapo.ops.linear_logprob_entropy",
    "logprobs_and_entropy": "megatron_dapo.ops.logprob_entropy",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'megatron_dapo.ops' has no attribute {name!r}")
