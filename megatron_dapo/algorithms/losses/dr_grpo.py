"""Dr. GRPO ("Understanding R1-Zero-Like Training", arXiv 2503.20783): GRPO without its two biases. Advantages are
R - mean (no division by the group's std) and each response's token sum is divided by a constant, the generation
cap, instead of its own length; the mean over responses stays."""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@dataclass(frozen=True)
class DrGRPOConfig(PolicyLossConfig):
    """Dr. GRPO's loss: symmetric clip, seq-mean of token sums / norm_length, unnormalised advantages."""

    eps: float = 0.2
    """Symmetric clip range."""
    norm_length: int = 0
    """The constant each response's token sum is divided by; 0: rollout.max_response_length (the paper's choice,
    resolved when the run config is built)."""
    std_normalize: bool = False
    """Dr. GRPO drops the std normalisation; True restores GRPO's advantages (ablation)."""

    loss_agg_mode: ClassVar[str] = "seq-mean-token-sum-norm"

    def resolve(self, *, max_response_length: int) -> "DrGRPOConfig":
        return dataclasses.replace(self, norm_length=max_response_length) if self.norm_length == 0 else self

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps: must be in (0, 1), got {self.eps}")
        if not 0 <= self.norm_length <= 2**20:
            raise ValueError(f"norm_length: must be in [0, {2**20}] (0: rollout.max_response_length)")


@register_policy_loss("dr_grpo", DrGRPOConfig)
def dr_grpo_loss(inputs: LossInputs, cfg: DrGRPOConfig, fused: bool | str):
    if cfg.norm_length <= 0:
        raise ValueError("dr_grpo: norm_length is unresolved (0); build the config with RunConfig or set it")
    spec = Surrogate("clip", ClipBounds.make(cfg.eps, cfg.eps, None), cfg.loss_agg_mode, cfg.norm_length)
    return run_surrogate(inputs, spec, fused)
