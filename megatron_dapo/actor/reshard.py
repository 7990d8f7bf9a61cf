"""Direct resharding: every actor rank sends the Megatron shards it holds, the engine ranks rebuild the HF tensors.

    transfer_plan(hf_config, layout) -> Plan           which actor rank sends which shard of which parameter
    owned_shards(model_chunks, hf_config, groups, pieces, dtype) -> Iterator[(piece name, shard)]    (actor side)
    Assembler(hf_config, tp).add(name, shard) -> [(hf name, full tensor)] of the unit it completes, .finish()
                                                                                                     (engine side)

The rank-0 route (actor.hf_weights.export_hf_weights + placement.WeightChannel) gathers every tensor over TP,
broadcasts it over PP and sends the whole model from actor rank 0: one rank's link carries every byte and the other
actor ranks wait in collectives. Here no actor rank gathers anything: a piece is one TP shard of one megatron
parameter (a replicated one, such as a norm, is one piece), named "<its first HF name>@<TP rank>", in the export
dtype; the plan gives each piece to exactly one of the actor ranks holding it (its stage, TP rank and, for a routed
expert, EP rank; data-parallel replicas hold the same pieces and share the work: largest first, to the least
loaded), and every actor rank sends its pieces at once on its own link (placement.DirectChannel). An engine rank
receives the pieces of every sender and rebuilds each full HF tensor with the converter's own `_unshard`, so the
tensors it loads are bit for bit those of the rank-0 export.

The plan is a function of the HF config and the actor's layout only (every rank computes the same one); the engine
side needs only the HF config and the actor's TP size (how many shards a split parameter has).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.actor.hf_weights import _dims
from megatron_dapo.actor.hf_weights import _export_dtype
from megatron_dapo.actor.hf_weights import _find_param
from megatron_dapo.actor.hf_weights import _plan
from megatron_dapo.actor.hf_weights import _shard
from megatron_dapo.actor.hf_weights import _stage_model
from megatron_dapo.actor.hf_weights import _Unit
from megatron_dapo.actor.hf_weights import _unshard
from megatron_dapo.actor.hf_weights import model_tensors
from megatron_dapo.actor.model import padded_vocab_size

if TYPE_CHECKING:
    from megatron_dapo.actor.distributed import ParallelGroups

SHARD_SEP = "@"
"""Separates a piece's HF name from its TP rank ("model.layers.0.self_attn.q_proj.weight@1")."""


