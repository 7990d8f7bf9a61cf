"""The policy-loss core: loss aggregation, clip bounds, the per-token surrogates and the loss registry.

Every policy loss (algorithms/losses/<name>.py: its config dataclass and one function) is one of three per-token
surrogates, aggregated one of four ways:

    surrogate "clip"  (dapo, grpo, dr_grpo): max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), optional dual clip
    surrogate "gspo"  (gspo): the same clip on the sequence ratio s_i = exp(mean_t(logp - old_logp)); gradient
                      d/dlogp_t = -A s_i (unclipped), so seq-mean-token-mean gives GSPO's -A s_i / |y_i| per token
    surrogate "cispo" (cispo): -sg(clip(r, lo, hi)) A logp: every token keeps a gradient, its IS weight is capped
    aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (`agg_loss`)

`surrogate_loss` is the reference (CPU fallback and oracle of the fused kernel `ops.pg_loss.fused_surrogate_loss`,
which runs the same `Surrogate` spec); `dapo_policy_loss` is its DAPO spelling with keyword clip constants.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.algorithms.loss_configs import LOSS_AGG_MODES
from megatron_dapo.algorithms.loss_configs import PolicyLossConfig
from megatron_dapo.algorithms.loss_configs import make_loss_config
from megatron_dapo.algorithms.loss_configs import register_loss_config
from megatron_dapo.registry import Registry

SURROGATES = ("clip", "gspo", "cispo")


@dataclass(frozen=True)
class LossInputs:
    """One call's tensors (the padded [B, T] layout of megatron_dapo.batch; position t is token t).

    logp: [B, T] float, current log-probs (the only differentiable input). old_logp: [B, T] float, behaviour-policy
    log-probs. advantages: [B] or [B, T] float. mask: [B, T] bool/float, 1 on trained tokens. num_tokens: the
    global denominator D (valid tokens for token-mean, sequences for the seq-mean modes; see `agg_loss`) as a float
    or 0-dim tensor, None for this call's own. weights: [B, T] float per-token importance weights (rollout
    correction) multiplying each token's loss, or None. ref_logp: [B, T] float, a frozen reference model's log-probs
    (losses with a KL term: `uses_reference`), or None.
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    num_tokens: float | Tensor | None = None
    weights: Tensor | None = None
    ref_logp: Tensor | None = None


PolicyLossFn = Callable[[LossInputs, Any, "bool | str"], tuple[Tensor, dict[str, Tensor]]]
"""fn(inputs, config, fused) -> (loss 0-dim fp32, metrics {clipfrac_high, clipfrac_low, approx_kl, ratio_max});
fused True (or a kernel backend, "triton" / "cuda") runs the fused kernel path (the reference on CPU without the
Triton interpreter)."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: its `algorithm.policy_loss` name, config class and function."""

    name: str
    config_cls: type[PolicyLossConfig]
    fn: PolicyLossFn

    def __call__(self, inputs: LossInputs, config: PolicyLossConfig, fused: bool | str = False):
        return self.fn(inputs, config, fused)

    def make_config(self, values: dict[str, Any] | None = None) -> PolicyLossConfig:
        """The config from {field: value} (loss_configs.make_loss_config)."""
        return make_loss_config(self.name, values)


POLICY_LOSSES: Registry[PolicyLoss] = Registry("algorithm.policy_loss", "policy loss")


def register_policy_loss(name: str, config_cls: type[PolicyLossConfig]) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register `fn` as policy loss `name` (config `algorithm.policy_loss`) with its config class."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        register_loss_config(name, config_cls)  # declared already for the built-in losses (loss_configs.py)
        POLICY_LOSSES.add(name, PolicyLoss(name, config_cls, fn))
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as `name` (the losses in algorithms/losses/ register on import of the package)."""
    return POLICY_LOSSES.lookup(name)


def loss_name(config: PolicyLossConfig) -> str:
    """The registered name of a loss config's loss."""
    for name, entry in POLICY_LOSSES.items():
        if type(config) is entry.config_cls:
            return name
    raise ValueError(f"{type(config).__name__} is not the config of a registered policy loss")


def _safe_denominator(num_tokens: float | Tensor | None, mask: Tensor) -> Tensor:
    denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device)
    # An empty batch contributes zero loss and zero gradient instead of NaN.
    return denom.to(torch.float32).clamp_min(1.0)


