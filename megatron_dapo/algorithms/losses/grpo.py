"""GRPO (DeepSeekMath, arXiv 2402.03300) as verl and TRL ship it: symmetric PPO clip, each response's token mean
averaged over responses, std-normalised group advantages, no KL term by default (loss.kl_coef > 0: the k3 KL to a
frozen reference model)."""

from megatron_dapo.algorithms.loss_configs import GRPOConfig
from megatron_dapo.algorithms.losses._run import run_surrogate
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import add_kl_term
from megatron_dapo.algorithms.policy_loss import register_policy_loss


@register_policy_loss("grpo", GRPOConfig)
def grpo_loss(inputs: LossInputs, cfg: GRPOConfig, fused: bool | str):
    bounds = ClipBounds.make(cfg.eps, cfg.eps, cfg.clip_ratio_c)
    loss, metrics = run_surrogate(inputs, Surrogate("clip", bounds, cfg.loss_agg_mode), fused)
    if cfg.kl_coef > 0.0:
        loss, metrics = add_kl_term(loss, metrics, inputs, cfg.kl_coef, cfg.loss_agg_mode, None)
    return loss, metrics
