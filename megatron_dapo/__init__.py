"""megatron_dapo: DAPO (arXiv 2503.14476) on Megatron-Core. See docs/architecture.md."""

# The modules that declare the names the config's choice fields accept (config.register_choices) are imported here,
# the composition root, so that megatron_dapo.config (which imports no component) can check them on any import path.
# They import no torch: reading and checking a run config stays light (tests/test_light_imports.py).
from megatron_dapo import choices
from megatron_dapo import memory
from megatron_dapo.algorithms import loss_configs

REGISTERING_MODULES = (choices, memory, loss_configs)
"""actor.logprob_impl, actor.loss_kernel, algorithm.rollout_correction(_level); actor.offload;
algorithm.policy_loss."""

__version__ = "0.1.0"
