"""Rollout correction: importance weights and masks for the train/inference mismatch (TIS, MIS).

The rollout engine samples with its own kernels and precision (bf16 SGLang, FP8 weights), so the distribution that
generated a response, pi_engine, is not exactly the actor's pi_old that the clipped surrogate uses as its behaviour
policy. With the per-token log-ratio delta_t = old_logp_t - engine_logp_t (the log of pi_old / pi_engine on the
sampled token):

    level "token":    ell_t = delta_t
    level "sequence": ell_t = sum over the response's valid tokens s of delta_s   (same value on every token)
    rho_t = exp(clamp(ell_t, -20, 20))

    "tis"  (truncated IS):  w_t = min(rho_t, C)                      mask unchanged
    "mis"  (masked IS):     keep_t = [log(low) <= ell_t <= log(high)]
                            w_t = rho_t * keep_t, mask_t <- mask_t * keep_t   (rejected tokens leave D)

and the per-token policy loss l_t becomes w_t * l_t, aggregated as before (docs/rollout_correction.md). These are
verl's rollout-correction definitions (rollout_corr_helper: IS weights exp(clamp(log-ratio, +-20)) truncated at the
threshold; rejection of tokens / sequences whose ratio leaves [lower, upper], removed from the response mask). Pure
torch, no megatron import: the trainer applies it to each data-parallel rank's rows (everything here is per row),
before the actor computes D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_dapo.choices import ROLLOUT_CORRECTION_LEVELS
from megatron_dapo.choices import ROLLOUT_CORRECTIONS

# Same bound as the policy loss's LOG_RATIO_CLAMP (and verl's SAFETY_BOUND): exp(20) ~ 4.9e8 stays finite in fp32.
IS_LOG_CLAMP = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """Result of `rollout_correction` on one batch.

    Attributes:
        weights: [B, S] fp32 per-token IS weights to multiply the policy loss by (0 off the returned mask), or None
            for mode "none".
        mask: [B, S] fp32 loss mask after rejection (the input mask for "none" / "tis"; the same object for "none").
        metrics: 0-dim fp32 tensors (see `rollout_correction`).
    """

    weights: Tensor | None
    mask: Tensor
    metrics: dict[str, Tensor]


def _check(old_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> None:
    if old_logp.dim() != 2 or old_logp.shape != engine_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"rollout_correction: old_logp {tuple(old_logp.shape)}, engine_logp {tuple(engine_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be the same [B, S]"
        )


def level_log_ratio(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """ell [B, S] fp32: the log importance ratio log(pi_old / pi_engine) at `level`, 0 off the mask.

    "token": old_logp - engine_logp per token; "sequence": its sum over the row's valid tokens, on every valid token.
    """
    if level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(
            f"algorithm.rollout_correction_level: unknown {level!r}; choose one of {ROLLOUT_CORRECTION_LEVELS}"
        )
    valid = mask != 0
    delta = torch.where(valid, old_logp.float() - engine_logp.float(), torch.zeros((), dtype=torch.float32))
    if level == "sequence":
        delta = torch.where(valid, delta.sum(dim=-1, keepdim=True).expand_as(delta), torch.zeros_like(delta))
    return delta


def mismatch_metrics(old_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Drift between the engine's sampling distribution and the actor's, on the sampled tokens (0-dim fp32 tensors).

    With delta = old_logp - engine_logp over valid tokens:
    - "rollout_corr/kl_k1": mean(engine_logp - old_logp), the direct estimator of KL(pi_engine || pi_old);
    - "rollout_corr/kl_k3": mean(exp(delta) - delta - 1), the k3 estimator of the same KL (>= 0 per token);
    - "rollout_corr/log_ppl_diff": mean over responses of (mean_t engine_logp - mean_t old_logp), i.e.
      log(ppl_actor / ppl_engine); "rollout_corr/log_ppl_abs_diff" the mean of its absolute value.

    Args:
        old_logp, engine_logp: [B, S] float; mask: [B, S] bool/float (valid response tokens).
    """
    _check(old_logp, engine_logp, mask)
    valid = mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=old_logp.device)
    delta = torch.where(valid, old_logp.float() - engine_logp.float(), zero)
    count = valid.float().sum().clamp_min(1.0)
    clamped = delta.clamp(-IS_LOG_CLAMP, IS_LOG_CLAMP)
    k3 = torch.where(valid, torch.exp(clamped) - clamped - 1.0, zero)
    per_row = valid.float().sum(dim=-1)
    has = per_row > 0
    row_diff = -delta.sum(dim=-1) / per_row.clamp_min(1.0)  # mean engine - mean old, per response
    num_rows = has.float().sum().clamp_min(1.0)
    return {
        "rollout_corr/kl_k1": -delta.sum() / count,
        "rollout_corr/kl_k3": k3.sum() / count,
        "rollout_corr/log_ppl_diff": torch.where(has, row_diff, zero).sum() / num_rows,
        "rollout_corr/log_ppl_abs_diff": torch.where(has, row_diff.abs(), zero).sum() / num_rows,
    }


