"""DAPO (arXiv 2503.14476): the clipped surrogate with Clip-Higher, token-level aggregation."""

from megatron_dapo.algorithms.loss_configs import DAPOConfig
from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@register_policy_loss("dapo", DAPOConfig)
def dapo_loss(inputs: LossInputs, cfg: DAPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps_low, cfg.effective_eps_high, cfg.clip_ratio_c)
    return run_surrogate(inputs, Surrogate("clip", bounds, cfg.loss_agg_mode), fused)
