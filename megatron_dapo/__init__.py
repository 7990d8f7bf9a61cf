"""megatron_dapo: DAPO (arXiv 2503.14476) on Megatron-Core. See docs/architecture.md."""

# The components that register the names their config fields accept (config.register_choices) are imported here,
# the composition root, so that megatron_dapo.config (which imports no component) can check them on any import path.
from megatron_dapo import memory
from megatron_dapo.actor import loss
from megatron_dapo.algorithms import losses
from megatron_dapo.algorithms import rollout_correction

REGISTERING_MODULES = (memory, loss, losses, rollout_correction)
"""actor.offload, actor.logprob_impl, algorithm.policy_loss, algorithm.rollout_correction(_level)."""

__version__ = "0.1.0"
