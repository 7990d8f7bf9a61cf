"""DAPO's algorithm core in pure torch: no megatron import, no process-group globals."""

from megatron_dapo.algorithms import losses  # registers the losses in algorithms/losses/
from megatron_dapo.algorithms.advantages import group_normalized_advantages
from megatron_dapo.algorithms.dynamic_sampling import DynamicSampler
from megatron_dapo.algorithms.dynamic_sampling import DynamicSamplingError
from megatron_dapo.algorithms.dynamic_sampling import Group
from megatron_dapo.algorithms.dynamic_sampling import StepSampling
from megatron_dapo.algorithms.dynamic_sampling import group_is_informative
from megatron_dapo.algorithms.overlong import overlong_filter_mask
from megatron_dapo.algorithms.overlong import soft_overlong_penalty
from megatron_dapo.algorithms.policy_loss import LOSS_AGG_MODES
from megatron_dapo.algorithms.policy_loss import POLICY_LOSSES
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import PolicyLossConfig
from megatron_dapo.algorithms.policy_loss import agg_loss
from megatron_dapo.algorithms.policy_loss import dapo_policy_loss
from megatron_dapo.algorithms.policy_loss import get_policy_loss
from megatron_dapo.algorithms.policy_loss import loss_name
from megatron_dapo.algorithms.policy_loss import register_policy_loss

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "DynamicSampler",
    "LossInputs",
    "PolicyLossConfig",
    "DynamicSamplingError",
    "Group",
    "StepSampling",
    "agg_loss",
    "dapo_policy_loss",
    "get_policy_loss",
    "group_is_informative",
    "group_normalized_advantages",
    "loss_name",
    "losses",
    "overlong_filter_mask",
    "register_policy_loss",
    "soft_overlong_penalty",
]
