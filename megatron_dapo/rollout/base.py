"""The rollout engine contract: sampling parameters, completions and the weight-update session.

    prompts [[ids]] x SamplingParams(n=G) --generate--> [Completion] * (len(prompts) * G), grouped by prompt
    WeightSync --begin_weight_update / update_weights(bucket)* / end_weight_update--> engine

Conventions shared by every engine (DESIGN.md):
- response_ids holds the generated tokens INCLUDING the stop/EOS token that ended the response; a response
  cut at max_new_tokens has finish_reason "length" and exactly max_new_tokens tokens.
- response_logprobs[t] = log_softmax(logits_t / temperature)[response_ids[t]] over the full vocabulary: the
  tempered distribution before top-k/top-p truncation (what the actor computes with the same temperature).
- Weights arrive as full (un-sharded) Hugging Face-named tensors; an engine shards them for its own TP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Protocol
from typing import runtime_checkable

from torch import Tensor

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample: n completions per prompt of at most max_new_tokens tokens each."""

    n: int = 1
    """Completions per prompt (the group size G)."""
    max_new_tokens: int = 256
    """Cap on generated tokens, the stop token included."""
    temperature: float = 1.0
    """Softmax temperature (> 0); the returned log-probs are of this tempered distribution."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (the engine's EOS ids always do)."""
    seed: int | None = None
    """Same seed, same prompts -> same completions; None draws a seed from torch's global RNG."""
    return_logprobs: bool = True
    """Return the sampling log-prob of every generated token."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n: must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature: must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(slots=True)
class Completion:
    """One sampled response.

    prompt_ids: the prompt token ids as given.
    response_ids: generated token ids, the stop token included when finish_reason is "stop".
    response_logprobs: float log-probs, one per response token, or None when not requested.
    finish_reason: "stop" (a stop/EOS token was generated) or "length" (max_new_tokens reached).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None
    finish_reason: str
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason: must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"Completion.response_logprobs: {len(self.response_logprobs)} values for "
                f"{len(self.response_ids)} response tokens"
            )

    @property
    def response_length(self) -> int:
        """Generated tokens, the stop token included."""
        return len(self.response_ids)


class WeightUpdateError(RuntimeError):
    """A weight update names an unknown tensor, misses one, or has a wrong shape (one line, names the tensor)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generation engine.

    Weight updates are a session driven by megatron_dapo.rollout.weight_sync.WeightSync:
    begin_weight_update(), then update_weights(bucket) once per size-bounded bucket of (hf_name, full tensor),
    then end_weight_update(), which checks that every parameter arrived (for a full sync) and flushes caches.
    Device memory (colocated engines) is released and resumed by region, in the order of megatron_dapo/memory.py;
    an update session never resumes a region by itself, except the weights if they are still released.
    """

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions; completions of prompt i are rows i*n .. i*n+n-1."""
        ...

    def begin_weight_update(self) -> None:
        """Open an update session (resume the weights' memory if released, open SGLang's session if it has one)."""
        ...

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Load one bucket of full HF-named tensors into the engine's weights."""
        ...

    def end_weight_update(self, *, full: bool = True) -> None:
        """Close the session; with full=True raise WeightUpdateError unless every parameter was updated."""
        ...

    def release_memory(self, tags: Sequence[str]) -> None:
        """Free the device memory of regions `tags` (ENGINE_TAGS: "weights", "kv_cache", "cuda_graph"); a region's
        contents may be lost (weights are rewritten by the next sync). Regions already released are skipped;
        engines without such regions do nothing. Only megatron_dapo.memory.MemoryChoreographer calls it."""
        ...

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Map released regions `tags` back (regions not released are skipped); generate() needs all of them."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and free its resources."""
        ...
