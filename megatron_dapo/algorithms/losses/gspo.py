"""GSPO (Group Sequence Policy Optimization, arXiv 2507.18071): the importance ratio and its clip are per sequence,
s_i = exp(mean over the response of (logp - old_logp)); the GSPO-token gradient -A_i s_i / |y_i| per token (the
"gspo" surrogate of policy_loss.py aggregated by each response's token mean)."""

from megatron_dapo.algorithms.loss_configs import GSPOConfig
from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@register_policy_loss("gspo", GSPOConfig)
def gspo_loss(inputs: LossInputs, cfg: GSPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps_low, cfg.eps_high, None)
    return run_surrogate(inputs, Surrogate("gspo", bounds, cfg.loss_agg_mode), fused)
