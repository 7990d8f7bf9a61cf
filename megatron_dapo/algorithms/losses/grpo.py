"""GRPO (DeepSeekMath, arXiv 2402.03300) as verl and TRL ship it: symmetric PPO clip, each response's token mean
averaged over responses, std-normalised group advantages, no KL term by default (loss.kl_coef > 0: the k3 KL to a
frozen reference model)."""

from dataclasses import dataclass

from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import add_kl_term
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@dataclass(frozen=True)
class GRPOConfig(PolicyLossConfig):
    """GRPO's clipped surrogate."""

    eps: float = 0.2
    """Symmetric clip range: the ratio is clipped to [1 - eps, 1 + eps]."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None disables it."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """GRPO's per-response token mean averaged over responses; "token-mean" / "seq-mean-token-sum" for ablations."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to a frozen reference model (`policy_loss.kl_k3`, aggregated as the policy term;
    DeepSeekMath used 0.04). 0, the default as in DAPO and Dr. GRPO: no term and no reference model. > 0: the trainer
    builds the reference, a second frozen Megatron model of actor.model_path (docs/memory.md, "Reference model")."""

    AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps: must be in (0, 1), got {self.eps}")
        if self.clip_ratio_c is not None and not 1 < self.clip_ratio_c <= 100:
            raise ValueError(f"clip_ratio_c: must be in (1, 100] (or null), got {self.clip_ratio_c}")
        if not 0.0 <= self.kl_coef <= 10.0:
            raise ValueError(f"kl_coef: must be in [0, 10], got {self.kl_coef}")


@register_policy_loss("grpo", GRPOConfig)
def grpo_loss(inputs: LossInputs, cfg: GRPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps, cfg.eps, cfg.clip_ratio_c)
    loss, metrics = run_surrogate(inputs, Surrogate("clip", bounds, cfg.loss_agg_mode), fused)
    if cfg.kl_coef > 0.0:
        loss, metrics = add_kl_term(loss, metrics, inputs, cfg.kl_coef, cfg.loss_agg_mode, None)
    return loss, metrics