@dataclass(frozen=True)
class Layout:
    """The actor's parallel layout: sizes, and per actor rank (in rank order) its (tp_rank, pp_rank, ep_rank)."""

    tp: int
    pp: int
    ep: int
    coords: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, groups: ParallelGroups, coords: Iterable[tuple[int, int, int]]) -> Layout:
        return cls(groups.tp_size, groups.pp_size, groups.ep_size, tuple(tuple(c) for c in coords))

    @classmethod
    def gather(cls, groups: ParallelGroups) -> Layout:
        """The layout of every actor rank: an all-gather of their coordinates over groups.world_group (collective)."""
        import torch.distributed as dist

        coords: list[Any] = [None] * groups.world_size
        dist.all_gather_object(coords, (groups.tp_rank, groups.pp_rank, groups.ep_rank), group=groups.world_group)
        return cls.of(groups, coords)

    def __post_init__(self) -> None:
        want = {(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        missing = sorted(want - set(self.coords))
        if missing:
            raise ValueError(f"reshard: no actor rank holds (tp, pp, ep) = {missing[0]} of a {self.tp} x {self.pp} x "
                             f"{self.ep} layout")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """pieces[r]: the (unit index, TP rank) pairs actor rank r sends, in export order; units: the converter's plan."""

    units: tuple[_Unit, ...]
    pieces: tuple[tuple[tuple[int, int], ...], ...]
    numels: tuple[int, ...]
    """Per actor rank, the elements it sends in a full sync (its share of the link traffic)."""


def piece_name(unit: _Unit, shard: int) -> str:
    return f"{unit.hf_names[0]}{SHARD_SEP}{shard}"


def _shard_count(unit: _Unit, tp: int) -> int:
    return 1 if unit.kind == "replicated" else tp


def _shard_numel(unit: _Unit, d: Any, tp: int) -> int:
    numel = sum(int(torch.Size(s).numel()) for s in unit.hf_shapes)
    if unit.kind == "vocab":
        numel = padded_vocab_size(d.vocab, tp) * d.hidden
    return numel // _shard_count(unit, tp)


def transfer_plan(hf_config: Any, layout: Layout) -> Plan:
    """Give every shard of every parameter to one actor rank that holds it: largest shards first, each to the holder
    (data-parallel replicas hold the same shards) with the fewest elements so far, the lowest rank on a tie; each
    rank then sends its shards in export order. Deterministic: every rank computes the same plan."""
    d = _dims(hf_config, layout.ep)
    units = tuple(_plan(d, layout.pp))
    shards = [
        (index, shard, _shard_numel(unit, d, layout.tp))
        for index, unit in enumerate(units)
        for shard in range(_shard_count(unit, layout.tp))
    ]
    loads = [0] * len(layout.coords)
    owner: dict[tuple[int, int], int] = {}
    for index, shard, size in sorted(shards, key=lambda x: -x[2]):  # stable: export order among equal sizes
        unit = units[index]
        holders = [
            r
            for r, (tp, pp, ep) in enumerate(layout.coords)
            if pp == unit.stage and (unit.kind == "replicated" or tp == shard) and unit.ep_owner in (None, ep)
        ]
        rank = min(holders, key=lambda r: (loads[r], r))
        loads[rank] += size
        owner[index, shard] = rank
    pieces = tuple(tuple((i, s) for i, s, _ in shards if owner[i, s] == rank) for rank in range(len(layout.coords)))
    return Plan(units, pieces, tuple(loads))


def owned_shards(
    model_chunks: list[torch.nn.Module],
    hf_config: Any,
    groups: ParallelGroups,
    plan: Plan,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """This rank's pieces of `plan` as (piece name, its local megatron shard in `dtype`, default the HF config's as
    the export). No collective: each rank reads its own parameters. The tensors may alias the live parameters: send
    or copy each before the optimizer steps."""
    d = _dims(hf_config, groups.ep_size)
    model = _stage_model(model_chunks, d, groups)
    params = model_tensors(model)
    dtype = dtype or _export_dtype(hf_config, next(model.parameters()).dtype)
    with torch.no_grad():
        for index, shard in plan.pieces[groups.rank]:
            unit = plan.units[index]
            yield piece_name(unit, shard), _find_param(params, unit).detach().to(unit.dtype(dtype))


class Assembler:
    """An engine rank's side: collects the pieces of one sync from every sender and rebuilds each full HF tensor as
    soon as its last piece arrives (only the pieces of parameters not yet complete are held).

    hf_config: the model's; tp: the actor's tensor-parallel size (the shard count of a split parameter)."""

    def __init__(self, hf_config: Any, tp: int, combine: Callable[[Assembler, _Unit, list], list] | None = None):
        self.d = _dims(hf_config)
        self.tp = tp
        self.combine = combine
        """How a complete parameter's pieces become what `add` returns: combine(self, unit, pieces in TP rank order);
        None: `unshard` (full tensors). The relay's forwarded deltas: rollout.delta.forward_unit."""
        self.units = {unit.hf_names[0]: unit for unit in _plan(self.d, 1)}  # HF names and kinds do not depend on PP/EP
        self.order = {name: i for i, name in enumerate(n for unit in self.units.values() for n in unit.hf_names)}
        """The export's order of the HF names (a sort key for what `add` returned)."""
        self.pieces: dict[tuple[str, int], Any] = {}
        self.done: set[str] = set()

    def add(self, name: str, shard: Any) -> list[tuple[str, Any]]:
        """One received piece (its name as `piece_name` gave it); returns the (hf_name, full tensor) pairs of its
        parameter when this was its last piece (the pieces are dropped; `combine` decides what is returned), else [].
        ValueError (one line) for a name no parameter has or a piece received twice."""
        key, sep, rank = name.rpartition(SHARD_SEP)
        unit = self.units.get(key)
        if not sep or unit is None or not rank.isdigit() or int(rank) >= _shard_count(unit, self.tp):
            raise ValueError(f"direct weight sync: received a piece {name!r} that no parameter of this model has "
                             f"at actor TP {self.tp}")  # fmt: skip
        if (key, int(rank)) in self.pieces or key in self.done:
            raise ValueError(f"direct weight sync: piece {name!r} received twice")
        self.pieces[key, int(rank)] = shard
        count = _shard_count(unit, self.tp)
        if any((key, r) not in self.pieces for r in range(count)):
            return []
        self.done.add(key)
        shards = [self.pieces.pop((key, r)) for r in range(count)]
        if self.combine is not None:
            return self.combine(self, unit, shards)
        return self.unshard(unit, shards)

    def unshard(self, unit: _Unit, shards: list[Tensor]) -> list[tuple[str, Tensor]]:
        """A parameter's (hf_name, full tensor) pairs from its pieces in TP rank order."""
        return list(zip(unit.hf_names, _unshard(unit.kind, shards, self.d), strict=True))

    def hf_positions(self, unit: _Unit, rank: int, index: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Flat positions `index` (int64) in TP rank `rank`'s piece of `unit` -> per HF tensor of the unit (in
        hf_names order): (which of `index` land in it, as a mask, their flat positions there). Worked out by cutting
        HF tensors of row (column, for a row-parallel weight) numbers with the converter's own `_shard`, so the map
        is its inverse by construction; the vocabulary's padding rows land nowhere."""
        shapes = unit.hf_shapes
        if unit.kind == "replicated":
            return [(torch.ones_like(index, dtype=torch.bool), index)]
        if unit.kind == "row":  # split along the columns: [rows, cols / tp] pieces
            cols = shapes[0][1]
            local = cols // self.tp
            return [(torch.ones_like(index, dtype=torch.bool), index // local * cols + rank * local + index % local)]
        width = int(torch.Size(shapes[0][1:]).numel())  # elements per row, alike for every HF tensor of the unit
        starts = [0]
        for shape in shapes:
            starts.append(starts[-1] + shape[0])
        codes = [  # row numbers from 1 (0: the padding _shard adds), as [rows, 1] (or [rows]) like the real tensors
            torch.arange(starts[j] + 1, starts[j + 1] + 1, dtype=torch.float64).reshape(-1, *([1] * (len(shape) > 1)))
            for j, shape in enumerate(shapes)
        ]
        piece_rows = _shard(unit.kind, codes, self.d, self.tp, rank).reshape(-1).long()
        row = piece_rows[index // width]
        out = []
        for j in range(len(shapes)):
            keep = (row > starts[j]) & (row <= starts[j + 1])
            out.append((keep, (row[keep] - 1 - starts[j]) * width + index[keep] % width))
        return out

    def finish(self) -> None:
        """The sync is over: ValueError (one line) naming the first piece no sender sent."""
        for key, unit in self.units.items():
            if key not in self.done:
                count = _shard_count(unit, self.tp)
                missing = next(r for r in range(count) if (key, r) not in self.pieces)
                raise ValueError(f"direct weight sync: no actor rank sent {key}{SHARD_SEP}{missing} (of {count})")
