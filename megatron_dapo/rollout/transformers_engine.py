"""Embedded rollout engine on a transformers causal LM: continuous batching over KV slots (CPU and small GPU runs).

    submit(GenerationRequest*) -> waiting --a slot frees--> prefill (one context at a time, shared by the requests
        of one prompt) -> first token sampled -> running rows in slots 0..n-1 (rollout/slot_cache.py)
    step(): admit, then one decode step of every running row: logits/T -> log_softmax (returned log-prob)
        -> top-k / top-p filter -> per-row torch.Generator sample; a finished row returns its Rollout at once and
        its slot takes the next waiting request (no batch waits for its longest row)
    abort(): every request in flight comes back unfinished (tokens so far) -- partial rollouts continue them later
    multi-turn (SamplingParams.multi_turn): a row that stops keeps its KV (copied out of its slot, which frees at
        once); the trajectory's next turn, a request whose context extends those tokens, prefills only what is new
        (the last sampled token and the observation) over it. Kept until used, at most max_running (the least
        recently kept go first), dropped by abort, a weight update and a release of the KV cache
        (docs/benchmarks.md "Multi-turn: KV kept across a tool call")
    generate(prompts, params): the same, blocking, for a fixed list (evaluation, tools)

Why not model.generate: it cannot draw each row from its own generator, and its default top_k=50 silently
truncates. Here request (prompt i, sample k) is drawn from a generator seeded by completion_seed(seed, i, k), and
its numerics do not depend on which rows share its decode steps (batch invariance, slot_cache.py): the same
request gives the same tokens and log-probs bit for bit whatever else runs, whenever it starts.

Returned log-probs are of the tempered full-vocabulary distribution, log_softmax(logits / T), before top-k /
top-p truncation, in fp32 -- the quantity the actor recomputes (DESIGN.md).
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.actor.arch import num_experts
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import generate_blocking
from megatron_dapo.rollout.base import request_result
from megatron_dapo.rollout.param_writer import ParameterWriter
from megatron_dapo.rollout.slot_cache import ATTENTION_NAME
from megatron_dapo.rollout.slot_cache import ROW_BLOCK
from megatron_dapo.rollout.slot_cache import KeptKV
from megatron_dapo.rollout.slot_cache import PrefillCache
from megatron_dapo.rollout.slot_cache import SlotCache
from megatron_dapo.rollout.slot_cache import causal_mask
from megatron_dapo.rollout.slot_cache import register_attention
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout


def filter_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask logits outside top-k / the top-p nucleus with -inf.

    scaled: [B, V] float logits already divided by the temperature. Returns a new [B, V] tensor.
    The most likely token is always kept.
    """
    out = scaled
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[union-attr]


@dataclass(eq=False)
class _Row:
    """A running request: its generator, the tokens / log-probs of this run, how many it may generate, and the
    position its last token is written at by the next decode step."""

    request: GenerationRequest
    gen: torch.Generator
    limit: int
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    position: int = 0
    routing: list[Tensor] | None = None  # SamplingParams.return_routed_experts: [tokens, layers, k] per forward
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(index in tokens, weight version) where the engine's version changed while this row ran (request_result)."""


class _RouterCapture:
    """Forward hooks on every MoE layer's router (transformers' Qwen MoE `mlp.gate`, whose forward returns (logits,
    weights, experts [T, k])) keeping the experts of each forward while `on`; `take` stacks them per token. Only
    the owning engine's forwards count (`live`, set around them): another engine over the same model (evaluation
    beside the stream on a split launch) runs its forwards between two takes."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        gates = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")]
        self.num_layers = len(gates)
        experts = num_experts(model.config)
        self.dtype = torch.uint8 if experts <= 256 else torch.int16
        self.on = False
        self.live = False
        self._parts: list[Tensor] = []
        for gate in gates:
            gate.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.on and self.live:
            self._parts.append(output[2].detach())

    def take(self) -> Tensor | None:
        """[T, layers, k] (CPU, uint8 / int16) of the last forward's T tokens (batch-major), or None when off."""
        if not self.on:
            return None
        parts, self._parts = self._parts, []
        return torch.stack(parts, dim=1).to("cpu", self.dtype)


