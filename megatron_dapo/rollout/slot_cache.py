"""The embedded engine's KV cache: a fixed number of row slots of fixed capacity, and the attention that reads it.

    slots     [S, Hkv, C, D] per layer, K and V      S = max running rows rounded up to ROW_BLOCK, C = max_context
    row i     keys 0..len_i-1 written, the rest masked with -inf
    decode    the live rows are slots 0..n-1 (a finished row's slot takes the last live row: `move`); the model runs
              on slots [0, M) with M = n rounded up to ROW_BLOCK, one new token per row written at its own position

Batch invariance (why the shapes are fixed). On CPU (MKL sgemm, measured with 1 and 2 threads) a row of a linear
layer's output is bit-identical for every batch size that is a multiple of 4 (4 to 64 tried) and every row position
in it, but not for batch sizes 1-3 (a gemv path) or for the last row of an odd batch on 2 threads. Attention reduces
over the key axis, so its rounding depends on the key length; here every row attends over the same C keys, masked
past its own length, and the batched matmuls run one (b, kv-head) block at a time. So a row's tokens and log-probs
do not depend on which other rows share its decode steps or its slot: tests/rollout/test_continuous_batching.py
checks it bit for bit. Prefill runs one prompt at a time (its result depends on that prompt only).


`grouped_attention` is eager attention without repeat_kv (the query heads of one KV head are one matmul block);
it is registered with transformers' AttentionInterface under ATTENTION_NAME, with the eager causal mask for callers
that pass no 4D mask, so the model object stays usable for ordinary forwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

ROW_BLOCK = 4
"""Decode batches are padded to a multiple of this many rows (batch invariance, module docstring)."""
ATTENTION_NAME = "megatron_dapo_grouped"
"""The transformers attention implementation the embedded engine sets on its model."""


def grouped_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Eager attention with grouped query heads (no key/value copies per query head).

    query: [B, H, q, D]; key: [B, Hkv, C, D], value: [B, Hkv, C, Dv] with H a multiple of Hkv (head h reads KV head
    h // (H / Hkv), as transformers' repeat_kv; Dv = D but for multi-latent attention); attention_mask: [B, 1, q, C]
    additive (0 / -inf) or None. Returns ([B, q, H, Dv], None). dropout must be 0 (inference only).
    """
    if dropout:
        raise ValueError("grouped_attention: dropout is not supported (inference only)")
    b, h, q, d = query.shape
    hkv, c = key.shape[1], key.shape[2]
    g = h // hkv
    scores = torch.matmul(query.reshape(b, hkv, g * q, d), key.transpose(2, 3)) * scaling
    scores = scores.view(b, hkv, g, q, c)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, -c:]
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.matmul(probs.view(b, hkv, g * q, c), value)
    return out.view(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register `grouped_attention` (and the eager causal mask for it) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(ATTENTION_NAME, grouped_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


class SlotCache:
    """K/V of up to `num_slots` rows per layer, each of capacity `capacity` tokens (the model's cache argument).

    The model calls `update(key, value, layer_idx)` once per layer with the new tokens' key/value; which slots and
    positions they go to is set beforehand with `bind_decode` (one token per slot at its own position) or
    `bind_prefill` (a prompt into a scratch row). Only the update protocol of transformers' Cache is implemented:
    callers always pass position_ids and a 4D mask, so nothing else is asked of it.
    """

    def __init__(
        self, num_layers: int, num_slots: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
        value_dim: int | None = None,
    ) -> None:  # fmt: skip
        shape = (num_slots, kv_heads, capacity, head_dim)
        value_shape = (*shape[:3], value_dim or head_dim)  # multi-latent attention: its rotary key as values
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(value_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.num_slots = num_slots
        self._rows = 0
        self._positions: Tensor | None = None

    def bind_decode(self, rows: int, positions: Tensor) -> None:
        """The next forward writes one token for slots [0, rows) at `positions` [rows] int64 and attends over all C
        keys of those slots."""
        self._rows, self._positions = rows, positions

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write the new tokens' key/value [rows, Hkv, 1, D] and return the slots' full [rows, Hkv, C, D]."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        rows = torch.arange(self._rows, device=k.device)
        k[rows, :, self._positions] = key[:, :, 0]
        v[rows, :, self._positions] = value[:, :, 0]
        return k[: self._rows], v[: self._rows]

    def decode_mask(self, rows: int, positions: Tensor, dtype: torch.dtype) -> Tensor:
        """[rows, 1, 1, C] additive mask: slot r sees keys 0..positions[r]."""
        cols = torch.arange(self.capacity, device=positions.device)
        visible = cols[None, :] <= positions[:rows, None]
        mask = torch.zeros(rows, 1, 1, self.capacity, dtype=dtype, device=positions.device)
        return mask.masked_fill(~visible[:, None, None, :], torch.finfo(dtype).min)

    def write(self, slot: int, keys: list[Tensor], values: list[Tensor]) -> None:
        """Put a prefilled row (per layer [Hkv, P, D]) into `slot` at positions 0..P-1."""
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            n = k.shape[1]
            self.keys[layer][slot, :, :n] = k
            self.values[layer][slot, :, :n] = v

    def read(self, slot: int, length: int) -> tuple[list[Tensor], list[Tensor]]:
        """Copies of `slot`'s first `length` positions: per layer keys and values [Hkv, length, D]."""
        return [k[slot, :, :length].clone() for k in self.keys], [v[slot, :, :length].clone() for v in self.values]

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` (compaction after a row finished)."""
        for k, v in zip(self.keys, self.values, strict=True):
            k[dst] = k[src]
            v[dst] = v[src]


class KeptKV:
    """Multi-turn: the KV of stopped rows, keyed by the tokens it covers (context + response but the last token),
    until the next turn of the same trajectory takes it; at most `capacity`, the oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[tuple[int, ...], tuple[list[Tensor], list[Tensor]]] = OrderedDict()

    def keep(self, tokens: tuple[int, ...], kv: tuple[list[Tensor], list[Tensor]]) -> None:
        self._kept[tokens] = kv
        self._kept.move_to_end(tokens)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def take(self, key: tuple[int, ...]) -> tuple[list[Tensor], list[Tensor]] | None:
        """The kept KV of the longest kept token sequence that `key` extends (removed: a turn continues once)."""
        best = max((t for t in self._kept if len(t) < len(key) and key[: len(t)] == t), key=len, default=None)
        return None if best is None else self._kept.pop(best)

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        """The kept token sequences, oldest first."""
        return iter(self._kept)


class PrefillCache:
    """The model's cache argument for a one-prompt prefill: keeps each layer's [1, Hkv, P, D] key/value. With `past`
    (per layer keys and values [Hkv, P0, D] of the context's first P0 tokens, a kept turn's cache), the forward runs
    on the remaining tokens only and each layer attends over past + new."""

    def __init__(self, num_layers: int, past: tuple[list[Tensor], list[Tensor]] | None = None) -> None:
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers
        self.past = past

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self.past is not None:
            key = torch.cat([self.past[0][layer_idx][None], key], dim=2)
            value = torch.cat([self.past[1][layer_idx][None], value], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value


def causal_mask(length: int, dtype: torch.dtype, device: torch.device | str, past: int = 0) -> Tensor:
    """[1, 1, length, past + length] additive causal mask: query i (position past + i) sees keys 0..past + i."""
    upper = torch.ones(length, past + length, dtype=torch.bool, device=device).triu(past + 1)
    return torch.zeros(1, 1, length, past + length, dtype=dtype, device=device).masked_fill(
        upper, torch.finfo(dtype).min
    )
