"""DAPO's policy loss (decoupled clip, optional dual clip) and loss aggregation modes.

The fused twin is `megatron_dapo.ops.clipped_pg_loss`; this file is its reference semantics.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        eps_low: float,
        eps_high: float,
        clip_ratio_c: float | None,
        num_tokens: float | Tensor | None,
        loss_agg_mode: str,
        weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}
FUSED_POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Kernel implementations of registered losses (same signature, same results to fp32 rounding); the reference in
POLICY_LOSSES is their oracle and CPU fallback."""


def register_policy_loss(name: str, *, fused: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under `name` (config field `algorithm.policy_loss`); fused=True registers the kernel
    implementation of an existing name instead."""
    table = FUSED_POLICY_LOSSES if fused else POLICY_LOSSES

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in table:
            raise ValueError(f"policy loss {name!r} is already registered{' (fused)' if fused else ''}")
        table[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str, *, fused: bool = False) -> PolicyLossFn:
    """The loss registered as `name`; with fused=True its kernel implementation when one is registered (the
    reference otherwise). The actor asks for fused when actor.logprob_impl selects a fused path."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"algorithm.policy_loss: unknown {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    if fused and name in FUSED_POLICY_LOSSES:
        return FUSED_POLICY_LOSSES[name]
    return POLICY_LOSSES[name]


def _safe_denominator(num_tokens: float | Tensor | None, mask: Tensor) -> Tensor:
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device)
    # An empty batch contributes zero loss and zero gradient instead of NaN.
    return denom.to(torch.float32).clamp_min(1.0)


def agg_loss(
    per_token: Tensor, mask: Tensor, mode: str = "token-mean", num_tokens: float | Tensor | None = None
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    "token-mean" (DAPO): sum(per_token * mask) / D, where D is the number of valid tokens of the WHOLE mini-batch
    (all micro-batches, all data-parallel ranks), passed as `num_tokens`. Each micro-batch then returns its share of
    the global mean; summing micro-batch gradients (gradient accumulation) and all-reducing them with SUM over DP
    gives exactly the gradient of the whole-batch token mean, whatever the split. Without `num_tokens`, D is this
    call's own mask.sum().

    "seq-mean-token-mean" (GRPO): mean over sequences of each sequence's token mean. Long responses weigh the same as
    short ones, so splitting changes nothing within a sequence, but the result is NOT the token-level mean. With
    `num_tokens` it is read as the global number of sequences (for the same split invariance).

    "seq-mean-token-sum": mean over sequences of each sequence's token sum (Dr. GRPO style, no length normalisation).

    Args:
        per_token: [B, T] float.
        mask: [B, T] bool or float (1 = valid response token).
    Returns:
        0-dim fp32 tensor.
    """
    mask = mask.to(per_token.dtype)
    # where() rather than a product: a padded token with an overflowing ratio (inf * 0 = nan) must add exactly 0.
    masked = torch.where(mask != 0, per_token * mask, torch.zeros_like(per_token))
    if mode == "token-mean":
        return masked.sum() / _safe_denominator(num_tokens, mask)
    seq_tokens = mask.sum(dim=-1)
    seq_sum = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_val = seq_sum / seq_tokens.clamp_min(1.0)
    elif mode == "seq-mean-token-sum":
        seq_val = seq_sum
    else:
        raise ValueError(f"algorithm.loss_agg_mode: unknown {mode!r}; choose one of {LOSS_AGG_MODES}")
    has_tokens = (seq_tokens > 0).to(per_token.dtype)
    num_seqs = has_tokens.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=mask.device)
    return (seq_val * has_tokens).sum() / torch.as_tensor(num_seqs, dtype=torch.float32).clamp_min(1.0)


# Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (verl's compute_policy_loss_vanilla uses
# the same bound): exp(20) ~ 4.9e8 keeps ratio, loss and gradient finite in fp32 (exp overflows past ~88.7), and a
# token that far off-policy gets no gradient from its unclipped branch (torch.clamp's gradient is 0 outside).
LOG_RATIO_CLAMP = 20.0


def _fp32(x: float) -> float:
    """x rounded once to the nearest fp32 value (exact in fp32 and fp64, so every backend compares the same number)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class ClipBounds:
    """The clip constants of one loss call, each rounded once to fp32, shared by the reference, Triton and CUDA.

    Branch decisions compare the fp32 log-ratio with log(1 - eps_low), log(1 + eps_high) and log(c), never the
    ratio with 1 +- eps: exp differs in its last bit between torch, the Triton interpreter and sm_90's ex2.approx,
    so a ratio-side comparison could pick different branches in different backends for the same input.
    """

    lo: float  # 1 - eps_low: the loss value -A * lo where the low clip is active
    hi: float  # 1 + eps_high
    log_lo: float  # log(1 - eps_low), formed in float64
    log_hi: float  # log(1 + eps_high)
    clip_c: float | None  # dual-clip constant c > 1, or None
    log_c: float  # log(c), 0.0 when clip_ratio_c is None (unused then)

    @classmethod
    def make(cls, eps_low: float, eps_high: float, clip_ratio_c: float | None) -> ClipBounds:
        if not 0.0 <= eps_low < 1.0 or not eps_high >= 0.0:
            raise ValueError(f"policy loss: need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
        if clip_ratio_c is not None and not clip_ratio_c > 1.0:
            raise ValueError(f"policy loss: clip_ratio_c must be > 1, got {clip_ratio_c}")
        log_c = 0.0 if clip_ratio_c is None else _fp32(math.log(clip_ratio_c))
        c = None if clip_ratio_c is None else _fp32(clip_ratio_c)
        return cls(
            lo=_fp32(1.0 - eps_low),
            hi=_fp32(1.0 + eps_high),
            log_lo=_fp32(math.log1p(-eps_low)),
            log_hi=_fp32(math.log1p(eps_high)),
            clip_c=c,
            log_c=log_c,
        )


def clipped_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate. Returns (loss [B,T], ratio [B,T], advantages [B,T], log_ratio [B,T]), fp32.

    Semantics (identical in the Triton kernel and the CUDA twin; r = logp - old_logp, bounds from `ClipBounds`):
    - A > 0 and r > log(1 + eps_high): l = -A (1 + eps_high), gradient 0 (clipped high);
    - A < 0 and r < log(1 - eps_low): l = -A (1 - eps_low), gradient 0 (clipped low);
    - A < 0 and r > log(c) with dual clip: l = -A c, gradient 0;
    - otherwise l = -A exp(clamp(r, -20, 20)), gradient -A exp(r) for |r| <= 20 and 0 beyond.
    This is max(-A ratio, -A clip(ratio)) (and min(., -A c) for A < 0) with the decision taken on the log-ratio and
    ties (r exactly on a bound) kept unclipped. With `mask`, invalid tokens get log-ratio 0 so garbage there
    (padding, overflow) cannot leak NaN into the gradient; their loss is then dropped by the aggregation."""
    b = ClipBounds.make(eps_low, eps_high, clip_ratio_c)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logp).to(torch.float32)
    log_ratio = logp.float() - old_logp.float()
    if mask is not None:
        log_ratio = torch.where(mask != 0, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss = -advantages * ratio
    loss = torch.where((advantages > 0) & (log_ratio > b.log_hi), -advantages * b.hi, loss)
    loss = torch.where((advantages < 0) & (log_ratio < b.log_lo), -advantages * b.lo, loss)
    if b.clip_c is not None:
        loss = torch.where((advantages < 0) & (log_ratio > b.log_c), -advantages * b.clip_c, loss)
    return loss, ratio, advantages, log_ratio


@register_policy_loss("dapo")
def dapo_policy_loss(
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
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's clipped surrogate with Clip-Higher and token-level aggregation.

    ratio = exp(logp - old_logp); per token l = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)); with
    `clip_ratio_c` (dual clip, c > 1) tokens with A < 0 use min(l, -A * c). loss = sum(l * mask) / D with
    D = `num_tokens` (global valid-token count of the mini-batch, see `agg_loss`) or mask.sum(); D == 0 gives 0.
    Branches are chosen on the log-ratio (see `clipped_token_loss`): a ratio exactly on a bound keeps the unclipped
    gradient, and log-ratios are clamped to +-LOG_RATIO_CLAMP before exp, so the loss and its gradient stay finite
    for any finite inputs (verl clamps the same way). `loss_agg_mode` (config algorithm.loss_agg_mode) swaps the
    token-level mean for GRPO's sequence mean in ablations; `num_tokens` is then the global number of sequences
    (see `agg_loss`). `weights` (rollout correction, algorithm/rollout_correction.py) multiply each token's loss
    before the aggregation, l -> w * l, leaving D and the metrics' token counts as they are; None changes nothing.

    Args:
        logp: [B, T] float, current policy log-probs of the response tokens (differentiable).
        old_logp: [B, T] float, log-probs of the policy that generated the data (no gradient).
        advantages: [B] or [B, T] float.
        mask: [B, T] bool/float, 1 for valid (trained) response tokens.
        weights: [B, T] float or None, per-token importance weights (no gradient; > 0 where mask is non-zero).
    Returns:
        loss: 0-dim fp32. metrics: 0-dim fp32 tensors clipfrac_high, clipfrac_low, approx_kl, ratio_max.
    """
    token_loss, ratio, adv, log_ratio = clipped_token_loss(
        logp, old_logp.detach(), advantages, eps_low, eps_high, clip_ratio_c, mask
    )
    if weights is not None:
        # where(): a weight off the mask (padding) never reaches the loss or, as 0 * nan, the gradient.
        w = weights.detach().to(torch.float32)
        token_loss = token_loss * torch.where(mask != 0, w, torch.zeros_like(w))
    loss = agg_loss(token_loss, mask, loss_agg_mode, num_tokens)
    with torch.no_grad():
        metrics = policy_metrics(ratio, log_ratio, adv, mask, ClipBounds.make(eps_low, eps_high, clip_ratio_c))
    return loss, metrics


@register_policy_loss("dapo", fused=True)
def dapo_policy_loss_fused(
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
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`dapo_policy_loss` through the fused kernel `ops.clipped_pg_loss` (Triton / CUDA twin on GPU, the Triton
    interpreter under TRITON_INTERPRET=1, this module's reference otherwise). Same arguments and results."""
    from megatron_dapo.ops.pg_loss import clipped_pg_loss  # noqa: PLC0415  (Triton imported only when used)

    return clipped_pg_loss(
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


def policy_metrics(
    ratio: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, bounds: ClipBounds
) -> dict[str, Tensor]:
    """Clip fractions, approximate KL and max ratio over the valid tokens of this call ([B, T] fp32 inputs).

    Clip fractions use the same log-ratio decisions as the loss; approx_kl is the mean of old_logp - logp
    (= -log_ratio); ratio_max is the largest clamped ratio (at most exp(LOG_RATIO_CLAMP))."""
    valid = mask.bool()
    count = valid.to(torch.float32).sum().clamp_min(1.0)
    high = ((adv > 0) & (log_ratio > bounds.log_hi) & valid).to(torch.float32).sum() / count
    low = ((adv < 0) & (log_ratio < bounds.log_lo) & valid).to(torch.float32).sum() / count
    approx_kl = torch.where(valid, -log_ratio, torch.zeros_like(log_ratio)).sum() / count
    ratio_max = (
        torch.where(valid, ratio.detach(), torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(())
    )
    return {"clipfrac_high": high, "clipfrac_low": low, "approx_kl": approx_kl, "ratio_max": ratio_max.float()}
