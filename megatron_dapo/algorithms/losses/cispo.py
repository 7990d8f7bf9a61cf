"""CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance-sampling weight, not the update. Per token
l = -sg(min(r, 1 + eps_high_is)) A logp (and max(., 1 - eps_low_is) when a lower bound is set; the paper sets
none), aggregated over all valid tokens of the batch: no token loses its gradient to the clip."""

from megatron_dapo.algorithms.loss_configs import CISPOConfig
from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@register_policy_loss("cispo", CISPOConfig)
def cispo_loss(inputs: LossInputs, cfg: CISPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps_low_is, cfg.eps_high_is, None)
    return run_surrogate(inputs, Surrogate("cispo", bounds, cfg.loss_agg_mode), fused)
