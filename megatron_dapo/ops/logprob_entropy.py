"""Fused per-token log-prob and entropy of logits, vocab-parallel aware (Triton).

logp_t = log softmax(x_t / temperature)[label_t] and H_t = -sum_j p_tj log p_tj, both fp32 and differentiable.

- Forward: one pass per row over the vocabulary (online max / sum-exp / entropy sum, see _softmax_utils.py); it
  saves three fp32 numbers per token, [3, T] = (lse, entropy, target logit), plus references to logits and labels.
- Backward: one elementwise pass that recomputes p from the saved lse; grid (token blocks, vocab blocks).
- Vocab-parallel (tp_group): each rank holds columns [rank * V_local, (rank + 1) * V_local) of the logits, as
  Megatron's ColumnParallelLinear output layer does. The kernel gets `class_start` and computes shard-local stats;
  `reference.combine_vocab_shards` merges them with one all_gather in Python, between the forward kernel and the
  outputs (flash-attn / Liger style). The backward pass needs no communication: each rank returns the gradient of
  its own shard, given the replicated upstream gradients of logp and entropy.
- Padding: `vocab_size` (keyword) is the true global vocabulary; global columns >= vocab_size are never read, so
  Megatron's padded rows of the output layer count as probability 0 and get gradient 0. Logits of -inf are fine too.
- Dispatch (ops/dispatch.py): CUDA tensors and TRITON_INTERPRET=1 use these kernels; plain CPU tensors use
  `reference.logprobs_and_entropy_chunked`. On CUDA tensors, backend="cuda" (actor.logprob_impl "fused_cuda")
  swaps both kernels for the CUDA C++ twins in csrc/ (ops/_cuda_twins.py), which write the same [3, T] stats; the
  shard merge over tp_group and the saved state are the same for both backends.
- Label range is checked on CPU tensors only (a check on CUDA would synchronise); an out-of-range label on CUDA
  gives logp = -lse instead of an error.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megatron_dapo.ops import _cuda_twins
from megatron_dapo.ops._softmax_utils import logprob_entropy_dz
from megatron_dapo.ops._softmax_utils import online_softmax_finalize
from megatron_dapo.ops._softmax_utils import online_softmax_update
from megatron_dapo.ops._softmax_utils import target_logit
from megatron_dapo.ops.dispatch import interpreting
from megatron_dapo.ops.dispatch import kernel_backend
from megatron_dapo.ops.dispatch import use_triton
from megatron_dapo.ops.reference import Columns
from megatron_dapo.ops.reference import combine_vocab_shards
from megatron_dapo.ops.reference import flat_inputs
from megatron_dapo.ops.reference import logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import outputs_from_stats

# Vocab tile widths (forward, backward). GPU: one row per program, 4096-wide forward tiles (untuned: no GPU here).
# Interpreter: small tiles so that tests with V of a few hundred still run the multi-tile loop; tests swap in
# GPU_BLOCKS to run the GPU tiling under the interpreter (tile overhang past a shard's end, issue 9).
BLOCK_V = 4096
BLOCK_V_BWD = 2048
GPU_BLOCKS = (BLOCK_V, BLOCK_V_BWD)
INTERPRET_BLOCKS = (128, 128)
NUM_WARPS = 8


@triton.jit
def _logprob_entropy_fwd_kernel(
    logits_ptr,  # [T, V_local], row stride stride_t, column stride 1, any float dtype
    labels_ptr,  # [T] int64 global ids
    stats_ptr,  # [3, T] fp32 out: shard lse, shard entropy, target logit (0 if the label is on another shard)
    state_ptr,  # [4, T] fp32 online state (m, s, t, target logit) carried across launches; unused unless CARRY_*
    T,
    n_valid,  # leading local columns that are real tokens; the rest is padding and never read
    stride_t,
    class_start,  # global id of local column 0
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CARRY_IN: tl.constexpr,  # continue from the state a previous launch stored (columns left of these)
    CARRY_OUT: tl.constexpr,  # store the state for a later launch instead of finalising into stats
):
    # With CARRY_IN / CARRY_OUT a row's vocabulary can be streamed over several launches (the fused LM head's
    # vocab tiles, ops/linear_logprob_entropy.py): the same online softmax as one long pass, so the result does not
    # depend on how the columns were cut.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    labels_local = tl.load(labels_ptr + rows, mask=row_ok, other=0) - class_start
    row_base = logits_ptr + rows.to(tl.int64)[:, None] * stride_t
    if CARRY_IN:
        m = tl.load(state_ptr + rows, mask=row_ok, other=float("-inf"))
        s = tl.load(state_ptr + T + rows, mask=row_ok, other=0.0)
        t = tl.load(state_ptr + 2 * T + rows, mask=row_ok, other=0.0)
        zt = tl.load(state_ptr + 3 * T + rows, mask=row_ok, other=0.0)
    else:
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_T], tl.float32)
        t = tl.zeros([BLOCK_T], tl.float32)
        zt = tl.zeros([BLOCK_T], tl.float32)
    for v0 in range(0, n_valid, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < n_valid)[None, :]
        # Upcast right after the load: the interpreter computes on raw bf16 bits otherwise.
        z = tl.load(row_base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m, s, t = online_softmax_update(z, m, s, t)
        zt += target_logit(z, cols, labels_local, n_valid)
    if CARRY_OUT:
        tl.store(state_ptr + rows, m, mask=row_ok)
        tl.store(state_ptr + T + rows, s, mask=row_ok)
        tl.store(state_ptr + 2 * T + rows, t, mask=row_ok)
        tl.store(state_ptr + 3 * T + rows, zt, mask=row_ok)
    else:
        lse, ent = online_softmax_finalize(m, s, t)
        tl.store(stats_ptr + rows, lse, mask=row_ok)
        tl.store(stats_ptr + T + rows, ent, mask=row_ok)
        tl.store(stats_ptr + 2 * T + rows, zt, mask=row_ok)


@triton.jit
def _logprob_entropy_bwd_kernel(
    logits_ptr,  # [T, V_local] as in the forward
    labels_ptr,  # [T] int64
    stats_ptr,  # [3, T] fp32 global lse, entropy, (unused) target logit
    grad_out_ptr,  # [2, T] fp32 upstream grads of logp and entropy
    grad_in_ptr,  # [T, V_local] out, logits dtype, row stride stride_gt
    T,
    V_local,
    n_valid,
    stride_t,
    stride_gt,
    class_start,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    labels_local = tl.load(labels_ptr + rows, mask=row_ok, other=0) - class_start
    lse = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
    ent = tl.load(stats_ptr + T + rows, mask=row_ok, other=0.0)
    g_logp = tl.load(grad_out_ptr + rows, mask=row_ok, other=0.0)
    g_ent = tl.load(grad_out_ptr + T + rows, mask=row_ok, other=0.0)
    valid = row_ok[:, None] & (cols < n_valid)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    z = tl.load(logits_ptr + rows64 * stride_t + cols[None, :], mask=valid, other=float("-inf")).to(tl.float32)
    z = z * inv_temp
    dz = logprob_entropy_dz(z, cols, labels_local, lse, ent, g_logp, g_ent)
    # Padding columns (n_valid <= col < V_local) get an explicit 0.
    dx = tl.where(valid, dz * inv_temp, 0.0)
    out_mask = row_ok[:, None] & (cols < V_local)[None, :]
    tl.store(grad_in_ptr + rows64 * stride_gt + cols[None, :], dx.to(grad_in_ptr.dtype.element_ty), mask=out_mask)


def _block_v(fwd: bool, width: int | None = None) -> int:
    """Vocab tile of the forward or backward kernel; with `width` (the columns a launch covers) at most its next
    power of two, so a narrow launch (the fused LM head's vocab tiles) does not run mostly masked lanes."""
    fwd_block, bwd_block = INTERPRET_BLOCKS if interpreting() else GPU_BLOCKS
    block = fwd_block if fwd else bwd_block
    return block if width is None else min(block, triton.next_power_of_2(max(width, 1)))


def logprob_entropy_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    cols: Columns,
    *,
    state: torch.Tensor | None = None,
    carry_in: bool = False,
    carry_out: bool = False,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the forward kernel. logits [T, V_local] (stride(1) == 1), labels [T] int64, cols: what the launch sees
    of the vocabulary (reference.Columns) -> shard stats [3, T] fp32.

    A row's columns may be streamed over several launches: `state` [4, T] fp32 carries the online softmax from one
    launch (carry_out=True, columns left of the next) to the next (carry_in=True); the last launch finalises into
    `stats` ([3, T] fp32, contiguous; allocated when None).
    """
    num_tokens = logits.shape[0]
    if stats is None:
        stats = torch.empty((3, num_tokens), dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return stats
    if (carry_in or carry_out) and (state is None or state.shape != (4, num_tokens) or not state.is_contiguous()):
        raise ValueError(f"logprob_entropy_forward: carrying needs a contiguous [4, {num_tokens}] fp32 state")
    _logprob_entropy_fwd_kernel[(num_tokens,)](
        logits, labels, stats, stats if state is None else state, num_tokens, cols.n_valid, logits.stride(0),
        cols.class_start, cols.inv_temp, BLOCK_T=1, BLOCK_V=_block_v(True, logits.shape[1]), CARRY_IN=carry_in,
        CARRY_OUT=carry_out, num_warps=NUM_WARPS,
    )  # fmt: skip
    return stats


def logprob_entropy_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    grad_out: torch.Tensor,
    cols: Columns,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Launch the backward kernel. stats [3, T] global, grad_out [2, T] fp32 (both contiguous), cols as in the
    forward -> d logits [T, V_local] in out_dtype (default: the logits' dtype)."""
    num_tokens, v_local = logits.shape
    grad = torch.empty((num_tokens, v_local), dtype=out_dtype or logits.dtype, device=logits.device)
    if num_tokens == 0:
        return grad
    block_v = _block_v(False, v_local)
    grid = (num_tokens, triton.cdiv(v_local, block_v))
    _logprob_entropy_bwd_kernel[grid](
        logits, labels, stats, grad_out, grad, num_tokens, v_local, cols.n_valid, logits.stride(0), grad.stride(0),
        cols.class_start, cols.inv_temp, BLOCK_T=1, BLOCK_V=block_v, num_warps=NUM_WARPS,
    )  # fmt: skip
    return grad


class LogProbEntropyFunction(torch.autograd.Function):
    """autograd wrapper; saves logits, labels and the [3, T] fp32 global stats (lse, entropy, target logit).

    backend "triton" launches the Triton kernels above, "cuda" the CUDA C++ twins (same stats layout and math).
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, tp_group, vocab_size, backend):
        cols = Columns.of_shard(logits.shape[1], tp_group, vocab_size, temperature)
        if backend == "cuda":
            stats, _ = _cuda_twins.logprob_entropy_stats(logits, labels, temperature, cols.class_start, cols.n_valid)
        else:
            stats = logprob_entropy_forward(logits, labels, cols)
        stats = combine_vocab_shards(stats, tp_group)
        ctx.save_for_backward(logits, labels, stats)
        ctx.args = (temperature, cols, backend)
        return outputs_from_stats(stats)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, labels, stats = ctx.saved_tensors
        temperature, cols, backend = ctx.args
        if backend == "cuda":
            grad = _cuda_twins.logprob_entropy_grad(
                logits, labels, stats, g_logp, g_ent, temperature, cols.class_start, cols.n_valid
            )
        else:
            grad = logprob_entropy_backward(logits, labels, stats, torch.stack([g_logp, g_ent]).to(torch.float32), cols)
        return grad, None, None, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of the label and entropy of softmax(logits / temperature), vocab-parallel aware.

    Args:
        logits: [..., V_local] fp32/fp16/bf16; with tp_group, this rank's vocab shard in Megatron rank order
            (rank r holds global columns [r * V_local, (r + 1) * V_local)).
        labels: [...] int64 (or int32) global token ids in [0, vocab_size).
        temperature: logits are divided by it (> 0).
        tp_group: vocab-parallel process group, or None for the full vocabulary on this rank.
        vocab_size: true global vocab size; global columns >= vocab_size (Megatron's vocab padding) are ignored.
            None: all V_local * tp columns count.
        backend: "triton" or "cuda" (the CUDA C++ twins, which must be built: csrc/README.md) for CUDA tensors;
            default "triton". An explicit backend="cuda" with CPU tensors is an error.

    Returns:
        (logp, entropy): [...] fp32 each, identical on every rank of tp_group, differentiable in both. The logits
        gradient on each rank is its own shard's gradient (no further reduction needed).
    """
    chosen = kernel_backend(backend)
    if backend == "cuda" and not logits.is_cuda:
        raise ValueError(f"logprobs_and_entropy: backend='cuda' needs CUDA tensors, got logits on {logits.device}")
    if not logits.is_cuda:
        chosen = "triton"  # the interpreter or the chunked reference; the environment variable only concerns GPUs
    if not use_triton(logits):
        return logprobs_and_entropy_chunked(
            logits, labels, temperature=temperature, tp_group=tp_group, vocab_size=vocab_size
        )
    f = flat_inputs(logits, labels, logits.shape[-1], tp_group, vocab_size, temperature, "logprobs_and_entropy")
    return f.unflatten(
        *LogProbEntropyFunction.apply(f.scores, f.labels, float(temperature), tp_group, f.vocab_size, chosen)
    )
