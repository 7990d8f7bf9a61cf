"""Fused LM head + per-token log-prob and entropy: logits = hidden @ weight.T never exist as [T, V].

Design: GEMM tiles plus the log-prob / entropy kernels of ops/logprob_entropy.py over each tile.

- Tiles. The work is cut into [Tc tokens, Vc vocab columns] tiles (ops/tiling.py, `tile_shape`): Tc = all tokens
  up to TileBudget.max_tokens (more are split evenly), Vc = the largest power of two with Tc * Vc within the
  budget's elements (the shard's real columns at most). Scratch is one tile, so extra memory is bounded whatever T is.
- Forward (token chunks outer, vocab tiles inner): z = hidden[c] @ weight[v].T as fp32 (one GEMM: cuBLAS with an
  fp32 output for bf16/fp16 inputs, `torch.mm(..., out_dtype=torch.float32)`), then the forward kernel of
  ops/logprob_entropy.py streams z, carrying its online softmax state (m, s, t, target logit: [4, Tc] fp32) from
  one vocab tile to the next and finalising on the last: the same arithmetic as one pass over the row, whatever the
  cut. Saved for backward: hidden, weight, labels and [3, T] fp32 global stats (lse, entropy, target logit).
- Backward (vocab tiles outer, token chunks inner): per tile z once more (GEMM), the backward kernel of
  ops/logprob_entropy.py turns z and the saved global stats into d logits for both the log-prob and the entropy
  terms (times 1 / temperature), rounded to the weight's dtype; then d_hidden[c] += dz @ weight[v] into an fp32
  accumulator (cuBLAS beta = 1, or an fp32 product added where this torch lacks fp32 accumulation of half inputs)
  and d_weight[v] = dz.T @ hidden[c] (one GEMM over all tokens; with several token chunks into an fp32 [Vc, H]
  accumulator, rounded once). Each logit tile is computed once: the backward is 3 GEMMs of 2THV (the recompute
  limit: logits, d hidden, d weight), the forward 1, plus two elementwise passes over fp32 tiles.
- Deterministic: GEMMs in a fixed order on one stream, kernels that each write their own rows, no atomics; d_hidden
  sums the vocab tiles in order.
- Vocab-parallel: weight is this rank's [V_local, H] shard (Megatron rank order), hidden is replicated. Shard stats
  are merged by one all_gather (reference.combine_vocab_shards). The weight gradient is the local shard's; the
  hidden gradient is all-reduced over tp_group inside backward, so it is already the FULL gradient on every rank.
  Do not put the hidden through Megatron's copy_to_tensor_model_parallel_region as well (that would sum twice).
- Padding: `vocab_size` as in ops/logprob_entropy.py; only the shard's real columns are tiled, padded weight rows
  get a zero gradient.
- Memory (bf16, extra beyond inputs and their gradients): forward one fp32 tile (forward_elements * 4 B) + 28 B
  per token; backward one fp32 tile + one weight-dtype tile (backward_elements * (4 + 2) B), the fp32 d_hidden
  accumulator (T * H * 4 B), and with T > max_tokens an fp32 [Vc, H] d_weight accumulator (tiling.scratch_bytes,
  which the planner uses). docs/kernels.md has the numbers at the benchmark's shapes.
- Dispatch (ops/dispatch.py): CUDA or TRITON_INTERPRET=1 -> this path (under the interpreter the GEMMs run in
  fp32 torch and the kernels in the interpreter, with INTERPRET_BUDGET's small tiles); plain CPU ->
  reference.linear_logprobs_and_entropy_chunked.
"""

import functools

import torch
import torch.distributed as dist

from megatron_dapo.ops.dispatch import interpreting
from megatron_dapo.ops.dispatch import use_triton
from megatron_dapo.ops.logprob_entropy import logprob_entropy_backward
from megatron_dapo.ops.logprob_entropy import logprob_entropy_forward
from megatron_dapo.ops.reference import Columns
from megatron_dapo.ops.reference import combine_vocab_shards
from megatron_dapo.ops.reference import flat_inputs
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import outputs_from_stats
from megatron_dapo.ops.tiling import GPU_BUDGET
from megatron_dapo.ops.tiling import INTERPRET_BUDGET
from megatron_dapo.ops.tiling import TileBudget
from megatron_dapo.ops.tiling import chunks
from megatron_dapo.ops.tiling import tile_shape


