"""Changed-weights (delta) weight sync: after a small-lr update most weights round to the same value in the dtype the
engine receives, so only the elements whose bits changed since the engine's last update travel.

    sender (WeightSync, rollout.weight_sync_delta)           engine (rollout/param_writer.py)
    DeltaEncoder.encode(name, t): t against its copy of      WeightDelta(base=None): the full tensor
      what the engine holds, bitwise in t's dtype            WeightDelta(base=v): refused unless the engine completed
      -> WeightDelta(version, base, index, values),            version v's update; target[index] = values, cast as a
         the full tensor when a delta would not be smaller     full copy casts them
    a sync that fails midway drops the copies: the next       a session left open, or with plain tensors, holds no
      one is full (also after start, resume, an engine        version: the next delta is refused (never a mix)
      restart, and every rollout.weight_sync_full_every)

Exactness: an element left out has the same bits in the new export as in the one the engine last received, so the
engine's element (that value cast to its dtype) is what a full sync would write; the elements sent are written as a
full sync writes them. Bytes: a delta's positions travel as indices (int32; int64 past 2^31 elements: k x 4 bytes)
or as a bitmap of the tensor (n / 8 bytes, smaller above 1/32 of the elements changed), whichever is smaller, with
its k values; a full tensor is its n values. Each tensor goes in the encoding with the fewest bytes, so no fraction
needs tuning (chosen by measurement: docs/benchmarks.md "Delta weight sync", where per-block encodings lose too).
The sender holds one copy of the exported weights in host memory (the export dtype: 2 bytes per parameter in bf16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class WeightDelta:
    """One tensor of a delta-mode sync.

    version: the sync that writes it (the engine holds this version once the whole update completed).
    base: the version the engine must hold for `index` / `values` to apply; None: `values` is the full tensor.
    index: [k] int32 or int64 flat (row-major) positions of the changed elements; None with base None.
    values: [k] their new values (the export dtype), or the full tensor.
    shape: the tensor's shape (what a receiver that places elements itself needs: rollout/sglang_loader.py).
    """

    version: int
    base: int | None
    index: Tensor | None
    values: Tensor
    shape: tuple[int, ...] = ()

    @property
    def as_mask(self) -> bool:
        """A delta whose positions travel as a bitmap (as_plain_tensors): smaller than its indices."""
        return self.index is not None and self.shape != () and mask_bytes(self.shape) < self.index.nbytes

    @property
    def nbytes(self) -> int:
        """What travels: values, and a delta's positions (its indices or its bitmap, the smaller)."""
        size = self.values.numel() * self.values.element_size()
        if self.index is None:
            return size
        return size + (mask_bytes(self.shape) if self.as_mask else self.index.nbytes)


def mask_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of the bitmap of a tensor of `shape` (one bit per element)."""
    return (math.prod(shape) + 7) // 8


def pack_mask(index: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Flat positions `index` ([k], any order, distinct) -> uint8 [mask_bytes(shape)]: bit j of byte i (least
    significant first) set where element 8 i + j is in `index`."""
    bits = torch.zeros(mask_bytes(shape) * 8, dtype=torch.uint8)
    bits[index.long()] = 1
    bits = bits.view(-1, 8)  # uint8 throughout: n + n / 8 bytes of scratch, whatever the tensor's size
    packed = bits[:, 0].clone()
    for j in range(1, 8):
        packed |= bits[:, j] << j
    return packed


def unpack_mask(mask: Tensor) -> Tensor:
    """pack_mask undone: the set positions, int64 [k] ascending."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return torch.nonzero(((mask.reshape(-1, 1) >> shifts) & 1).reshape(-1)).reshape(-1)


def payload_bytes(x: Tensor | WeightDelta) -> int:
    """Bytes a bucket entry sends: a tensor's elements, or a WeightDelta's values and index."""
    return x.nbytes if isinstance(x, WeightDelta) else x.numel() * x.element_size()


def _bits(t: Tensor) -> Tensor:
    """t's elements as integers of the same width (bitwise comparison: NaN == NaN of the same bits, -0 != +0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.reshape(-1).view(ints[t.element_size()])


