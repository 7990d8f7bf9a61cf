"""The names the run config's choice fields accept for the components that import torch, declared without importing
them, so that reading and checking a run config (`import megatron_dapo`, `megatron-dapo check | plan | status`) never
imports torch. Each component takes its names from here and registers its implementations under them; a name a
user registers later (a custom log-prob implementation) is added to the field's choices then. The other choice
fields are declared by their own torch-free modules: actor.offload by memory.py, algorithm.policy_loss (with each
loss's config) by algorithms/loss_configs.py.
"""

from __future__ import annotations

from megatron_dapo.config import register_choices
from megatron_dapo.envs.base import BUILT_IN as ENVIRONMENTS
from megatron_dapo.trackers import TRACKERS

LOGPROB_IMPLS = ("reference", "fused", "fused_cuda", "fused_linear")
"""actor.logprob_impl: the implementations of actor/loss.py (`register_logprob_impl`)."""
LOSS_KERNELS = ("auto", "reference", "triton", "cuda")
"""actor.loss_kernel values: "auto" follows actor.logprob_impl (its LogprobImpl.kernel); the others choose."""
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
"""algorithm.rollout_correction (algorithms/rollout_correction.py)."""
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
"""algorithm.rollout_correction_level."""

register_choices("actor.logprob_impl", *LOGPROB_IMPLS)
register_choices("actor.loss_kernel", *LOSS_KERNELS)
register_choices("algorithm.rollout_correction", *ROLLOUT_CORRECTIONS)
register_choices("algorithm.rollout_correction_level", *ROLLOUT_CORRECTION_LEVELS)
register_choices("logging.tracker", *TRACKERS)
for _name, (_module, _multi_turn) in ENVIRONMENTS.items():  # reward.environment; payload: the stream drives its turns
    register_choices("reward.environment", _name, payload=_multi_turn)