@torch.no_grad()
def rollout_correction(
    old_logp: Tensor,
    engine_logp: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str = "token",
    is_threshold: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> RolloutCorrection:
    """IS weights and the rejection mask of one batch (definitions in the module docstring).

    Args:
        old_logp: [B, S] float, the actor's log-probs before the update (pi_old).
        engine_logp: [B, S] float, the rollout engine's sampling log-probs (pi_engine), same alignment.
        mask: [B, S] bool/float, 1 on the tokens that enter the loss (the batch's loss_mask).
        mode: "none" | "tis" | "mis" (algorithm.rollout_correction).
        level: "token" | "sequence" (algorithm.rollout_correction_level).
        is_threshold: C > 0, the truncation of "tis" (algorithm.rollout_is_threshold).
        mis_low, mis_high: 0 < low <= 1 <= high, the band "mis" keeps (algorithm.rollout_mis_low / _high).
    Returns:
        RolloutCorrection(weights [B, S] fp32 or None, mask [B, S] fp32, metrics). Metrics (0-dim fp32): those of
        `mismatch_metrics`, and for "tis" / "mis" "rollout_corr/is_weight_mean" / "is_weight_max" (of the weights
        over the tokens that stay in the loss), "rollout_corr/ratio_max" (rho before truncation / masking);
        "tis": "rollout_corr/truncated_fraction" (valid tokens with rho > C); "mis": "rollout_corr/masked_fraction"
        (valid tokens removed) and "rollout_corr/masked_seq_fraction" (responses with a removed token).
    """
    _check(old_logp, engine_logp, mask)
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"algorithm.rollout_correction: unknown {mode!r}; choose one of {ROLLOUT_CORRECTIONS}")
    metrics = mismatch_metrics(old_logp, engine_logp, mask)
    if mode == "none":
        return RolloutCorrection(weights=None, mask=mask, metrics=metrics)
    valid = mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    ell = level_log_ratio(old_logp, engine_logp, mask, level)
    rho = torch.exp(ell.clamp(-IS_LOG_CLAMP, IS_LOG_CLAMP))
    count = valid.float().sum().clamp_min(1.0)
    metrics["rollout_corr/ratio_max"] = torch.where(valid, rho, zero).amax() if rho.numel() else zero
    new_mask = mask.to(torch.float32)
    if mode == "tis":
        if not is_threshold > 0:
            raise ValueError(f"algorithm.rollout_is_threshold: must be > 0, got {is_threshold}")
        weights = torch.where(valid, rho.clamp(max=is_threshold), zero)
        metrics["rollout_corr/truncated_fraction"] = (valid & (rho > is_threshold)).float().sum() / count
    else:
        if not 0 < mis_low <= 1.0 <= mis_high:
            raise ValueError(f"algorithm.rollout_mis_low/high: need 0 < low <= 1 <= high, got {mis_low}, {mis_high}")
        # Decided on the log-ratio (as the clip branches of the policy loss): no rounding of exp at the bounds.
        keep = valid & (ell >= math.log(mis_low)) & (ell <= math.log(mis_high))
        weights = torch.where(keep, rho, zero)
        new_mask = torch.where(keep, new_mask, zero)
        metrics["rollout_corr/masked_fraction"] = (valid & ~keep).float().sum() / count
        rows = valid.any(dim=-1)
        dropped = (valid & ~keep).any(dim=-1)
        metrics["rollout_corr/masked_seq_fraction"] = dropped.float().sum() / rows.float().sum().clamp_min(1.0)
    kept = new_mask != 0
    metrics["rollout_corr/is_weight_mean"] = torch.where(kept, weights, zero).sum() / kept.float().sum().clamp_min(1.0)
    metrics["rollout_corr/is_weight_max"] = torch.where(kept, weights, zero).amax() if weights.numel() else zero
    return RolloutCorrection(weights=weights, mask=new_mask, metrics=metrics)