def same_bits(a: Tensor, b: Tensor) -> bool:
    """a and b have the same dtype, shape and bits (torch.equal does not take float8; -0 != +0, NaN == its bits)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


class DeltaEncoder:
    """The sender's side: a copy of what the engine holds per tensor name, and the version it holds. full_every:
    every full_every-th sync sends every tensor in full (rollout.weight_sync_full_every; 0: only when needed)."""

    def __init__(self, full_every: int = 0) -> None:
        self.full_every = full_every
        self.syncs = 0
        self.held: dict[str, Tensor] = {}
        """Per name, the last tensor the engine received (CPU, flat, the export dtype)."""
        self.version: int | None = None
        """The sync the engine completed last with these copies; None: the next sync sends every tensor full."""
        self.changed = 0
        self.elements = 0

    def reset(self) -> None:
        """Forget the copies (and the counts of a sync that failed): the next sync is full (start, an engine restart, a
        failed sync, the full interval)."""
        self.held, self.version = {}, None
        self.changed = self.elements = 0

    def start(self) -> None:
        """A sync begins: counted, and at the full interval the copies are dropped (this sync goes in full)."""
        self.syncs += 1
        if self.full_every and self.syncs % self.full_every == 0:
            self.reset()

    def encode(self, name: str, tensor: Tensor, version: int) -> WeightDelta:
        """`tensor` as sync `version` sends it: the changed elements against the engine's copy, or the full tensor
        (no copy of this name, another shape or dtype, or a delta no smaller)."""
        new = tensor.detach().to("cpu").contiguous()
        old = self.held.get(name) if self.version is not None else None
        self.elements += new.numel()
        if old is None or old.numel() != new.numel() or old.dtype != new.dtype:
            self.held[name] = new.reshape(-1).clone()  # the export may alias live parameters: a copy of its own
            self.changed += new.numel()
            return WeightDelta(version, None, None, new)
        changed = torch.nonzero(_bits(new) != _bits(old)).reshape(-1)
        values = new.reshape(-1)[changed]
        old[changed] = values  # the copy becomes `new` in place: every other element already has its bits
        self.changed += changed.numel()
        index = changed.to(torch.int32) if new.numel() < 2**31 else changed
        delta = WeightDelta(version, self.version, index, values, tuple(new.shape))
        return delta if delta.nbytes < new.numel() * new.element_size() else WeightDelta(version, None, None, new)

    def pop_fraction(self) -> float:
        """The fraction of elements that changed (or went full) since the last call."""
        fraction = self.changed / self.elements if self.elements else 0.0
        self.changed = self.elements = 0
        return fraction


def apply_delta(target: Tensor, delta: WeightDelta) -> None:
    """Write a delta's values into `target` (a parameter or a view of one, any dtype) at its flat positions."""
    index = torch.unravel_index(delta.index.long(), target.shape)
    target.index_put_(index, delta.values.to(device=target.device, dtype=target.dtype))


INDEX_SUFFIX = ".__delta_index__"
MASK_SUFFIX = ".__delta_mask__"
VALUES_SUFFIX = ".__delta_values__"
"""On a wire that carries plain (name, tensor) pairs (the split launch's weight channel, the SGLang loader's body), a
delta of `name` travels as `name + INDEX_SUFFIX` (its int32 / int64 indices) or `name + MASK_SUFFIX` (its bitmap,
pack_mask, where smaller: WeightDelta.as_mask) followed by `name + VALUES_SUFFIX` (its values, in position order
after a bitmap)."""


def as_plain_tensors(entries: Iterable[tuple[str, WeightDelta]]) -> Iterator[tuple[str, Tensor]]:
    """WeightDelta entries as plain (name, tensor) pairs for such a wire: a full tensor as itself, a delta as its
    positions (indices or bitmap) and values under the suffixed names."""
    for name, delta in entries:
        if delta.index is None:
            yield name, delta.values
        elif delta.as_mask:
            index, order = torch.sort(delta.index.long())  # a forwarded delta's positions come in any order
            yield name + MASK_SUFFIX, pack_mask(index, delta.shape)
            yield name + VALUES_SUFFIX, delta.values.reshape(-1)[order]
        else:
            yield name + INDEX_SUFFIX, delta.index
            yield name + VALUES_SUFFIX, delta.values


def wire_positions(name: str, tensor: Tensor) -> tuple[str, Tensor] | None:
    """A wire entry that carries a delta's positions -> (the tensor's name, its flat positions); None otherwise."""
    if name.endswith(INDEX_SUFFIX):
        return name[: -len(INDEX_SUFFIX)], tensor
    if name.endswith(MASK_SUFFIX):
        return name[: -len(MASK_SUFFIX)], unpack_mask(tensor)
    return None