def agg_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    norm_length: float | None = None,
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

    "seq-mean-token-sum": mean over sequences of each sequence's token sum (no length normalisation).

    "seq-mean-token-sum-norm" (Dr. GRPO): mean over sequences of each sequence's token sum divided by the constant
    `norm_length` (the generation cap), so no response's tokens weigh more for being in a short response.

    Args:
        per_token: [B, T] float.
        mask: [B, T] bool or float (1 = valid response token).
        norm_length: the constant of "seq-mean-token-sum-norm" (> 0), unused otherwise.
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
    elif mode == "seq-mean-token-sum-norm":
        if norm_length is None or not norm_length > 0:
            raise ValueError(f"agg_loss: seq-mean-token-sum-norm needs norm_length > 0, got {norm_length}")
        seq_val = seq_sum / float(norm_length)
    else:
        raise ValueError(f"loss.loss_agg_mode: unknown {mode!r}; choose one of {LOSS_AGG_MODES}")
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
    def make(cls, eps_low: float | None, eps_high: float, clip_ratio_c: float | None) -> ClipBounds:
        """Bounds of 1 - eps_low and 1 + eps_high; eps_low None means no lower bound (CISPO's default): lo = 0 and
        log_lo = -inf, so no log-ratio is below it."""
        if eps_low is None:
            if not eps_high >= 0.0:
                raise ValueError(f"policy loss: need eps_high >= 0, got {eps_high}")
            log_c = 0.0 if clip_ratio_c is None else _fp32(math.log(clip_ratio_c))
            c = None if clip_ratio_c is None else _fp32(clip_ratio_c)
            return cls(lo=0.0, hi=_fp32(1.0 + eps_high), log_lo=-math.inf, log_hi=_fp32(math.log1p(eps_high)),
                       clip_c=c, log_c=log_c)  # fmt: skip
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
    bounds: ClipBounds,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate. Returns (loss [B,T], ratio [B,T], advantages [B,T], log_ratio [B,T]), fp32.

    Semantics (identical in the Triton kernel and the CUDA twin; r = logp - old_logp, bounds from `ClipBounds`):
    - A > 0 and r > log(1 + eps_high): l = -A (1 + eps_high), gradient 0 (clipped high);
    - A < 0 and r < log(1 - eps_low): l = -A (1 - eps_low), gradient 0 (clipped low);
    - A < 0 and r > log(c) with dual clip: l = -A c, gradient 0;
    - otherwise l = -A exp(clamp(r, -20, 20)), gradient -A exp(r) for |r| <= 20 and 0 beyond.
    This is max(-A ratio, -A clip(ratio)) (and min(., -A c) for A < 0) with the decision taken on the log-ratio and
    ties (r exactly on a bound) kept unclipped. With `mask`,
    invalid tokens get log-ratio 0 so garbage there (padding, overflow) cannot leak NaN into the gradient; their loss
    is then dropped by the aggregation."""
    b = bounds
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


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Mean log-ratio of each row over its valid tokens: [B, T] fp32 (0 off the mask) -> [B] fp32 (0 for a row with
    no valid token). GSPO's log s_i = (1 / |y_i|) sum_t (logp - old_logp)."""
    valid = mask != 0
    total = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1)
    return total / valid.to(torch.float32).sum(dim=-1).clamp_min(1.0)


@dataclass(frozen=True)
class Surrogate:
    """What one policy-loss call computes, shared by the reference and the fused kernel.

    kind: one of SURROGATES. bounds: the clip constants (for "cispo" the IS-weight cap; lower bound optional).
    agg: the aggregation (LOSS_AGG_MODES). norm_length: the constant of "seq-mean-token-sum-norm", else None.
    """

    kind: str
    bounds: ClipBounds
    agg: str = "token-mean"
    norm_length: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SURROGATES:
            raise ValueError(f"policy loss: unknown surrogate {self.kind!r}; choose one of {SURROGATES}")
        if self.agg not in LOSS_AGG_MODES:
            raise ValueError(f"loss.loss_agg_mode: unknown {self.agg!r}; choose one of {LOSS_AGG_MODES}")
        if self.kind != "clip" and self.bounds.clip_c is not None:
            raise ValueError(
                f"policy loss: the dual clip (clip_ratio_c) applies to the clip surrogate, not {self.kind}"
            )


