"""Fused clipped policy-gradient loss: the twin of `megatron_dapo.algorithms.dapo_policy_loss`.

One kernel launch per direction:

- forward: each program reduces BLOCK tokens to 7 partial sums (weighted loss, mask weight, valid count, clip-high
  count, clip-low count, KL sum, ratio max) written to a [num_programs, 8] fp32 buffer; torch then sums that buffer
  in a fixed order. No float atomics, so the result is bitwise reproducible run to run.
- backward: recomputes ratio and branch per token from the inputs (nothing [B, T] is saved besides the inputs
  themselves) and writes d loss / d logp in logp's dtype, already scaled by grad_output / D.

Branches and ties (see docs/kernels.md and policy_loss.clipped_token_loss): every clip decision compares the fp32
log-ratio r = logp - old_logp with log(1 - eps_low), log(1 + eps_high) and log(c) (policy_loss.ClipBounds), so the
reference, this kernel and the CUDA twin pick the same branch for the same inputs whatever their exp rounds to. A
log-ratio exactly on a bound keeps the unclipped gradient -A * ratio. r is clamped to [-20, 20] before exp (as verl
does), so loss and gradient stay finite for log-ratios of any size.

Dispatch: `use_triton` (ops/dispatch.py) picks Triton for CUDA tensors and for CPU tensors under TRITON_INTERPRET=1;
other CPU calls run the reference. MEGATRON_DAPO_KERNEL_BACKEND=cuda (or backend="cuda") selects the CUDA C++ twin
from csrc/ on GPU, which must then have been built (csrc/README.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_dapo.algorithms.policy_loss import LOG_RATIO_CLAMP
from megatron_dapo.algorithms.policy_loss import LOSS_AGG_MODES
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import dapo_policy_loss
from megatron_dapo.ops.dispatch import kernel_backend
from megatron_dapo.ops.dispatch import use_triton

BLOCK_TOKENS = 1024
NUM_PARTIALS = 8  # columns of the per-program partial buffer (7 used, padded to 8)
_LOG_RATIO_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)


@triton.jit
def _pg_token_terms(
    logp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    offs,
    inb,
    seq_len,
    lo,
    hi,
    clip_c,
    log_lo,
    log_hi,
    log_c,
    ADV_PER_TOKEN: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
):
    """Per-token clamped ratio, log-ratio, loss, gradient factor d l / d logp (unmasked) and mask weight, fp32.

    Branches are decided on the log-ratio r (policy_loss.clipped_token_loss): the exp below compiles to ex2.approx on
    sm_90 and rounds differently from torch's, so a decision on exp(r) could differ between backends at a bound.
    """
    # Upcast right after every load: the interpreter keeps bf16 as raw bits.
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    if ADV_PER_TOKEN:
        adv = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    else:
        adv = tl.load(adv_ptr + offs // seq_len, mask=inb, other=0.0).to(tl.float32)
    w = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
    r = logp - old
    # Clamp before exp (verl's bound): the ratio, loss and gradient stay finite in fp32 for any finite inputs.
    ratio = tl.exp(tl.minimum(tl.maximum(r, -_LOG_RATIO_CLAMP), _LOG_RATIO_CLAMP))
    clip_high = (adv > 0) & (r > log_hi)
    clip_low = (adv < 0) & (r < log_lo)
    loss = tl.where(clip_high, -adv * hi, tl.where(clip_low, -adv * lo, -adv * ratio))
    # Unclipped gradient d(-A r)/dlogp = -A ratio, zero where the clamp is active (as torch.clamp's gradient).
    active = ~clip_high & ~clip_low & (r >= -_LOG_RATIO_CLAMP) & (r <= _LOG_RATIO_CLAMP)
    if DUAL_CLIP:
        capped = (adv < 0) & (r > log_c)
        loss = tl.where(capped, -adv * clip_c, loss)
        active = active & ~capped
    dloss = tl.where(active, -adv * ratio, 0.0)
    return ratio, r, loss, dloss, adv, w


@triton.jit
def _pg_loss_fwd_kernel(
    logp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    partial_ptr,
    num_elements,
    seq_len,
    lo,
    hi,
    clip_c,
    log_lo,
    log_hi,
    log_c,
    ADV_PER_TOKEN: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < num_elements
    ratio, r, loss, dloss, adv, w = _pg_token_terms(
        logp_ptr, old_ptr, adv_ptr, mask_ptr, offs, inb, seq_len, lo, hi, clip_c, log_lo, log_hi, log_c,
        ADV_PER_TOKEN, DUAL_CLIP,
    )  # fmt: skip
    valid = inb & (w != 0.0)
    # tl.where instead of multiplying by the mask: masked-out tokens never leak inf/NaN into the sums.
    loss_sum = tl.sum(tl.where(valid, loss * w, 0.0), axis=0)
    weight_sum = tl.sum(tl.where(valid, w, 0.0), axis=0)
    count = tl.sum(tl.where(valid, 1.0, 0.0), axis=0)
    high = tl.sum(tl.where(valid & (adv > 0) & (r > log_hi), 1.0, 0.0), axis=0)
    low = tl.sum(tl.where(valid & (adv < 0) & (r < log_lo), 1.0, 0.0), axis=0)
    kl = tl.sum(tl.where(valid, -r, 0.0), axis=0)
    rmax = tl.max(tl.where(valid, ratio, 0.0), axis=0)
    row = partial_ptr + pid * 8
    tl.store(row + 0, loss_sum)
    tl.store(row + 1, weight_sum)
    tl.store(row + 2, count)
    tl.store(row + 3, high)
    tl.store(row + 4, low)
    tl.store(row + 5, kl)
    tl.store(row + 6, rmax)
    tl.store(row + 7, 0.0)


@triton.jit
def _pg_loss_bwd_kernel(
    logp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    grad_out_ptr,
    inv_denom_ptr,
    grad_ptr,
    num_elements,
    seq_len,
    lo,
    hi,
    clip_c,
    log_lo,
    log_hi,
    log_c,
    ADV_PER_TOKEN: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < num_elements
    ratio, r, loss, dloss, adv, w = _pg_token_terms(
        logp_ptr, old_ptr, adv_ptr, mask_ptr, offs, inb, seq_len, lo, hi, clip_c, log_lo, log_hi, log_c,
        ADV_PER_TOKEN, DUAL_CLIP,
    )  # fmt: skip
    # Scalars read on device: no host sync for grad_output or a tensor num_tokens.
    scale = tl.load(grad_out_ptr).to(tl.float32) * tl.load(inv_denom_ptr)
    grad = tl.where(inb & (w != 0.0), dloss * w * scale, 0.0)
    tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=inb)


def _launch_meta(num_elements: int) -> tuple[int, int]:
    block = min(BLOCK_TOKENS, max(16, triton.next_power_of_2(max(num_elements, 1))))
    return block, triton.cdiv(max(num_elements, 1), block)


def _bound_args(b: ClipBounds) -> tuple[float, ...]:
    """The kernels' scalar arguments (lo, hi, clip_c, log_lo, log_hi, log_c), all already fp32-exact."""
    return (b.lo, b.hi, 0.0 if b.clip_c is None else b.clip_c, b.log_lo, b.log_hi, b.log_c)