class DeltaDecoder:
    """The receiving side of a delta wire that loads full tensors (an engine rank of the split launch): it holds
    each tensor as last received and turns the pairs of `as_plain_tensors` back into full tensors, so the engine
    is always given whole tensors (a rebuilt engine too)."""

    def __init__(self) -> None:
        self.held: dict[str, Tensor] = {}
        self.version: int | None = None
        """The push whose tensors `held` are; None before the first (or after a push that did not complete)."""
        self._pushing: int | None = None
        self._base: int | None = None
        self._index: tuple[str, Tensor] | None = None

    def begin(self, version: int, base: int | None) -> None:
        """Push `version` starts, computed against `base` (None: every tensor is full); until `end` the held tensors
        are a mix of two versions. ValueError (one line) when its deltas are against a version this side does not
        hold."""
        if base is not None and base != self.version:
            held = "no version" if self.version is None else f"version {self.version}"
            raise ValueError(f"weight channel: push {version} is a delta against version {base} but this rank holds "
                             f"{held}")  # fmt: skip
        self.version, self._pushing, self._base, self._index = None, version, base, None

    def decode(self, bucket: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        """One received bucket of the push in progress -> its full tensors."""
        out = []
        for name, index, tensor in self._entries(bucket):
            if index is None:
                self.held[name] = tensor.detach().to("cpu").clone()
            elif name not in self.held:
                raise ValueError(f"weight channel: delta values of {name!r} without its base tensor")
            else:
                self.held[name].view(-1)[index.long()] = tensor.to(self.held[name].dtype)
            out.append((name, self.held[name]))
        return out

    def _entries(self, bucket: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor | None, Tensor]]:
        """The pairs of `as_plain_tensors` as (name, index or None for a full tensor, values); an index waits for
        its values, which may come in the next bucket."""
        for name, tensor in bucket:
            positions = wire_positions(name, tensor)
            if positions is not None:
                self._index = positions
            elif name.endswith(VALUES_SUFFIX):
                name = name[: -len(VALUES_SUFFIX)]
                if self._index is None or self._index[0] != name:
                    raise ValueError(f"weight channel: delta values of {name!r} without its index")
                index, self._index = self._index[1], None
                yield name, index, tensor
            else:
                yield name, None, tensor

    def end(self) -> None:
        """The push completed: the held tensors are its version."""
        self.version = self._pushing


class DeltaReader(DeltaDecoder):
    """The receiving side of a delta wire that forwards instead of loading (an engine rank relaying to SGLang servers,
    whose delta loader holds the base: rollout/sglang_loader.py): the pairs of `as_plain_tensors` back into
    WeightDelta entries of the push in progress, a full tensor with index None. No tensor is held; `begin` checks
    the base against the last complete push as DeltaDecoder's does (so a wrong base is refused here, before it
    reaches a server, whose loader would refuse it too)."""

    def decode(self, bucket: list[tuple[str, Tensor]]) -> list[tuple[str, WeightDelta]]:  # type: ignore[override]
        if self._pushing is None:
            raise ValueError("weight channel: delta entries outside a push")
        out = []
        for name, index, tensor in self._entries(bucket):
            if index is not None and self._base is None:
                raise ValueError(f"weight channel: delta values of {name!r} in a push with no base version")
            out.append((name, WeightDelta(self._pushing, None if index is None else self._base, index, tensor)))
        return out


def forward_unit(assembler: Any, unit: Any, pieces: list[WeightDelta]) -> list[tuple[str, WeightDelta]]:
    """reshard.Assembler's `combine` for pieces forwarded as WeightDelta entries (DeltaReader: an engine rank relaying
    to SGLang servers' delta loader, no base held): all pieces full -> the full HF tensors (still WeightDelta entries,
    so the loader learns the version); else each HF tensor's changed elements at its own flat positions
    (assembler.hf_positions), a full piece counting as every element changed, and a tensor with none still getting
    its empty entry (the servers' update names every tensor, as a push from actor rank 0 does)."""
    if all(x.index is None for x in pieces):
        full = assembler.unshard(unit, [x.values for x in pieces])
        return [(n, WeightDelta(pieces[0].version, None, None, t, tuple(t.shape))) for n, t in full]
    delta = next(x for x in pieces if x.index is not None)
    per_name: list[tuple[list[Tensor], list[Tensor]]] = [([], []) for _ in unit.hf_names]
    for rank, x in enumerate(pieces):
        values = x.values.reshape(-1)
        index = torch.arange(values.numel()) if x.index is None else x.index.long()
        for j, (keep, positions) in enumerate(assembler.hf_positions(unit, rank, index)):
            per_name[j][0].append(positions)
            per_name[j][1].append(values[keep])
    out = []
    for name, shape, (positions, values) in zip(unit.hf_names, unit.hf_shapes, per_name, strict=True):
        index = torch.cat(positions)
        index = index.to(torch.int32) if torch.Size(shape).numel() < 2**31 else index  # as DeltaEncoder's
        out.append((name, WeightDelta(delta.version, delta.base, index, torch.cat(values), tuple(shape))))
    return out