def surrogate_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, spec: Surrogate
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token loss of `spec.kind` (reference semantics of the fused kernel). Returns (loss, ratio, advantages,
    decision log-ratio), each [B, T] fp32; the decision log-ratio is the token's for "clip" / "cispo" and its
    sequence's mean for "gspo" (what the clip bounds are compared with, see `policy_metrics`).

    "clip": `clipped_token_loss`. "gspo": the same, with the token's log-ratio replaced by
    logp - sg(logp) + sg(mean over the row's valid tokens of logp - old_logp) (value: the sequence's log-ratio,
    gradient 1 w.r.t. logp_t), so the whole sequence is clipped or not and an unclipped token's gradient is -A s_i.
    "cispo": l = -sg(w) A logp with w = exp(clamp(r, -20, 20)) capped at `bounds.hi` (and floored at `bounds.lo`
    when there is a lower bound), decisions on the log-ratio as everywhere; the gradient -w A never vanishes.
    """
    b = spec.bounds
    if spec.kind == "clip":
        return clipped_token_loss(logp, old_logp, advantages, b, mask)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    adv = advantages.expand_as(logp).to(torch.float32)
    valid = mask != 0
    token_lr = torch.where(valid, logp.float() - old_logp.float(), torch.zeros_like(logp, dtype=torch.float32))
    if spec.kind == "gspo":
        seq_lr = sequence_log_ratio(token_lr.detach(), mask)
        lp = logp.float()
        seq_token_lr = torch.where(valid, lp - lp.detach() + seq_lr.unsqueeze(-1), torch.zeros_like(lp))
        loss, ratio, adv, _ = clipped_token_loss(seq_token_lr, torch.zeros_like(seq_token_lr), adv, b, mask)
        return loss, ratio, adv, seq_token_lr.detach()
    ratio = torch.exp(token_lr.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    w = torch.where(token_lr > b.log_hi, torch.full_like(ratio, b.hi), ratio)
    w = torch.where(token_lr < b.log_lo, torch.full_like(ratio, b.lo), w)
    lp = torch.where(valid, logp.float(), torch.zeros_like(logp, dtype=torch.float32))
    return -adv * w * lp, ratio, adv, token_lr.detach()


def surrogate_loss(inputs: LossInputs, spec: Surrogate) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference policy loss: per-token `surrogate_token_loss`, times `inputs.weights` when given (where mask
    is non-zero; D and the metrics' token counts unchanged), aggregated by `agg_loss(spec.agg)`.

    Returns:
        loss: 0-dim fp32. metrics: 0-dim fp32 clipfrac_high, clipfrac_low, approx_kl, ratio_max (`policy_metrics`).
    """
    mask = inputs.mask
    token_loss, ratio, adv, log_ratio = surrogate_token_loss(
        inputs.logp, inputs.old_logp.detach(), inputs.advantages, mask, spec
    )
    if inputs.weights is not None:
        # where(): a weight off the mask (padding) never reaches the loss or, as 0 * nan, the gradient.
        w = inputs.weights.detach().to(torch.float32)
        token_loss = token_loss * torch.where(mask != 0, w, torch.zeros_like(w))
    loss = agg_loss(token_loss, mask, spec.agg, inputs.num_tokens, spec.norm_length)
    with torch.no_grad():
        token_lr = torch.where(mask != 0, inputs.logp.float() - inputs.old_logp.float(), torch.zeros_like(ratio))
        metrics = policy_metrics(ratio, log_ratio, adv, mask, spec, token_lr)
    return loss, metrics


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(pi || pi_ref) per token, r - log r - 1 with r = pi_ref / pi = exp(ref_logp - logp):
    unbiased, always >= 0, low variance (the estimator of DeepSeekMath's GRPO objective). logp, ref_logp: [B, T]
    float -> [B, T] fp32; differentiable in logp only (ref_logp is detached). Not clamped."""
    d = ref_logp.detach().float() - logp.float()
    return torch.exp(d) - d - 1.0


def add_kl_term(
    loss: Tensor, metrics: dict[str, Tensor], inputs: LossInputs, coef: float, agg: str, norm_length: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss + coef * agg_loss(kl_k3(logp, ref_logp)) with the policy term's aggregation and denominator D (no
    importance weight: the KL is to the reference, not to the behaviour policy); metrics gain "ref_kl", the token
    mean of k3 over the mask (0-dim fp32)."""
    if inputs.ref_logp is None:
        raise ValueError("kl_coef > 0: LossInputs.ref_logp (the reference model's log-probs) is None")
    mask = inputs.mask
    kl = torch.where(mask != 0, kl_k3(inputs.logp, inputs.ref_logp), torch.zeros_like(inputs.logp, dtype=torch.float32))
    loss = loss + coef * agg_loss(kl, mask, agg, inputs.num_tokens, norm_length)
    with torch.no_grad():
        metrics = {**metrics, "ref_kl": (kl.sum() / mask.float().sum().clamp_min(1.0)).float()}
    return loss, metrics


LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""`loss_fn(inputs: LossInputs, spec: Surrogate, **extra) -> (loss, metrics)`: `surrogate_loss` or its fused twin."""


def clip_loss_entry(loss_fn: LossFn, name: str, doc: str) -> LossFn:
    """The DAPO keyword entry point over `loss_fn` (the "clip" kind): `dapo_policy_loss` over `surrogate_loss`, and
    `ops.clipped_pg_loss` over the fused kernel, so the two share one signature by construction. Keywords beyond the
    DAPO ones (`backend=` of the fused loss) go to `loss_fn`."""

    def entry(
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
        **extra: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        spec = Surrogate("clip", ClipBounds.make(eps_low, eps_high, clip_ratio_c), loss_agg_mode)
        return loss_fn(LossInputs(logp, old_logp, advantages, mask, num_tokens, weights), spec, **extra)

    entry.__name__ = entry.__qualname__ = name
    entry.__module__ = loss_fn.__module__
    entry.__doc__ = doc
    return entry


dapo_policy_loss = clip_loss_entry(
    surrogate_loss,
    "dapo_policy_loss",
    """DAPO's clipped surrogate with Clip-Higher and token-level aggregation (`surrogate_loss` of the "clip" kind).

    ratio = exp(logp - old_logp); per token l = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)); with
    `clip_ratio_c` (dual clip, c > 1) tokens with A < 0 use min(l, -A * c). loss = sum(l * mask) / D with
    D = `num_tokens` (global valid-token count of the mini-batch, see `agg_loss`) or mask.sum(); D == 0 gives 0.
    Branches are chosen on the log-ratio (see `clipped_token_loss`): a ratio exactly on a bound keeps the unclipped
    gradient, and log-ratios are clamped to +-LOG_RATIO_CLAMP before exp, so the loss and its gradient stay finite
    for any finite inputs (verl clamps the same way). `loss_agg_mode` swaps the token-level mean for GRPO's sequence
    mean; `num_tokens` is then the global number of sequences (see `agg_loss`). `weights` (rollout correction,
    algorithm/rollout_correction.py) multiply each token's loss before the aggregation, l -> w * l, leaving D and the
    metrics' token counts as they are; None changes nothing.

    Args:
        logp: [B, T] float, current policy log-probs of the response tokens (differentiable).
        old_logp: [B, T] float, log-probs of the policy that generated the data (no gradient).
        advantages: [B] or [B, T] float.
        mask: [B, T] bool/float, 1 for valid (trained) response tokens.
        weights: [B, T] float or None, per-token importance weights (no gradient; > 0 where mask is non-zero).
    Returns:
        loss: 0-dim fp32. metrics: 0-dim fp32 tensors clipfrac_high, clipfrac_low, approx_kl, ratio_max.
    """,
)


def policy_metrics(
    ratio: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, spec: Surrogate, token_log_ratio: Tensor
) -> dict[str, Tensor]:
    """Clip fractions, approximate KL and max ratio over the valid tokens of this call ([B, T] fp32 inputs).

    Clip fractions use the loss's own log-ratio decisions (the sequence's for "gspo"): for "clip" / "gspo" high =
    A > 0 above log(1 + eps_high) and low = A < 0 below log(1 - eps_low); for "cispo" the tokens whose IS weight is
    capped (above) or floored (below), whatever A. approx_kl is the mean of old_logp - logp over tokens (GSPO's
    sequence means average to the same); ratio_max is the largest clamped ratio (the sequence ratio for "gspo")."""
    bounds = spec.bounds
    valid = mask.bool()
    count = valid.to(torch.float32).sum().clamp_min(1.0)
    above = log_ratio > bounds.log_hi
    below = log_ratio < bounds.log_lo
    if spec.kind != "cispo":
        above, below = above & (adv > 0), below & (adv < 0)
    high = (above & valid).to(torch.float32).sum() / count
    low = (below & valid).to(torch.float32).sum() / count
    approx_kl = torch.where(valid, -token_log_ratio, torch.zeros_like(token_log_ratio)).sum() / count
    ratio_max = (
        torch.where(valid, ratio.detach(), torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(())
    )
    return {"clipfrac_high": high, "clipfrac_low": low, "approx_kl": approx_kl, "ratio_max": ratio_max.float()}
