"""Fused LM head + per-token log-prob and entropy (Triton): logits = hidden @ weight.T never exist as [T, V].

- Forward: programs own BLOCK_T tokens and stream vocab tiles; each tile's logits come from tl.dot over H in
  BLOCK_H steps and go straight into the online softmax (_softmax_utils.py). Saved: hidden, weight, labels and
  [3, T] fp32 (lse, entropy, target logit) -- the same layout as ops/logprob_entropy.py.
- Backward: two kernels, both recompute logits tiles. d weight: one program per (vocab tile, H tile) loops over all
  token blocks and writes its own dW tile (deterministic, no atomics). d hidden: one program per (token block,
  H tile) loops over all vocab tiles. Cost: each recomputes the logits matmul H / BLOCK_HO times, i.e. the
  backward is about 2 * H / BLOCK_HO forward matmuls -- it trades FLOPs for memory and determinism.
- Vocab-parallel: weight is this rank's [V_local, H] shard (Megatron rank order), hidden is replicated. Shard stats
  are merged by one all_gather (reference.combine_vocab_shards). The weight gradient is the local shard's; the
  hidden gradient is all-reduced over tp_group inside backward, so it is already the FULL gradient on every rank.
  Do not put the hidden through Megatron's copy_to_tensor_model_parallel_region as well (that would sum twice).
- Padding: `vocab_size` as in ops/logprob_entropy.py; padded weight rows get a zero gradient.
- Dots: on CUDA, fp16/bf16 tiles go to tl.dot as they are (fp32 accumulate) and dlogits are rounded to the weight
  dtype before the gradient dots; fp32 uses input_precision="ieee". The interpreter computes on raw bf16 bits, so
  there every loaded tile is upcast to fp32 first (UPCAST constexpr).
- Dispatch (ops/dispatch.py): CUDA or TRITON_INTERPRET=1 -> these kernels; plain CPU ->
  reference.linear_logprobs_and_entropy_chunked.
"""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from megatron_dapo.ops._softmax_utils import logprob_entropy_dz
from megatron_dapo.ops._softmax_utils import online_softmax_finalize
from megatron_dapo.ops._softmax_utils import online_softmax_update
from megatron_dapo.ops._softmax_utils import target_logit
from megatron_dapo.ops.dispatch import interpreting
from megatron_dapo.ops.dispatch import use_triton
from megatron_dapo.ops.reference import check_inputs
from megatron_dapo.ops.reference import combine_vocab_shards
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import merge_stats
from megatron_dapo.ops.reference import outputs_from_stats
from megatron_dapo.ops.reference import vocab_shard

# (BLOCK_T, BLOCK_V, BLOCK_H, BLOCK_HO, num_warps) per dtype; tl.dot needs >= 16. Chosen from the sm_90 AOT compile
# report (tests/ops/test_compile_sm90.py prints registers and stack per kernel; docs/kernels.md has the table): the
# first release's (64, 128, 64, 128, 8) hit the 255-register cap in all three kernels and spilled (bf16 d_weight
# 688 B/thread of stack, fp32 up to 2.3 KB). bf16/fp16: BLOCK_V 64 keeps the [64, 64] fp32 logits tile and the
# [64, 128] accumulator within 230-250 registers without spills while BLOCK_HO stays 128 (the backward recomputes
# the logits H / BLOCK_HO times). fp32 (ieee dots, no tensor cores) needs BLOCK_HO 32 as well. Untimed: no GPU here.
GPU_BLOCKS = {
    torch.bfloat16: (64, 64, 64, 128, 8),
    torch.float16: (64, 64, 64, 128, 8),
    torch.float32: (64, 64, 32, 32, 8),
}
INTERPRET_BLOCKS = (16, 32, 16, 16, 1)
INTERPRET_NUM_SMS = 2  # the interpreter has no SMs; 2 makes small test shapes exercise the vocab split
MIN_TILES_PER_SPLIT = 8  # GPU: a split streams at least 8 vocab tiles, so the [splits, 3, T] merge stays negligible


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    H,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """z = (hidden[rows] @ weight[cols].T) * inv_temp as [BLOCK_T, BLOCK_V] fp32, -inf outside (row_ok, col_ok)."""
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    h_base = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_base = w_ptr + cols.to(tl.int64)[None, :] * stride_w
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        h = tl.load(h_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_V]
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    return tl.where(row_ok[:, None] & col_ok[None, :], acc * inv_temp, float("-inf"))


