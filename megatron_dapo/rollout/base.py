"""The rollout engine contract: sampling parameters, streaming and blocking generation, the weight-update session.

    GenerationRequest* --submit--> engine --step()--> (key, Rollout) of each request as it finishes (streaming)
                                          --abort()--> (key, unfinished Rollout) of everything in flight
    prompts [[ids]] x SamplingParams(n=G) --generate--> [Rollout] * (len(prompts) * G), grouped by prompt (blocking)
    WeightSync --begin_weight_update / update_weights(bucket)* / end_weight_update--> engine

Conventions shared by every engine (DESIGN.md):
- Records are rollout/types.py's: response_ids holds the generated tokens INCLUDING the stop/EOS token that ended
  the response; a response cut at max_new_tokens has finish LENGTH and exactly max_new_tokens tokens.
- engine_logp[t] = log_softmax(logits_t / temperature)[response_ids[t]] over the full vocabulary: the
  tempered distribution before top-k/top-p truncation (what the actor computes with the same temperature).
- Every token is stamped with the engine's weight_version (Rollout.segments).
- Weights arrive as full (un-sharded) Hugging Face-named tensors; an engine shards them for its own TP.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import NamedTuple
from typing import Protocol
from typing import runtime_checkable

import torch
from torch import Tensor

from megatron_dapo.config import RolloutConfig
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout


class RoutedShape(NamedTuple):
    """The shape of an MoE model's per-token routing as SGLang records it: [positions, layers, topk] ids of
    `experts`, one entry per decoder layer; the first `dense_layers` (GLM-4.5's dense layers) have no router, and
    Rollout.routed_experts (the actor's layout, the embedded engine's) leaves them out."""

    layers: int
    topk: int
    experts: int
    dense_layers: int = 0


@dataclass(frozen=True)
class EngineLaunch:
    """What starts an engine in this process (SGLangEngine, VLLMEngine; `factory.make_engine` builds it): the HF
    checkpoint directory model_path (the actor's starting point; later weights come through WeightSync), the
    RolloutConfig it reads its sizes from (its defaults when None), the weight dtype name ("bfloat16" / "float32"),
    the engine's seed, base_gpu_id (SGLang: the first of its rollout.tensor_parallel GPUs), extra (more keyword
    arguments for sglang.Engine / vllm.LLM) and routed_shape (RoutedShape of an MoE model whose results must carry
    every token's routing, actor.routing_replay r3; SGLang only)."""

    model_path: str
    rollout: RolloutConfig | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    base_gpu_id: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    routed_shape: RoutedShape | None = None

    @property
    def config(self) -> RolloutConfig:
        """The rollout section (its defaults when none was given)."""
        return self.rollout or RolloutConfig()


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
    return_routed_experts: bool = False
    """MoE models: return every token's experts per MoE layer (Rollout.routed_experts; actor.routing_replay r3)."""
    multi_turn: bool = False
    """A response that stops may be continued as the prefix of a new request (its next turn, after an observation):
    an engine may keep its KV cache until then (the transformers engine does; SGLang's radix cache does it anyway)."""

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


_MASK64 = (1 << 64) - 1


def completion_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit generator seed for completion `sample_index` of prompt `prompt_index` (splitmix64 mixing)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def requests_for(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationRequest]:
    """The requests of a blocking generate(prompts, params): key (i, k) and seed completion_seed(params.seed, i, k)
    for sample k of prompt i, i-major (params.seed None draws one from torch's global RNG)."""
    base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return [
        GenerationRequest((i, k), list(prompt), completion_seed(base, i, k))
        for i, prompt in enumerate(prompts)
        for k in range(params.n)
    ]


def generate_blocking(engine: Any, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
    """RolloutEngine.generate on top of the streaming calls: one submit per prompt (its n requests), steps until
    every request finished; rows in i-major order (requests_for)."""
    if engine.num_unfinished():
        raise RuntimeError(f"{type(engine).__name__}.generate: requests of a stream are still in flight")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"{type(engine).__name__}.generate: prompt {i} is empty")
    requests = requests_for(prompts, params)
    for i in range(len(prompts)):
        engine.submit(requests[i * params.n : (i + 1) * params.n], params)
    done: dict[Any, Rollout] = {}
    while engine.num_unfinished():
        done.update(engine.step())
    return [done[r.key] for r in requests]


def request_result(
    request: GenerationRequest,
    ids: Sequence[int] | Tensor,
    logps: Sequence[float] | Tensor | None,
    finish: FinishReason,
    version: int,
    routed_experts: Tensor | None = None,
    *,
    versions: Sequence[tuple[int, int]] = (),
) -> Rollout:
    """The Rollout of `request` after this run generated `ids` (engine log-probs `logps`, or None) under weight
    `version`: its prefix (if any) continued, in a new segment when the version changed; routed_experts: this run's
    routing of the whole sequence (Rollout.routed_experts), or None. versions: ((start in ids, version), ...) when
    the weights changed during this run (an update while it generated): token i of ids was sampled under the version
    of the last start <= i; empty: every token under `version`."""
    prefix = request.prefix or Rollout(request.prompt_ids, [], None if logps is None else [], FinishReason.ABORT)
    if not versions:
        versions = ((0, version),)
    ends = [start for start, _ in versions[1:]] + [len(ids)]
    out = prefix
    for (start, v), end in zip(versions, ends, strict=True):
        part_logps = None if logps is None else logps[start:end]
        out = out.extend(ids[start:end], part_logps, v, routed_experts if end == len(ids) else None)
    out.finish = finish
    return out


class BlockingStream:
    """The streaming half of the engine contract for engines that generate only in blocking calls (vLLM's LLM):
    step() runs everything submitted since the last step as one call of `run_requests` and returns all of it;
    abort() can only return what has not started (as empty ABORT rollouts, prefixes kept). Subclasses implement
    run_requests(requests, params) -> [Rollout] in request order and generate() with it."""

    weight_version: int = 0

    def run_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        raise NotImplementedError

    @property
    def _pending(self) -> list[tuple[GenerationRequest, SamplingParams]]:
        if "_pending_requests" not in self.__dict__:
            self._pending_requests: list[tuple[GenerationRequest, SamplingParams]] = []
        return self._pending_requests

    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        self._pending.extend((r, params) for r in requests)

    def step(self) -> list[tuple[Any, Rollout]]:
        pending = list(self._pending)
        self._pending.clear()
        out: list[tuple[Any, Rollout]] = []
        for params in {id(p): p for _, p in pending}.values():
            batch = [r for r, p in pending if p is params]
            out.extend((r.key, x) for r, x in zip(batch, self.run_requests(batch, params), strict=True))
        return out

    def abort(self) -> list[tuple[Any, Rollout]]:
        pending = list(self._pending)
        self._pending.clear()
        return [(r.key, r.prefix or Rollout(r.prompt_ids, [], None, FinishReason.ABORT)) for r, _ in pending]

    def free_slots(self) -> int:
        return 1 << 30

    def num_unfinished(self) -> int:
        return len(self._pending)


class EngineDied(RuntimeError):
    """The engine cannot go on: its process exited, or it returned nothing for rollout.engine_stall_minutes with
    requests in flight. The message says why (one line). The stream restarts the engine in place (rollout/stream.py,
    "Engine failures"); its requests in flight are lost and re-queued."""


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

    weight_version: int
    """Stamped on every token generated from now on (the trainer sets it to the step after each sync)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """len(prompts) * params.n finished Rollouts; those of prompt i are rows i*n .. i*n+n-1 (blocking)."""
        ...

    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        """Start requests (one response each; params.n is ignored). A request with a prefix continues it."""
        ...

    def step(self) -> list[tuple[Any, Rollout]]:
        """Make progress (the embedded engine: one decode step; remote engines: wait briefly) and return the
        (request key, finished Rollout) of each request that finished since the last call."""
        ...

    def abort(self) -> list[tuple[Any, Rollout]]:
        """Stop everything in flight; return (key, Rollout with finish ABORT holding the tokens generated so far)
        for every request submitted and not yet returned. Nothing is left in flight afterwards."""
        ...

    def free_slots(self) -> int:
        """How many more requests would run at once now (negative: that many wait for a slot)."""
        ...

    def num_unfinished(self) -> int:
        """Requests submitted and not yet returned by step() or abort()."""
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