def pg_loss_partials(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, bounds: ClipBounds) -> Tensor:
    """Triton forward: per-program partial sums.

    Args:
        logp, old_logp: [B, T] contiguous float. adv: [B] or [B, T] contiguous float. mask: [B, T] contiguous,
            float or uint8 (bool viewed as uint8).
    Returns:
        [num_programs, 8] fp32: loss*w, w, count, clip-high count, clip-low count, KL sum, ratio max, pad.
    """
    num_elements = logp.numel()
    block, grid = _launch_meta(num_elements)
    partials = torch.empty((grid, NUM_PARTIALS), dtype=torch.float32, device=logp.device)
    _pg_loss_fwd_kernel[(grid,)](
        logp,
        old_logp,
        adv,
        mask,
        partials,
        num_elements,
        max(logp.shape[-1], 1),
        *_bound_args(bounds),
        ADV_PER_TOKEN=adv.dim() == 2,
        DUAL_CLIP=bounds.clip_c is not None,
        BLOCK=block,
    )
    return partials


def pg_loss_grad(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    grad_out: Tensor,
    inv_denom: Tensor,
    bounds: ClipBounds,
) -> Tensor:
    """Triton backward: d loss / d logp [B, T] in logp's dtype, scaled by grad_out (0-dim) and inv_denom (0-dim)."""
    num_elements = logp.numel()
    grad = torch.empty_like(logp)
    if num_elements == 0:
        return grad
    block, grid = _launch_meta(num_elements)
    _pg_loss_bwd_kernel[(grid,)](
        logp,
        old_logp,
        adv,
        mask,
        grad_out.to(torch.float32).reshape(1),
        inv_denom.reshape(1),
        grad,
        num_elements,
        max(logp.shape[-1], 1),
        *_bound_args(bounds),
        ADV_PER_TOKEN=adv.dim() == 2,
        DUAL_CLIP=bounds.clip_c is not None,
        BLOCK=block,
    )
    return grad


