"""Rollout engines and per-step weight sync (see README.md in this folder).

SGLang and vLLM are imported only when their engine is built (megatron_dapo.rollout.sglang_engine / vllm_engine).
The names below load on first use (PEP 562): the engine table (rollout/engines.py), which the config reads, imports
no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineDied": "base",
    "EngineLaunch": "base",
    "RolloutEngine": "base",
    "SamplingParams": "base",
    "WeightUpdateError": "base",
    "make_engine": "factory",
    "sampling_params": "factory",
    "TransformersEngine": "transformers_engine",
    "FinishReason": "types",
    "GenerationRequest": "types",
    "GroupSummary": "types",
    "Rollout": "types",
    "RolloutGroup": "types",
    "WeightSync": "weight_sync",
    "bucket_named_tensors": "weight_sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
