"""CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance-sampling weight, not the update. Per token
l = -sg(min(r, 1 + eps_high_is)) A logp (and max(., 1 - eps_low_is) when a lower bound is set; the paper sets
none), aggregated over all valid tokens of the batch: no token loses its gradient to the clip."""

from dataclasses import dataclass

from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@dataclass(frozen=True)
class CISPOConfig(PolicyLossConfig):
    """CISPO's IS-weight cap."""

    eps_high_is: float = 0.28
    """The IS weight is capped at 1 + eps_high_is (the paper tunes only this bound; 0.28 caps it where DAPO clips)."""
    eps_low_is: float | None = None
    """Optional floor 1 - eps_low_is of the IS weight; None (the paper's choice): no floor."""
    loss_agg_mode: str = "token-mean"
    """The paper's token-level sum / count; the sequence means for ablations."""

    AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

    def check(self) -> None:
        PolicyLossConfig.check(self)
        if not 0 < self.eps_high_is <= 100:
            raise ValueError(f"eps_high_is: must be in (0, 100], got {self.eps_high_is}")
        if self.eps_low_is is not None and not 0 < self.eps_low_is < 1:
            raise ValueError(f"eps_low_is: must be in (0, 1) or null, got {self.eps_low_is}")


@register_policy_loss("cispo", CISPOConfig)
def cispo_loss(inputs: LossInputs, cfg: CISPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps_low_is, cfg.eps_high_is, None)
    return run_surrogate(inputs, Surrogate("cispo", bounds, cfg.loss_agg_mode), fused)
