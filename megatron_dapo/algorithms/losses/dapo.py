"""DAPO (arXiv 2503.14476): the clipped surrogate with Clip-Higher, token-level aggregation."""

from dataclasses import dataclass

from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@dataclass(frozen=True)
class DAPOConfig(PolicyLossConfig):
    """The paper's loss: ratio clipped to [1 - eps_low, 1 + eps_high], sum over all valid tokens / their count."""

    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip range (Clip-Higher): the ratio is clipped above at 1 + eps_high."""
    clip_higher: bool = True
    """Ablation switch: False uses eps_high = eps_low (symmetric PPO clip)."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -A*c; None disables it."""
    loss_agg_mode: str = "token-mean"
    """"token-mean" (DAPO), or "seq-mean-token-mean" / "seq-mean-token-sum" for ablations."""

    AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps_low < 1:
            raise ValueError(f"eps_low: must be in (0, 1), got {self.eps_low}")
        if not 0 < self.eps_high <= 10:
            raise ValueError(f"eps_high: must be in (0, 10], got {self.eps_high}")
        if self.eps_high < self.eps_low:
            raise ValueError(f"eps_high: must be >= eps_low {self.eps_low}, got {self.eps_high}")
        if self.clip_ratio_c is not None and not 1 < self.clip_ratio_c <= 100:
            raise ValueError(f"clip_ratio_c: must be in (1, 100] (or null), got {self.clip_ratio_c}")

    @property
    def effective_eps_high(self) -> float:
        return self.eps_high if self.clip_higher else self.eps_low


@register_policy_loss("dapo", DAPOConfig)
def dapo_loss(inputs: LossInputs, cfg: DAPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps_low, cfg.effective_eps_high, cfg.clip_ratio_c)
    return run_surrogate(inputs, Surrogate("clip", bounds, cfg.loss_agg_mode), fused)
