"""DAPO's policy loss (decoupled clip, optional dual clip) and loss aggregation modes.

The fused twin is `megatron_dapo.ops.clipped_pg_loss`; this file is its reference semantics.
"""

from __future__ import annotations

from collections.abc import Callable
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
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under `name` (config field `algorithm.policy_loss`)."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"algorithm.policy_loss: unknown {name!r}; choose one of {sorted(POLICY_LOSSES)}")
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


def clipped_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate. Returns (loss [B,T], ratio [B,T], advantages broadcast to [B,T]).

    With `mask`, invalid tokens get ratio 1 (log-ratio 0) so garbage there (padding, overflow) cannot leak NaN into
    the gradient; their loss is then dropped by the aggregation."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.expand_as(logp).to(torch.float32)
    log_ratio = logp.float() - old_logp.float()
    if mask is not None:
        log_ratio = torch.where(mask != 0, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:
        # Dual clip: cap the loss of A < 0 tokens at -A*c. At exactly -A*c the unclipped gradient is kept (a plain
        # minimum would halve it at the tie); the fused kernel uses the same convention.
        cap = -advantages * clip_ratio_c
        loss = torch.where((advantages < 0) & (loss > cap), cap, loss)
    return loss, ratio, advantages


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's clipped surrogate with Clip-Higher and token-level aggregation.

    ratio = exp(logp - old_logp); per token l = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)); with
    `clip_ratio_c` (dual clip, c > 1) tokens with A < 0 use min(l, -A * c). loss = sum(l * mask) / D with
    D = `num_tokens` (global valid-token count of the mini-batch, see `agg_loss`) or mask.sum(); D == 0 gives 0.
    At a ratio exactly on a clip bound both branches are equal and torch.clamp passes the gradient through.
    `loss_agg_mode` (config algorithm.loss_agg_mode) swaps the token-level mean for GRPO's sequence mean in ablations;
    `num_tokens` is then the global number of sequences (see `agg_loss`).

    Args:
        logp: [B, T] float, current policy log-probs of the response tokens (differentiable).
        old_logp: [B, T] float, log-probs of the policy that generated the data (no gradient).
        advantages: [B] or [B, T] float.
        mask: [B, T] bool/float, 1 for valid (trained) response tokens.
    Returns:
        loss: 0-dim fp32. metrics: 0-dim fp32 tensors clipfrac_high, clipfrac_low, approx_kl, ratio_max.
    """
    token_loss, ratio, adv = clipped_token_loss(
        logp, old_logp.detach(), advantages, eps_low, eps_high, clip_ratio_c, mask
    )
    loss = agg_loss(token_loss, mask, loss_agg_mode, num_tokens)
    with torch.no_grad():
        metrics = policy_metrics(ratio, adv, logp, old_logp, mask, eps_low, eps_high)
    return loss, metrics


def policy_metrics(
    ratio: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """Clip fractions, approximate KL and max ratio over the valid tokens of this call ([B, T] inputs)."""
    valid = mask.bool()
    m = valid.to(torch.float32)
    count = m.sum().clamp_min(1.0)
    high = ((adv > 0) & (ratio > 1.0 + eps_high) & valid).to(torch.float32).sum() / count
    low = ((adv < 0) & (ratio < 1.0 - eps_low) & valid).to(torch.float32).sum() / count
    diff = old_logp.float() - logp.detach().float()
    approx_kl = torch.where(valid, diff * m, torch.zeros_like(diff)).sum() / count
    ratio_max = (
        torch.where(valid, ratio.detach(), torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(())
    )
    return {"clipfrac_high": high, "clipfrac_low": low, "approx_kl": approx_kl, "ratio_max": ratio_max.float()}
