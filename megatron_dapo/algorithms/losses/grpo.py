"""GRPO (DeepSeekMath, arXiv 2402.03300) as verl and TRL ship it: symmetric PPO clip, each response's token mean
averaged over responses, std-normalised group advantages, no KL term by default."""

from dataclasses import dataclass

from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import Surrogate
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
    """Weight of the k3 KL estimate to a frozen reference model. 0 (the default, as in DAPO and Dr. GRPO): no term."""

    AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps: must be in (0, 1), got {self.eps}")
        if self.clip_ratio_c is not None and not 1 < self.clip_ratio_c <= 100:
            raise ValueError(f"clip_ratio_c: must be in (1, 100] (or null), got {self.clip_ratio_c}")
        if self.kl_coef != 0.0:
            # Not faked: the actor holds no reference model yet (a second frozen Megatron model, issue 21 item 1).
            raise ValueError(
                f"kl_coef: {self.kl_coef} needs a frozen reference model, which the actor does not build yet; use 0"
            )


@register_policy_loss("grpo", GRPOConfig)
def grpo_loss(inputs: LossInputs, cfg: GRPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps, cfg.eps, cfg.clip_ratio_c)
    return run_surrogate(inputs, Surrogate("clip", bounds, cfg.loss_agg_mode), fused)
