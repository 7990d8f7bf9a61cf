"""Embedded rollout engine on a transformers causal LM: own sampling loop with a KV cache (CPU and small GPU runs).

    prompts x n --rows--> micro-batches of batch_size rows, left-padded
        prefill (DynamicCache) -> loop: logits/T -> log_softmax (returned log-prob)
                                         -> top-k / top-p filter -> per-row torch.Generator sample
                                         -> finished rows leave the batch (cache.batch_select_indices)

Why not model.generate: it cannot draw each row from its own generator, and its default top_k=50 silently
truncates. Here completion k of prompt i is drawn from a generator seeded by (seed, i, k), so its tokens do not
depend on batch_size or on the other rows of its micro-batch (up to float rounding of padded batches).

Returned log-probs are of the tempered full-vocabulary distribution, log_softmax(logits / T), before top-k /
top-p truncation, in fp32 -- the quantity the actor recomputes (DESIGN.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from megatron_dapo.rollout.base import Completion
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import WeightUpdateError

_MASK64 = (1 << 64) - 1


def completion_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit generator seed for completion `sample_index` of prompt `prompt_index` (splitmix64 mixing)."""
    x = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


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


class TransformersEngine:
    """A transformers causal LM as a RolloutEngine.

    model: a PreTrainedModel or a checkpoint directory (config.json + safetensors).
    dtype: parameter dtype (torch.float32 on CPU). device: "cpu" or "cuda[:i]".
    eos_token_ids: ids that end a response; default the model's generation_config / config EOS ids.
    pad_token_id: filler for left padding; default the model's pad id, else the first EOS id.
    batch_size: rows (completions) per forward micro-batch.
    """

    def __init__(
        self,
        model: torch.nn.Module | str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        batch_size: int = 32,
    ) -> None:
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM  # noqa: PLC0415

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        if batch_size < 1:
            raise ValueError(f"TransformersEngine.batch_size: must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.batch_size = batch_size
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
        # Prefill needs the last position's logits only ([B, V] instead of [B, S, V]).
        self._prefill_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._asleep = False
        self._index_parameters()
        self._received: set[str] | None = None
        self._fp8_pending: dict[str, dict[str, Tensor]] = {}  # FP8 weights waiting for their scale (or vice versa)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, grouped contiguously by prompt (see module docstring)."""
        if self._asleep:
            raise RuntimeError("TransformersEngine.generate: the engine is asleep; call wake() first")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"TransformersEngine.generate: prompt {i} is empty")
        base_seed = params.seed
        if base_seed is None:
            base_seed = int(torch.randint(0, 2**62, (1,)).item())
        rows = [(i, k) for i in range(len(prompts)) for k in range(params.n)]
        out: list[Completion] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            seeds = [completion_seed(base_seed, i, k) for i, k in chunk]
            results = self._generate_rows([prompts[i] for i, _ in chunk], seeds, params)
            for (i, _), (ids, logps, reason) in zip(chunk, results):
                out.append(
                    Completion(
                        prompt_ids=list(prompts[i]),
                        response_ids=ids,
                        response_logprobs=logps if params.return_logprobs else None,
                        finish_reason=reason,
                    )
                )
        return out

    def _left_pad(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[b, width - len(r) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _sample(self, scaled: Tensor, gens: list[torch.Generator], params: SamplingParams) -> Tensor:
        """One token per row: scaled [B, V] fp32 tempered logits -> [B] int64, row b drawn with gens[b]."""
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])

    def _generate_rows(
        self, rows: list[list[int]], seeds: list[int], params: SamplingParams
    ) -> list[tuple[list[int], list[float], str]]:
        """Sample one completion per row; returns (response_ids, logprobs, finish_reason) per row."""
        from transformers import DynamicCache  # noqa: PLC0415

        stop = set(self.eos_token_ids) | set(params.stop_token_ids)
        gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        # Shared prefill: each distinct prompt (the n samples of a group) runs through the model once; its KV cache
        # rows are then repeated, which halves CPU generation time for few-shot prompts at G = 8.
        unique: dict[tuple[int, ...], int] = {}
        expand = torch.tensor([unique.setdefault(tuple(r), len(unique)) for r in rows], device=self.device)
        ids, mask = self._left_pad([list(r) for r in unique])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
            **self._prefill_kwargs,
        ).logits[:, -1]
        if len(unique) < len(rows):
            cache.batch_select_indices(expand)
        logits, mask, positions = logits[expand], mask[expand], positions[expand]
        next_pos = positions[:, -1] + 1
        active = list(range(len(rows)))  # original row index of each batch row
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        reasons: list[str] = ["length"] * len(rows)
        for _ in range(params.max_new_tokens):
            scaled = logits.float() / params.temperature
            token = self._sample(scaled, [gens[r] for r in active], params)
            token_logp = torch.log_softmax(scaled, dim=-1).gather(1, token[:, None])[:, 0]
            keep: list[int] = []
            for b, r in enumerate(active):
                t = int(token[b])
                tokens[r].append(t)
                logps[r].append(float(token_logp[b]))
                if t in stop:
                    reasons[r] = "stop"
                elif len(tokens[r]) < params.max_new_tokens:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                token, mask, next_pos = token[sel], mask[sel], next_pos[sel]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{self._cache_arg: cache},
            ).logits[:, -1]
            next_pos = next_pos + 1
        return list(zip(tokens, logps, reasons))

    # ------------------------------------------------------------------ weights

    def _index_parameters(self) -> None:
        """Map every parameter name, aliases of tied weights included, to its tensor and canonical name."""
        self._params: dict[str, Tensor] = {}
        self._canonical: dict[str, str] = {}
        first_name: dict[int, str] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            canonical = first_name.setdefault(id(p), name)
            self._params[name] = p
            self._canonical[name] = canonical
        self.parameter_names = frozenset(first_name.values())

    def begin_weight_update(self) -> None:
        """Open an update session; end_weight_update() checks that every parameter arrived."""
        self._received = set()
        self._fp8_pending = {}

    @torch.no_grad()
    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Copy full HF-named tensors into the parameters in place (cast to the engine dtype).

        bucket: (hf_name, tensor) pairs; each tensor has the parameter's full shape, any float dtype/device. The FP8
        payload of rollout.weight_dtype "fp8" (rollout/fp8.py) is accepted too: a float8_e4m3fn `name` and its fp32
        `name + "_scale_inv"` (128 x 128 blocks) are dequantized into the parameter once both have arrived, in
        whatever order or bucket.
        Raises WeightUpdateError naming the tensor on an unknown name or a shape mismatch.
        """
        from megatron_dapo.rollout.fp8 import SCALE_SUFFIX  # noqa: PLC0415

        cls = type(self.model).__name__
        for name, tensor in bucket:
            base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
            if base is not None and base in self._params:
                self._fp8_part(base, "scale_inv", tensor)
                continue
            target = self._params.get(name)
            if target is None:
                raise WeightUpdateError(f"update_weights: unknown tensor {name!r} (not a parameter of {cls})")
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(
                    f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, {cls} expects "
                    f"{tuple(target.shape)}"
                )
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                self._fp8_part(name, "q", tensor)
                continue
            self._copy_in(name, tensor)

    def _copy_in(self, name: str, tensor: Tensor) -> None:
        self._params[name].copy_(tensor)
        if self._received is not None:
            self._received.add(self._canonical[name])

    def _fp8_part(self, name: str, part: str, tensor: Tensor) -> None:
        """Hold one half of an FP8 weight (q or scale_inv); dequantize into the parameter when both are here."""
        from megatron_dapo.rollout.fp8 import dequantize_block_fp8  # noqa: PLC0415

        pending = self._fp8_pending.setdefault(name, {})
        pending[part] = tensor
        if len(pending) == 2:
            del self._fp8_pending[name]
            try:
                weight = dequantize_block_fp8(pending["q"], pending["scale_inv"], self._params[name].dtype)
            except ValueError as err:
                raise WeightUpdateError(f"update_weights: tensor {name!r}: {err}") from None
            self._copy_in(name, weight)

    def end_weight_update(self, *, full: bool = True) -> None:
        """Close the session; with full=True every parameter (tied aliases counted once) must have arrived."""
        received, self._received = self._received, None
        if received is None:
            raise WeightUpdateError("end_weight_update: no update session is open (call begin_weight_update)")
        if self._fp8_pending:
            name, parts = next(iter(self._fp8_pending.items()))
            self._fp8_pending = {}
            raise WeightUpdateError(
                f"end_weight_update: FP8 tensor {name!r} got its {next(iter(parts))} but not its "
                f"{'scale_inv' if 'q' in parts else 'fp8 weight'}"
            )
        missing = sorted(self.parameter_names - received)
        if full and missing:
            raise WeightUpdateError(
                f"end_weight_update: tensor {missing[0]!r} was not received "
                f"({len(missing)} of {len(self.parameter_names)} parameters missing)"
            )

    def load_weights(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """One full update from a list of (hf_name, tensor): begin, one bucket, end(full=True)."""
        self.begin_weight_update()
        self.update_weights(named_tensors)
        self.end_weight_update(full=True)

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """On CUDA move the weights to host memory; no-op on CPU."""
        if self.device.type == "cuda" and not self._asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = self.device.type == "cuda"

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Move the weights back to the device (tags are accepted for protocol compatibility)."""
        if self._asleep:
            self.model.to(self.device)
        self._asleep = False

    def shutdown(self) -> None:
        """Drop the model."""
        self._params = {}
        self.model = None  # type: ignore[assignment]
