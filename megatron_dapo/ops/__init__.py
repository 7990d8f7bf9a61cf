"""Fused ops. Dispatch (one place, see docs/kernels.md): CUDA tensors run the compiled Triton kernels (or the
CUDA C++ twins when selected), CPU tensors run the chunked pure-torch references in ops/reference.py, or the Triton
interpreter when TRITON_INTERPRET=1 is set before import (tests)."""

from megatron_dapo.ops.linear_logprob_entropy import linear_logprobs_and_entropy
from megatron_dapo.ops.logprob_entropy import logprobs_and_entropy
from megatron_dapo.ops.pg_loss import clipped_pg_loss

__all__ = ["clipped_pg_loss", "linear_logprobs_and_entropy", "logprobs_and_entropy"]
