"""GSPO (Group Sequence Policy Optimization, arXiv 2507.18071): the importance ratio and its clip are per sequence,
s_i = exp(mean over the response of (logp - old_logp)); the GSPO-token gradient -A_i s_i / |y_i| per token (the
"gspo" surrogate of policy_loss.py aggregated by each response's token mean)."""

from dataclasses import dataclass
from typing import ClassVar

from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@dataclass(frozen=True)
class GSPOConfig(PolicyLossConfig):
    """GSPO's sequence-level clip; the paper's defaults (its section 5.1: 3e-4 left, 4e-4 right)."""

    eps_low: float = 3e-4
    """The sequence ratio is clipped below at 1 - eps_low."""
    eps_high: float = 4e-4
    """The sequence ratio is clipped above at 1 + eps_high."""

    # Fixed: with each response's token mean the per-token gradient -A s_i / |y_i| is the sequence objective's.
    loss_agg_mode: ClassVar[str] = "seq-mean-token-mean"

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps_low < 1:
            raise ValueError(f"eps_low: must be in (0, 1), got {self.eps_low}")
        if not 0 < self.eps_high <= 10:
            raise ValueError(f"eps_high: must be in (0, 10], got {self.eps_high}")


@register_policy_loss("gspo", GSPOConfig)
def gspo_loss(inputs: LossInputs, cfg: GSPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps_low, cfg.eps_high, None)
    return run_surrogate(inputs, Surrogate("gspo", bounds, cfg.loss_agg_mode), fused)