def _finish(totals: Tensor, num_tokens: float | Tensor | None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Loss, 1/D and metrics from the 7 reduced totals (same denominators as policy_loss.py)."""
    weight_sum, count = totals[1], totals[2]
    denom = weight_sum if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32, device=totals.device)
    # D is clamped to >= 1 like agg_loss: an empty batch (D == 0) gives loss 0 and gradient 0, never NaN.
    inv_denom = 1.0 / denom.to(torch.float32).clamp_min(1.0)
    inv_count = 1.0 / count.clamp_min(1.0)
    metrics = {
        "clipfrac_high": totals[3] * inv_count,
        "clipfrac_low": totals[4] * inv_count,
        "approx_kl": totals[5] * inv_count,
        "ratio_max": totals[6],
    }
    return totals[0] * inv_denom, inv_denom, metrics


def _reduce_partials(partials: Tensor) -> Tensor:
    """Fixed-order reduction of [P, 8] partials to [7] totals (sums, then the max of column 6)."""
    sums = partials[:, :6].sum(dim=0)
    rmax = partials[:, 6].max() if partials.shape[0] else partials.new_zeros(())
    return torch.cat([sums, rmax.reshape(1)])


class ClippedPGLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, advantages, mask, bounds, num_tokens, backend):
        if backend == "cuda":
            from megatron_dapo.ops import _cuda_twins  # noqa: PLC0415

            totals = _cuda_twins.pg_loss_totals(logp, old_logp, advantages, mask, bounds)
        else:
            totals = _reduce_partials(pg_loss_partials(logp, old_logp, advantages, mask, bounds))
        loss, inv_denom, metrics = _finish(totals, num_tokens)
        ctx.save_for_backward(logp, old_logp, advantages, mask, inv_denom)
        ctx.params = (bounds, backend)
        ctx.mark_non_differentiable(*metrics.values())
        return loss, metrics["clipfrac_high"], metrics["clipfrac_low"], metrics["approx_kl"], metrics["ratio_max"]

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        logp, old_logp, advantages, mask, inv_denom = ctx.saved_tensors
        bounds, backend = ctx.params
        if backend == "cuda":
            from megatron_dapo.ops import _cuda_twins  # noqa: PLC0415

            grad = _cuda_twins.pg_loss_grad(logp, old_logp, advantages, mask, grad_loss, inv_denom, bounds)
        else:
            grad = pg_loss_grad(logp, old_logp, advantages, mask, grad_loss, inv_denom, bounds)
        return grad, None, None, None, None, None, None


def _check_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> None:
    if logp.dim() != 2:
        raise ValueError(f"clipped_pg_loss: logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"clipped_pg_loss: {name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"clipped_pg_loss: advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    if logp.numel() >= 2**31:
        raise ValueError(f"clipped_pg_loss: {logp.numel()} tokens exceed the int32 indexing of the kernel")


def _sequence_mean_weights(mask: Tensor, num_tokens: float | Tensor | None, mode: str) -> tuple[Tensor, float | Tensor]:
    """Per-token weights [B, T] fp32 and denominator that turn the kernel's sum(l * w) / D into `agg_loss`'s
    sequence-mean modes (w is non-zero exactly where mask is, so the metrics count the same tokens)."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"algorithm.loss_agg_mode: unknown {mode!r}; choose one of {LOSS_AGG_MODES}")
    m = mask.to(torch.float32)
    seq_tokens = m.sum(dim=-1, keepdim=True)
    weights = m / seq_tokens.clamp_min(1.0) if mode == "seq-mean-token-mean" else m
    if num_tokens is None:
        num_tokens = (seq_tokens > 0).to(torch.float32).sum()
    return weights, num_tokens


def clipped_pg_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float | None = None,
    num_tokens: float | Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    backend: str | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Fused DAPO clipped surrogate; same arguments, loss and metrics as `dapo_policy_loss` (to fp32 rounding).

    ratio = exp(logp - old_logp); l = max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)); with clip_ratio_c,
    l = min(l, -A c) where A < 0. loss = sum(l * mask) / max(D, 1), D = num_tokens or mask.sum().

    Args:
        logp: [B, T] fp32/bf16/fp16, current log-probs; the only input that receives a gradient.
        old_logp: [B, T] float, behaviour-policy log-probs (never differentiated).
        advantages: [B] or [B, T] float.
        mask: [B, T] bool or float; float values weight the loss, metrics count tokens with mask != 0.
        eps_low, eps_high: clip range (1 - eps_low, 1 + eps_high).
        clip_ratio_c: dual-clip constant (> 1) for A < 0, or None.
        num_tokens: global valid-token count (float or 0-dim tensor, read on device), or None for mask.sum(); for the
            seq-mean modes the global number of sequences (None: this call's sequences with a valid token).
        loss_agg_mode: "token-mean" (DAPO), "seq-mean-token-mean" or "seq-mean-token-sum" (`agg_loss`). The
            kernel computes sum(l * w) / D; the sequence means are that sum with per-token weights
            w = mask / tokens of its sequence (token-mean within a sequence) or w = mask, and D = sequences.
        backend: "triton" or "cuda" for CUDA tensors; default env MEGATRON_DAPO_KERNEL_BACKEND or "triton".
        weights: [B, T] float or None, per-token importance weights (rollout correction) multiplying each token's
            loss, l -> w * l. They are folded into the kernel's float mask weights (mask * w), so they must be > 0
            wherever mask is non-zero for the metrics to count the same tokens; D is unchanged.
    Returns:
        loss: 0-dim fp32. metrics: 0-dim fp32 tensors clipfrac_high, clipfrac_low, approx_kl, ratio_max (over the
        valid tokens of this call; 0 when there are none).
    """
    _check_inputs(logp, old_logp, advantages, mask)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clipped_pg_loss: clip_ratio_c must be > 1, got {clip_ratio_c}")
    chosen = kernel_backend(backend)
    if not use_triton(logp):
        return dapo_policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            eps_low=eps_low,
            eps_high=eps_high,
            clip_ratio_c=clip_ratio_c,
            num_tokens=num_tokens,
            loss_agg_mode=loss_agg_mode,
            weights=weights,
        )
    if loss_agg_mode != "token-mean":
        mask, num_tokens = _sequence_mean_weights(mask, num_tokens, loss_agg_mode)
    if weights is not None:
        if weights.shape != logp.shape:
            raise ValueError(f"clipped_pg_loss: weights shape {tuple(weights.shape)} != logp {tuple(logp.shape)}")
        # sum(l * mask * w) / D: the kernel's float mask weight carries the IS weight (zero stays zero).
        m = mask.to(torch.float32)
        if num_tokens is None:
            num_tokens = m.sum()  # D stays the mask's, not the sum of the weights folded in below
        mask = torch.where(m != 0, m * weights.detach().to(torch.float32), torch.zeros_like(m))
    if not logp.is_cuda:
        chosen = "triton"  # the interpreter; the CUDA twin needs a GPU
    if mask.dtype == torch.bool:
        mask = mask.contiguous().view(torch.uint8)
    # Bounds formed in float64 and rounded once to fp32, the same numbers the reference compares against.
    bounds = ClipBounds.make(eps_low, eps_high, clip_ratio_c)
    outs = ClippedPGLossFunction.apply(
        logp.contiguous(),
        old_logp.detach().contiguous(),
        advantages.detach().contiguous(),
        mask.contiguous(),
        bounds,
        num_tokens,
        chosen,
    )
    loss, high, low, kl, rmax = outs
    return loss, {"clipfrac_high": high, "clipfrac_low": low, "approx_kl": kl, "ratio_max": rmax}