@triton.jit
def _linear_fwd_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    stats_ptr,
    T,
    H,
    n_valid,
    stride_h,
    stride_w,
    class_start,
    inv_temp,
    cols_per_split,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # h: [T, H]; w: [V_local, H]; labels [T] int64 global. Program (token block, vocab split) streams the vocab tiles
    # of columns [split * cols_per_split, min(n_valid, (split + 1) * cols_per_split)) and writes that slice's stats
    # to stats [num_splits, 3, T] fp32 (lse, entropy, target logit); the host merges the splits like TP shards.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    row_ok = rows < T
    labels_local = tl.load(labels_ptr + rows, mask=row_ok, other=0) - class_start
    v_begin = split * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, n_valid)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    t = tl.zeros([BLOCK_T], tl.float32)
    zt = tl.zeros([BLOCK_T], tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = _logits_tile(
            h_ptr,
            w_ptr,
            rows,
            cols,
            row_ok,
            cols < v_end,
            H,
            stride_h,
            stride_w,
            inv_temp,
            BLOCK_T,
            BLOCK_V,
            BLOCK_H,
            UPCAST,
            DOT_PRECISION,
        )
        m, s, t = online_softmax_update(z, m, s, t)
        zt += target_logit(z, cols, labels_local, v_end)
    lse, ent = online_softmax_finalize(m, s, t)
    out = stats_ptr + split * 3 * T
    tl.store(out + rows, lse, mask=row_ok)
    tl.store(out + T + rows, ent, mask=row_ok)
    tl.store(out + 2 * T + rows, zt, mask=row_ok)


@triton.jit
def _dlogits_tile(
    h_ptr,
    w_ptr,
    labels_ptr,
    stats_ptr,
    grad_out_ptr,
    rows,
    cols,
    T,
    H,
    n_valid,
    stride_h,
    stride_w,
    class_start,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Recomputed d loss / d logits for a [BLOCK_T, BLOCK_V] tile, fp32, exactly 0 outside valid rows/columns."""
    row_ok = rows < T
    col_ok = cols < n_valid
    labels_local = tl.load(labels_ptr + rows, mask=row_ok, other=0) - class_start
    lse = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
    ent = tl.load(stats_ptr + T + rows, mask=row_ok, other=0.0)
    g_logp = tl.load(grad_out_ptr + rows, mask=row_ok, other=0.0)
    g_ent = tl.load(grad_out_ptr + T + rows, mask=row_ok, other=0.0)
    z = _logits_tile(
        h_ptr,
        w_ptr,
        rows,
        cols,
        row_ok,
        col_ok,
        H,
        stride_h,
        stride_w,
        inv_temp,
        BLOCK_T,
        BLOCK_V,
        BLOCK_H,
        UPCAST,
        DOT_PRECISION,
    )
    dz = logprob_entropy_dz(z, cols, labels_local, lse, ent, g_logp, g_ent)
    return tl.where(row_ok[:, None] & col_ok[None, :], dz * inv_temp, 0.0)


@triton.jit
def _linear_bwd_dweight_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    stats_ptr,
    grad_out_ptr,
    dw_ptr,
    T,
    H,
    V_local,
    n_valid,
    stride_h,
    stride_w,
    stride_dw,
    class_start,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HO: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (vocab tile, H tile) owns dW[cols, hs]: sum over all tokens of dlogits[:, cols].T @ hidden[:, hs].
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    hs = tl.program_id(1) * BLOCK_HO + tl.arange(0, BLOCK_HO)
    hs_ok = hs < H
    acc = tl.zeros([BLOCK_V, BLOCK_HO], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        dl = _dlogits_tile(
            h_ptr,
            w_ptr,
            labels_ptr,
            stats_ptr,
            grad_out_ptr,
            rows,
            cols,
            T,
            H,
            n_valid,
            stride_h,
            stride_w,
            class_start,
            inv_temp,
            BLOCK_T,
            BLOCK_V,
            BLOCK_H,
            UPCAST,
            DOT_PRECISION,
        )
        h = tl.load(
            h_ptr + rows.to(tl.int64)[:, None] * stride_h + hs[None, :],
            mask=(rows < T)[:, None] & hs_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            h = h.to(tl.float32)
        else:
            dl = dl.to(h.dtype)
        acc = tl.dot(tl.trans(dl), h, acc, input_precision=DOT_PRECISION)
    out = dw_ptr + cols.to(tl.int64)[:, None] * stride_dw + hs[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=(cols < V_local)[:, None] & hs_ok[None, :])


@triton.jit
def _linear_bwd_dhidden_kernel(
    h_ptr,
    w_ptr,
    labels_ptr,
    stats_ptr,
    grad_out_ptr,
    dh_ptr,
    T,
    H,
    n_valid,
    stride_h,
    stride_w,
    class_start,
    inv_temp,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HO: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (token block, H tile) owns dh[rows, hs] (fp32 [T, H], contiguous): sum over vocab tiles.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_HO + tl.arange(0, BLOCK_HO)
    hs_ok = hs < H
    acc = tl.zeros([BLOCK_T, BLOCK_HO], tl.float32)
    for v0 in range(0, n_valid, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        dl = _dlogits_tile(
            h_ptr,
            w_ptr,
            labels_ptr,
            stats_ptr,
            grad_out_ptr,
            rows,
            cols,
            T,
            H,
            n_valid,
            stride_h,
            stride_w,
            class_start,
            inv_temp,
            BLOCK_T,
            BLOCK_V,
            BLOCK_H,
            UPCAST,
            DOT_PRECISION,
        )
        w = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * stride_w + hs[None, :],
            mask=(cols < n_valid)[:, None] & hs_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            w = w.to(tl.float32)
        else:
            dl = dl.to(w.dtype)
        acc = tl.dot(dl, w, acc, input_precision=DOT_PRECISION)
    out = dh_ptr + rows.to(tl.int64)[:, None] * H + hs[None, :]
    tl.store(out, acc, mask=(rows < T)[:, None] & hs_ok[None, :])


def _launch_cfg(dtype: torch.dtype) -> tuple[tuple[int, int, int, int, int], bool, str]:
    blocks = INTERPRET_BLOCKS if interpreting() else GPU_BLOCKS[dtype]
    upcast = interpreting()
    precision = "ieee" if (upcast or dtype == torch.float32) else "tf32"
    return blocks, upcast, precision


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRET_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_vocab_splits(num_row_blocks: int, n_tiles: int, num_sms: int, min_tiles: int) -> int:
    """How many vocab splits the forward grid gets: enough programs for two waves over the SMs, each split keeping
    at least `min_tiles` vocab tiles (fewer splits when that would leave a split empty).

    Without splitting, the grid is ceil(T / BLOCK_T) programs: 32 of an H100's 132 SMs at T = 2048, BLOCK_T = 64.
    """
    if n_tiles <= 1:
        return 1
    want = triton.cdiv(2 * num_sms, max(num_row_blocks, 1))
    splits = max(1, min(want, n_tiles // max(min_tiles, 1)))
    return triton.cdiv(n_tiles, triton.cdiv(n_tiles, splits))  # no empty split


def linear_forward(hidden, weight, labels, *, inv_temp: float, class_start: int, n_valid: int) -> torch.Tensor:
    """Launch the forward kernel: hidden [T, H], weight [V_local, H] (inner stride 1), labels [T] -> stats [3, T]."""
    num_tokens, hdim = hidden.shape
    if num_tokens == 0:
        return torch.empty((3, 0), dtype=torch.float32, device=hidden.device)
    (bt, bv, bh, _, warps), upcast, precision = _launch_cfg(hidden.dtype)
    row_blocks, n_tiles = triton.cdiv(num_tokens, bt), triton.cdiv(n_valid, bv)
    min_tiles = 1 if interpreting() else MIN_TILES_PER_SPLIT
    splits = num_vocab_splits(row_blocks, n_tiles, _num_sms(hidden.device), min_tiles)
    cols_per_split = max(triton.cdiv(n_tiles, splits), 1) * bv
    stats = torch.empty((splits, 3, num_tokens), dtype=torch.float32, device=hidden.device)
    _linear_fwd_kernel[(row_blocks, splits)](
        hidden,
        weight,
        labels,
        stats,
        num_tokens,
        hdim,
        n_valid,
        hidden.stride(0),
        weight.stride(0),
        class_start,
        inv_temp,
        cols_per_split,
        BLOCK_T=bt,
        BLOCK_V=bv,
        BLOCK_H=bh,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=warps,
    )
    return stats[0] if splits == 1 else merge_stats(stats)


def linear_backward(hidden, weight, labels, stats, grad_out, *, inv_temp: float, class_start: int, n_valid: int):
    """Launch both backward kernels -> (d_hidden [T, H] fp32 local partial, d_weight [V_local, H] weight dtype)."""
    num_tokens, hdim = hidden.shape
    v_local = weight.shape[0]
    d_hidden = torch.zeros((num_tokens, hdim), dtype=torch.float32, device=hidden.device)
    d_weight = torch.zeros_like(weight)
    if num_tokens == 0:
        return d_hidden, d_weight
    (bt, bv, bh, bho, warps), upcast, precision = _launch_cfg(hidden.dtype)
    common = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, BLOCK_HO=bho, UPCAST=upcast, DOT_PRECISION=precision)
    _linear_bwd_dweight_kernel[(triton.cdiv(v_local, bv), triton.cdiv(hdim, bho))](
        hidden,
        weight,
        labels,
        stats,
        grad_out,
        d_weight,
        num_tokens,
        hdim,
        v_local,
        n_valid,
        hidden.stride(0),
        weight.stride(0),
        d_weight.stride(0),
        class_start,
        inv_temp,
        num_warps=warps,
        **common,
    )
    if n_valid > 0:
        _linear_bwd_dhidden_kernel[(triton.cdiv(num_tokens, bt), triton.cdiv(hdim, bho))](
            hidden,
            weight,
            labels,
            stats,
            grad_out,
            d_hidden,
            num_tokens,
            hdim,
            n_valid,
            hidden.stride(0),
            weight.stride(0),
            class_start,
            inv_temp,
            num_warps=warps,
            **common,
        )
    return d_hidden, d_weight


class LinearLogProbEntropyFunction(torch.autograd.Function):
    """autograd wrapper; saves hidden, weight, labels and [3, T] fp32 global stats (lse, entropy, target logit)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, vocab_size):
        class_start, n_valid, _ = vocab_shard(weight.shape[0], tp_group, vocab_size)
        inv_temp = 1.0 / temperature
        stats = linear_forward(hidden, weight, labels, inv_temp=inv_temp, class_start=class_start, n_valid=n_valid)
        stats = combine_vocab_shards(stats, tp_group)
        ctx.save_for_backward(hidden, weight, labels, stats)
        ctx.args = (inv_temp, class_start, n_valid, tp_group)
        return outputs_from_stats(stats)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, stats = ctx.saved_tensors
        inv_temp, class_start, n_valid, tp_group = ctx.args
        grad_out = torch.stack([g_logp, g_ent]).to(torch.float32)
        d_hidden, d_weight = linear_backward(
            hidden, weight, labels, stats, grad_out, inv_temp=inv_temp, class_start=class_start, n_valid=n_valid
        )
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
    _, _, vocab_size = vocab_shard(weight.shape[0], tp_group, vocab_size)
    check_inputs(hidden, labels, vocab_size, temperature, "linear_logprobs_and_entropy")
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    h = h if h.stride(-1) == 1 else h.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    lab = labels.reshape(-1).to(torch.int64).contiguous()
    logp, ent = LinearLogProbEntropyFunction.apply(h, w, lab, float(temperature), tp_group, vocab_size)
    return logp.reshape(lead), ent.reshape(lead)
