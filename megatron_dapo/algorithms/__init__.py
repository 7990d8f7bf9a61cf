"""DAPO's algorithm core in pure torch: no megatron import, no process-group globals.

The names below load on first use (PEP 562), so that `megatron_dapo.algorithms.loss_configs`, which reading a run
config needs, imports no torch; asking for the loss registry (POLICY_LOSSES, get_policy_loss, ...) loads every loss
in algorithms/losses/ first.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "group_normalized_advantages": "advantages",
    "DynamicSampler": "dynamic_sampling",
    "DynamicSamplingError": "dynamic_sampling",
    "Group": "dynamic_sampling",
    "StepSampling": "dynamic_sampling",
    "group_is_informative": "dynamic_sampling",
    "overlong_filter_mask": "overlong",
    "soft_overlong_penalty": "overlong",
    "LOSS_AGG_MODES": "loss_configs",
    "PolicyLossConfig": "loss_configs",
    "LossInputs": "policy_loss",
    "agg_loss": "policy_loss",
    "dapo_policy_loss": "policy_loss",
    "POLICY_LOSSES": "policy_loss",
    "get_policy_loss": "policy_loss",
    "loss_name": "policy_loss",
    "register_policy_loss": "policy_loss",
}
_REGISTRY = ("POLICY_LOSSES", "get_policy_loss", "loss_name")
"""Names that need the losses registered (algorithms/losses/ imported)."""

__all__ = sorted([*_EXPORTS, "losses"])


def __getattr__(name: str) -> Any:
    if name == "losses" or name in _REGISTRY:
        losses = importlib.import_module(f"{__name__}.losses")  # registers the losses in algorithms/losses/
        if name == "losses":
            return losses
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