def _check_full_attention(config: Any) -> None:
    """The slot cache applies one causal mask to every layer: refuse sliding-window layers."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(f"TransformersEngine: layer types {sorted(kinds)}: only full-attention models are supported")


class TransformersEngine:
    """A transformers causal LM as a RolloutEngine with continuous batching.

    model: a PreTrainedModel or a checkpoint directory (config.json + safetensors). The engine sets its attention
        implementation to slot_cache.ATTENTION_NAME (grouped eager attention; ordinary forwards still work).
    dtype: parameter dtype (torch.float32 on CPU). device: "cpu" or "cuda[:i]".
    eos_token_ids: ids that end a response; default the model's generation_config / config EOS ids.
    pad_token_id: filler of unused decode rows; default the model's pad id, else the first EOS id.
    max_running: rows decoded together (KV slots), rounded up to a multiple of slot_cache.ROW_BLOCK (4).
    max_context: KV capacity of a slot (prompt + response tokens). Fixed capacity keeps rows batch-invariant across
        a run: the trainer passes the longest prompt of its data plus rollout.max_response_length. None sizes it from
        the first requests (rounded up to 64) and grows it when the engine is idle.
    weight_version: the version stamped on tokens generated from now on (the trainer sets it after each sync); a change
        while requests run starts a new segment in each of them (Rollout.segments), the tokens before it keep theirs.
    """

    def __init__(
        self,
        model: torch.nn.Module | str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_running: int = 32,
        max_context: int | None = None,
    ) -> None:
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        if max_running < 1:
            raise ValueError(f"TransformersEngine.max_running: must be >= 1, got {max_running}")
        if max_context is not None and max_context < 2:
            raise ValueError(f"TransformersEngine.max_context: must be >= 2, got {max_context}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        _check_full_attention(self.model.config)
        register_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        if num_experts(self.model.config) and self.device.type == "cpu":
            # transformers' default MoE kernel (torch grouped_mm) needs 16-byte strides on CPU: any expert width runs
            # with the per-expert loop.
            self.model.set_experts_implementation("eager")
        self.max_running = -(-max_running // ROW_BLOCK) * ROW_BLOCK
        self.max_context = max_context
        self.weight_version = 0
        self._sampling: SamplingParams | None = None
        self._cache: SlotCache | None = None
        self._live: list[_Row] = []
        self._waiting: deque[GenerationRequest] = deque()
        self._prefills: dict[tuple[int, ...], tuple[list[Tensor], list[Tensor], Tensor]] = {}
        self._prefill_refs: dict[tuple[int, ...], int] = {}
        self._kept = KeptKV(self.max_running)
        """Multi-turn: the stopped rows' KV until their next turn's prefill takes it."""
        self.prefilled_tokens = 0
        """Tokens run through prefill forwards so far (a kept turn's context counts only what was new)."""
        config = self.model.config
        gen_config = getattr(self.model, "generation_config", None)
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(getattr(gen_config, "eos_token_id", None)) or _as_id_list(
                getattr(config, "eos_token_id", None)
            )
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        if pad_token_id is None:
            pad_token_id = getattr(gen_config, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = getattr(config, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        # transformers 5.24 renamed the forward's past_key_values argument to cache.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # Prefill needs the last position's logits only ([1, V] instead of [1, P, V]).
        self._prefill_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._asleep = False
        self.weights = ParameterWriter(self.model)
        """The model's HF parameter names and the weight-update sessions that write them (rollout/param_writer.py)."""
        self._routing = _RouterCapture(self.model) if num_experts(self.model.config) else None

    def evaluation_clone(self) -> TransformersEngine:
        """A second engine over the same model (its parameters shared, not copied), with its own cache and queue: an
        engine rank of a split launch scores an evaluation on it while the stream's requests are in flight on this
        one (engine_rank.py)."""
        return TransformersEngine(
            self.model, dtype=next(self.model.parameters()).dtype, device=self.device, eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id, max_running=self.max_running, max_context=self.max_context,
        )  # fmt: skip

    # ------------------------------------------------------------------ generation

    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> None:
        """Queue requests; they start as slots free up (`step`). Every request in flight shares one SamplingParams
        (n is ignored: one response per request). Raises ValueError (naming the request) for a context that does
        not fit max_context."""
        if self._asleep:
            raise RuntimeError("TransformersEngine.submit: the weights are released; call resume_memory first")
        if not requests:
            return
        if self._sampling is not None and params != self._sampling and self.num_unfinished():
            raise ValueError("TransformersEngine.submit: requests in flight use other SamplingParams")
        if params.return_routed_experts and self._routing is None:
            raise ValueError("TransformersEngine: return_routed_experts needs a mixture-of-experts model")
        self._sampling = params
        if self._routing is not None:
            self._routing.on = params.return_routed_experts
        for req in requests:
            done = 0 if req.prefix is None else len(req.prefix)
            # The cap counts the prefix's tokens (a carried response, a multi-turn trajectory): prompt + cap at most.
            need = int(req.prompt_ids.numel()) + max(done, params.max_new_tokens)
            if need > self._ensure_cache(need).capacity:
                raise ValueError(
                    f"TransformersEngine: request {req.key!r} needs {need} positions (prompt {req.prompt_ids.numel()}"
                    f" + cap {params.max_new_tokens}, {done} of them generated); the KV slots hold "
                    f"{self._cache.capacity} (max_context)"
                )
            self._waiting.append(req)
            key = self._context_key(req)
            self._prefill_refs[key] = self._prefill_refs.get(key, 0) + 1

    def free_slots(self) -> int:
        """Row slots not taken by running or queued requests (negative when requests wait for a slot)."""
        return self.max_running - len(self._live) - len(self._waiting)

    def num_unfinished(self) -> int:
        """Requests submitted and not yet returned by `step` or `abort`."""
        return len(self._live) + len(self._waiting)

    @torch.no_grad()
    def step(self) -> list[tuple[Any, Rollout]]:
        """Admit waiting requests into free slots (prefill), then one decode step of every running row; returns the
        (key, Rollout) of each request that finished (STOP or LENGTH), in no particular order."""
        finished: list[tuple[Any, Rollout]] = []
        self._admit(finished)
        if self._live:
            self._decode(finished)
        return finished

    def abort(self) -> list[tuple[Any, Rollout]]:
        """Stop every request in flight; returns (key, Rollout with finish ABORT and the tokens generated so far,
        prefix included) for each, running or queued. Nothing is left in flight."""
        out = [(row.request.key, self._result(row, FinishReason.ABORT)) for row in self._live]
        for req in self._waiting:
            out.append((req.key, request_result(req, [], [] if self._want_logp() else None, FinishReason.ABORT, 0)))
        self._live, self._waiting, self._prefills, self._prefill_refs = [], deque(), {}, {}
        self._kept.clear()
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """len(prompts) * params.n finished Rollouts, grouped contiguously by prompt (rows i*n .. i*n+n-1): a
        blocking run of the same continuous batching, response k of prompt i seeded by completion_seed(seed, i, k)."""
        return generate_blocking(self, prompts, params)

    # internals of the continuous batch
    def _want_logp(self) -> bool:
        return self._sampling is not None and self._sampling.return_logprobs

    @staticmethod
    def _context_key(req: GenerationRequest) -> tuple[int, ...]:
        ids = req.prompt_ids if req.prefix is None else torch.cat([req.prompt_ids, req.prefix.response_ids])
        return tuple(ids.tolist())

    def _ensure_cache(self, need: int) -> SlotCache:
        """The slot cache, allocated on first use (capacity max_context, else `need` rounded up to 64, reallocated
        larger only while no row runs)."""
        capacity = self.max_context or -(-need // 64) * 64
        if self._cache is None or (self.max_context is None and capacity > self._cache.capacity and not self._live):
            cfg = self.model.config
            heads = cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            # Multi-latent attention (transformers 5.25's DeepSeek-V3): the cache holds one "head" of the compressed kv
            # (as keys) and the rotary key (as values), expanded per head after the cache.
            mla = getattr(cfg, "kv_lora_rank", None)
            self._cache = SlotCache(
                cfg.num_hidden_layers,
                self.max_running,
                capacity,
                1 if mla else getattr(cfg, "num_key_value_heads", None) or heads,
                cfg.kv_lora_rank if mla else head_dim,
                self.model.dtype,
                self.device,
                value_dim=cfg.qk_rope_head_dim if mla else None,
            )
        return self._cache

    def _prefill(self, key: tuple[int, ...]) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor | None]:
        """(per layer keys / values [Hkv, P, D], last-position logits [V] fp32, the context's routed experts [P, L, k]
        or None) of one context, computed alone."""
        hit = self._prefills.get(key)
        if hit is not None:
            return hit
        past = self._kept.take(key)
        start = 0 if past is None else past[0][0].shape[1]
        n = len(key) - start
        self.prefilled_tokens += n
        cache = PrefillCache(self.model.config.num_hidden_layers, past)
        logits = (
            self._forward(
                input_ids=torch.tensor([key[start:]], device=self.device),
                attention_mask=causal_mask(n, self.model.dtype, self.device, past=start),
                position_ids=torch.arange(start, start + n, device=self.device)[None],
                use_cache=True,
                **{self._cache_arg: cache},
                **self._prefill_kwargs,
            )
            .logits[0, -1]
            .float()
        )
        routing = self._routing.take() if self._routing is not None else None
        out = ([k[0] for k in cache.keys], [v[0] for v in cache.values], logits, routing)
        self._prefills[key] = out
        return out

    def _admit(self, finished: list) -> None:
        """Move waiting requests into free slots: prefill (shared by the requests of one context), write the slot,
        sample the first token."""
        params = self._sampling
        while self._waiting and len(self._live) < self.max_running:
            req = self._waiting.popleft()
            key = self._context_key(req)
            keys, values, logits, routing = self._prefill(key)
            self._prefill_refs[key] -= 1
            if self._prefill_refs[key] == 0:
                del self._prefill_refs[key], self._prefills[key]
            done = 0 if req.prefix is None else len(req.prefix)
            row = _Row(req, torch.Generator(device=self.device).manual_seed(req.seed), params.max_new_tokens - done)
            row.position = len(key)
            row.routing = None if routing is None else [routing]
            if row.limit <= 0:  # a carried response already at the cap
                finished.append((req.key, self._result(row, FinishReason.LENGTH)))
                continue
            slot = len(self._live)
            self._cache.write(slot, keys, values)
            self._live.append(row)
            self._take_tokens([row], logits[None], [slot], finished)

    def _decode(self, finished: list) -> None:
        """One token for every running row: the model on slots [0, M), M = rows rounded up to ROW_BLOCK."""
        cache = self._cache
        n = len(self._live)
        m = min(-(-n // ROW_BLOCK) * ROW_BLOCK, cache.num_slots)
        ids = torch.full((m, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        positions = torch.zeros(m, dtype=torch.long, device=self.device)
        ids[:n, 0] = torch.tensor([row.tokens[-1] for row in self._live], device=self.device)
        positions[:n] = torch.tensor([row.position for row in self._live], device=self.device)
        cache.bind_decode(m, positions)
        logits = (
            self._forward(
                input_ids=ids,
                attention_mask=cache.decode_mask(m, positions, self.model.dtype),
                position_ids=positions[:, None],
                use_cache=True,
                **{self._cache_arg: cache},
            )
            .logits[:n, -1]
            .float()
        )
        routing = self._routing.take() if self._routing is not None else None
        for i, row in enumerate(self._live):
            row.position += 1
            if row.routing is not None and routing is not None:
                row.routing.append(routing[i : i + 1])
        self._take_tokens(list(self._live), logits, list(range(n)), finished)

    def _forward(self, **inputs: Any) -> Any:
        """The model's forward, with this engine's router capture live during it."""
        if self._routing is None:
            return self.model(**inputs)
        self._routing.live = True
        try:
            return self.model(**inputs)
        finally:
            self._routing.live = False

    def _take_tokens(self, rows: list[_Row], logits: Tensor, slots: list[int], finished: list) -> None:
        """Sample one token per row from logits [len(rows), V] fp32; finished rows leave their slot (the last live
        row moves into it, so live rows stay in slots 0..n-1)."""
        params = self._sampling
        stop = set(self.eos_token_ids) | set(params.stop_token_ids)
        scaled = logits / params.temperature
        token = self._sample(scaled, [row.gen for row in rows], params)
        token_logp = torch.log_softmax(scaled, dim=-1).gather(1, token[:, None])[:, 0]
        leaving = []
        for row, slot, t, lp in zip(rows, slots, token.tolist(), token_logp.tolist(), strict=True):
            if not row.versions or row.versions[-1][1] != self.weight_version:  # weights loaded while it ran
                row.versions.append((len(row.tokens), self.weight_version))
            row.tokens.append(t)
            row.logps.append(lp)
            if t in stop:
                leaving.append((slot, FinishReason.STOP))
            elif len(row.tokens) >= row.limit:
                leaving.append((slot, FinishReason.LENGTH))
        keep = params.multi_turn and not params.return_routed_experts  # (a kept prefill would route part of a context)
        for slot, reason in sorted(leaving, reverse=True):
            row = self._live[slot]
            if keep and reason is FinishReason.STOP:  # its KV, keyed by the tokens it covers
                tokens = (self._context_key(row.request) + tuple(row.tokens))[: row.position]
                self._kept.keep(tokens, self._cache.read(slot, row.position))
            finished.append((row.request.key, self._result(row, reason)))
            last = len(self._live) - 1
            if slot != last:
                self._cache.move(last, slot)
                self._live[slot] = self._live[last]
            self._live.pop()

    def _result(self, row: _Row, finish: FinishReason) -> Rollout:
        logps = row.logps if self._sampling.return_logprobs else None
        routing = torch.cat(row.routing) if row.routing else None
        return request_result(row.request, row.tokens, logps, finish, self.weight_version, routing,
                              versions=row.versions)  # fmt: skip

    def _sample(self, scaled: Tensor, gens: list[torch.Generator], params: SamplingParams) -> Tensor:
        """One token per row: scaled [B, V] fp32 tempered logits -> [B] int64, row b drawn with gens[b]."""
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])

    # ------------------------------------------------------------------ weights

    def begin_weight_update(self) -> None:
        """Open an update session (resuming released weights); end_weight_update() checks that every parameter
        arrived."""
        self.resume_memory(["weights"])
        self._kept.clear()  # a next turn prefills its context under the new weights
        self.weights.begin()

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Copy full HF-named tensors into the parameters in place (cast to the engine dtype).

        bucket: (hf_name, tensor) pairs; each tensor has the parameter's full shape, any float dtype/device. The FP8
        payload of rollout.weight_dtype "fp8" (rollout/fp8.py) is accepted too: a float8_e4m3fn `name` and its fp32
        `name + "_scale_inv"` (128 x 128 blocks) are dequantized into the parameter once both have arrived, in
        whatever order or bucket (rollout/param_writer.py).
        Raises WeightUpdateError naming the tensor on an unknown name or a shape mismatch.
        """
        self.weights.write(bucket)

    def end_weight_update(self, *, full: bool = True) -> None:
        """Close the session; with full=True every parameter (tied aliases counted once) must have arrived."""
        self.weights.end(full=full)

    def load_weights(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """One full update from a list of (hf_name, tensor): begin, one bucket, end(full=True)."""
        self.begin_weight_update()
        self.update_weights(named_tensors)
        self.end_weight_update(full=True)

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Sequence[str]) -> None:
        """ "kv_cache" frees the KV slots (no request may be in flight; they are reallocated by the next submit). On
        CUDA, "weights" moves the model to host memory (its closest equivalent); nothing else ("cuda_graph": none)."""
        if "kv_cache" in tags and self._cache is not None:
            if self.num_unfinished():
                raise RuntimeError("TransformersEngine.release_memory: requests are in flight (abort them first)")
            self._cache = None
            self._kept.clear()
        if self.device.type == "cuda" and "weights" in tags and not self._asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep = True

    def resume_memory(self, tags: Sequence[str]) -> None:
        """ "weights" moves the model back to the device if it was released."""
        if self._asleep and "weights" in tags:
            self.model.to(self.device)
            self._asleep = False

    def shutdown(self) -> None:
        """Drop the model."""
        self.weights = ParameterWriter(torch.nn.Module())
        self.model = None  # type: ignore[assignment]
