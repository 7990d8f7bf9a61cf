"""Dr. GRPO ("Understanding R1-Zero-Like Training", arXiv 2503.20783): GRPO without its two biases. Advantages are
R - mean (no division by the group's std) and each response's token sum is divided by a constant, the generation
cap, instead of its own length; the mean over responses stays."""

from megatron_dapo.algorithms.loss_configs import DrGRPOConfig
from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@register_policy_loss("dr_grpo", DrGRPOConfig)
def dr_grpo_loss(inputs: LossInputs, cfg: DrGRPOConfig, fused: bool | str):
    if cfg.norm_length <= 0:
        raise ValueError("dr_grpo: norm_length is unresolved (0); build the config with RunConfig or set it")
    spec = Surrogate("clip", ClipBounds.make(cfg.eps, cfg.eps, None), cfg.loss_agg_mode, cfg.norm_length)
    return run_surrogate(inputs, spec, fused)