def _budget() -> TileBudget:
    return INTERPRET_BUDGET if interpreting() else GPU_BUDGET


# ---------------------------------------------------------------------------------------------------------------
# GEMMs: fp32 results from half inputs on CUDA (cuBLAS accumulates in fp32 and writes fp32); fp32 torch elsewhere
# ---------------------------------------------------------------------------------------------------------------
def _half_cuda(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) = a @ b, products and sums in fp32 (no rounding of the result to a's dtype)."""
    if _half_cuda(a):
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (a's dtype, contiguous) = a @ b, fp32 accumulation, one rounding."""
    if a.is_cuda or a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a.float(), b.float()))


@functools.cache
def _fp32_accumulate_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.addmm takes an fp32 accumulator with half inputs here (aten addmm.dtype_out with an fp32
    `self`: accepted by newer torch releases, refused by some older ones). Probed once per device and dtype."""
    try:
        acc = torch.ones(2, 2, device=device)
        a = torch.ones(2, 2, device=device, dtype=dtype)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, TypeError):
        return False


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32, contiguous) += a @ b with fp32 products; cuBLAS adds into acc in its epilogue where torch allows."""
    if _half_cuda(a):
        if _fp32_accumulate_supported(a.device, a.dtype):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    elif a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        acc.addmm_(a.float(), b.float())


