"""Rollout engines and per-step weight sync (see README.md in this folder).

SGLang and vLLM are imported only when their engine is built (megatron_dapo.rollout.sglang_engine / vllm_engine).
"""

from megatron_dapo.rollout.base import EngineDied
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.factory import make_engine
from megatron_dapo.rollout.factory import sampling_params
from megatron_dapo.rollout.transformers_engine import TransformersEngine
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup
from megatron_dapo.rollout.weight_sync import WeightSync
from megatron_dapo.rollout.weight_sync import bucket_named_tensors

__all__ = [
    "EngineDied",
    "FinishReason",
    "GenerationRequest",
    "GroupSummary",
    "Rollout",
    "RolloutEngine",
    "RolloutGroup",
    "SamplingParams",
    "TransformersEngine",
    "WeightSync",
    "WeightUpdateError",
    "bucket_named_tensors",
    "make_engine",
    "sampling_params",
]