# ---------------------------------------------------------------------------------------------------------------
# forward and backward
# ---------------------------------------------------------------------------------------------------------------
def linear_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cols: Columns,
    budget: TileBudget | None = None,
) -> torch.Tensor:
    """This shard's stats of softmax(hidden @ weight[:n_valid].T * inv_temp), tile by tile.

    Args:
        hidden: [T, H] (inner stride 1); weight: [V_local, H] (inner stride 1), same dtype; labels: [T] int64 global.
        cols: the shard's columns (reference.Columns: 1 / temperature, global id of weight row 0, real rows).
        budget: tile sizes (default: the GPU's, or the interpreter's under TRITON_INTERPRET=1).

    Returns:
        [3, T] fp32 shard (lse, entropy, target logit); a shard of padding only gives (-inf, 0, 0).
    """
    budget = budget or _budget()
    num_tokens = hidden.shape[0]
    stats = torch.empty((3, num_tokens), dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return stats
    if cols.n_valid == 0:
        stats[0], stats[1:] = float("-inf"), 0.0
        return stats
    tc, vc = tile_shape(num_tokens, cols.n_valid, budget.forward_elements, budget)
    z_buf = torch.empty(tc * vc, dtype=torch.float32, device=hidden.device)
    vocab = chunks(cols.n_valid, vc)
    for c0, c1 in chunks(num_tokens, tc):
        state = torch.empty((4, c1 - c0), dtype=torch.float32, device=hidden.device)
        out = stats if (c0, c1) == (0, num_tokens) else torch.empty_like(state[:3])
        for i, (v0, v1) in enumerate(vocab):
            z = _mm_f32(hidden[c0:c1], weight[v0:v1].T, out=z_buf[: (c1 - c0) * (v1 - v0)].view(c1 - c0, v1 - v0))
            logprob_entropy_forward(
                z, labels[c0:c1], cols.window(v0, v1), state=state, carry_in=i > 0, carry_out=i < len(vocab) - 1,
                stats=out,
            )  # fmt: skip
        if out is not stats:
            stats[:, c0:c1] = out
    return stats


def linear_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    grad_out: torch.Tensor,
    cols: Columns,
    budget: TileBudget | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum(g_logp * logp + g_ent * entropy), each logit tile computed once.

    Args:
        hidden, weight, labels, cols, budget: as in `linear_forward`.
        stats: [3, T] fp32 GLOBAL stats (after the vocab-parallel merge).
        grad_out: [2, T] fp32 (g_logp, g_ent).

    Returns:
        (d_hidden [T, H] fp32, this shard's partial: sum over tp_group for the full gradient; d_weight [V_local, H]
        in weight's dtype, zero on padding rows).
    """
    budget = budget or _budget()
    num_tokens, hdim = hidden.shape
    d_hidden = torch.zeros((num_tokens, hdim), dtype=torch.float32, device=hidden.device)
    d_weight = torch.empty_like(weight)
    d_weight[cols.n_valid :].zero_()
    if num_tokens == 0 or cols.n_valid == 0:
        return d_hidden, d_weight.zero_()
    tc, vc = tile_shape(num_tokens, cols.n_valid, budget.backward_elements, budget)
    token_chunks = chunks(num_tokens, tc)
    # The kernel reads [3, Tc] stats and [2, Tc] upstream grads contiguous: one copy per token chunk, made once.
    rows = [(c0, c1, stats[:, c0:c1].contiguous(), grad_out[:, c0:c1].contiguous()) for c0, c1 in token_chunks]
    z_buf = torch.empty(tc * vc, dtype=torch.float32, device=hidden.device)
    dw_acc = torch.empty((vc, hdim), dtype=torch.float32, device=hidden.device) if len(rows) > 1 else None
    for v0, v1 in chunks(cols.n_valid, vc):
        w_v = weight[v0:v1]
        if dw_acc is not None:
            dw_acc.zero_()
        for c0, c1, st, g in rows:
            z = _mm_f32(hidden[c0:c1], w_v.T, out=z_buf[: (c1 - c0) * (v1 - v0)].view(c1 - c0, v1 - v0))
            dz = logprob_entropy_backward(z, labels[c0:c1], st, g, cols.window(v0, v1), out_dtype=weight.dtype)
            _addmm_f32_(d_hidden[c0:c1], dz, w_v)
            if dw_acc is None:
                _mm_into(dz.T, hidden[c0:c1], out=d_weight[v0:v1])
            else:
                _addmm_f32_(dw_acc[: v1 - v0], dz.T, hidden[c0:c1])
            del dz
        if dw_acc is not None:
            d_weight[v0:v1] = dw_acc[: v1 - v0]
    return d_hidden, d_weight


class LinearLogProbEntropyFunction(torch.autograd.Function):
    """autograd wrapper; saves hidden, weight, labels and [3, T] fp32 global stats (lse, entropy, target logit)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, vocab_size):
        cols = Columns.of_shard(weight.shape[0], tp_group, vocab_size, temperature)
        stats = linear_forward(hidden, weight, labels, cols)
        stats = combine_vocab_shards(stats, tp_group)
        ctx.save_for_backward(hidden, weight, labels, stats)
        ctx.args = (cols, tp_group)
        return outputs_from_stats(stats)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, stats = ctx.saved_tensors
        cols, tp_group = ctx.args
        d_hidden, d_weight = linear_backward(hidden, weight, labels, stats, torch.stack([g_logp, g_ent]).float(), cols)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(d_hidden, group=tp_group)
        return d_hidden.to(hidden.dtype), d_weight, None, None, None, None


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of softmax(hidden @ weight.T / temperature) without [T, V] logits.

    Args:
        hidden: [..., H] fp32/fp16/bf16, replicated across tp_group.
        weight: [V_local, H], same dtype; with tp_group, this rank's vocab shard in Megatron rank order.
        labels: [...] int64 (or int32) global token ids in [0, vocab_size).
        temperature: logits are divided by it (> 0).
        tp_group: vocab-parallel process group, or None.
        vocab_size: true global vocab size; weight rows with global id >= vocab_size are padding and ignored.

    Returns:
        (logp, entropy): [...] fp32 each, the same on every rank. Gradients: weight gets this rank's shard
        gradient; hidden gets the FULL gradient (summed over tp_group inside backward).
    """
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_logprobs_and_entropy: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_logprobs_and_entropy: hidden H={hidden.shape[-1]} != weight H={weight.shape[-1]}")
    if not use_triton(hidden):
        return linear_logprobs_and_entropy_chunked(
            hidden, weight, labels, temperature=temperature, tp_group=tp_group, vocab_size=vocab_size
        )
    f = flat_inputs(hidden, labels, weight.shape[0], tp_group, vocab_size, temperature, "linear_logprobs_and_entropy")
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return f.unflatten(
        *LinearLogProbEntropyFunction.apply(f.scores, w, f.labels, float(temperature), tp_group, f.vocab_size)
    )
