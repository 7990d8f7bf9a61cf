"""Changed-weights (delta) sync applied inside an SGLang server: a custom weight loader for its
`/update_weights_from_tensor` route.

SGLang 0.5.23 plugs a custom loader in at one place (model_runner_components/weight_updater.py,
`update_weights_from_tensor`): a `load_format` listed in the server's `--custom-weight-loader` is imported and called
as `loader(model, named_tensors)` on every TP rank, with that rank's own entry of `serialized_named_tensors`
(tp_worker.deserialize_own_rank), its tensors already moved to the rank's device. The payload is unpickled by SGLang's
SafeUnpickler, which admits a plainly pickled CPU tensor (torch._utils._rebuild_tensor_v2, its storage through
torch.load(weights_only=True)): the values travel in the HTTP body, so this works across hosts (ForkingPickler's
CUDA-IPC handles only work on the server's host). `update_weights_from_distributed` (the NCCL broadcast) always
calls `model.load_weights` with full tensors; it cannot take a delta.

    sender (SGLangServerEngine, request_body)              each server TP rank (load_weights here)
    [PUSH: (version, base, end)] + delta pairs             PUSH first: a delta against a version this rank does not
      (rollout/delta.as_plain_tensors) and full tensors      hold is refused (one line); the first call of a push
                                                             forgets the version held, the call with `end` sets it
                                                           full tensor: model.load_weights, as SGLang loads it
                                                           delta of name: its elements written in place, where
                                                             model.load_weights would put them (a traced placement)

Where an element lands is the model's own business (merged qkv / gate_up parameters, the TP rank's rows or columns,
vocabulary padding): the first delta of each name runs `model.load_weights([(name, probe)])` with a float64 probe
holding each element's flat index, under a TorchFunctionMode that records every `copy_` / `__setitem__` into a
parameter (the destination positions, and the probe values that land there) and performs none of them, so the model
is not touched. A second probe (3 * index + 1) must decode to the same placement, so a load that scales, offsets or
narrows the values is caught. Constant fills (vocabulary padding) are skipped: a full load writes the same constant
each time. Any other write into a parameter, a source that is not the probe, or an element placed twice is refused
with one line naming the tensor: such a name must go full. The placement is kept per name as runs (HF start,
parameter start, length), one per contiguous block: a row shard is one run, a column shard one per row. Tracing
costs two float64 copies of the tensor in host memory, once per name.

A refusal is an exception in the server's scheduler, which SGLang 0.5.23 does not catch (the request dispatch in
managers/scheduler.py has no handler; a custom loader's return value is ignored): the server exits rather than serve a
mix. So the sender must not rely on it: our encoder sends a delta only after a push it completed with these servers (a
failed push, a new job, a resume: the next push is full), and the loader's check is reached only by a server
restarted under a running job, which on the rank-0 route is lost anyway (its weight-update group is gone).

Used by rollout.weight_sync_delta with SGLang servers on the rank-0 route and in a colocated launch (the relaying
engine ranks of the direct route decode and push full tensors instead): docs/rollout.md, "Weight sync routes".

Exactness: an element is written with `values.to(param.dtype)`, what `copy_` writes in a full load; an element a
delta leaves out already holds that value (rollout/delta.py).
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from megatron_dapo.rollout.delta import INDEX_SUFFIX
from megatron_dapo.rollout.delta import MASK_SUFFIX
from megatron_dapo.rollout.delta import VALUES_SUFFIX
from megatron_dapo.rollout.delta import wire_positions

LOADER = f"{__name__}.load_weights"
"""The dotted path SGLang imports: its `--custom-weight-loader` value and the request's `load_format`."""

PUSH = "__megatron_dapo_push__"
"""The first entry of every call: int64 [version, base (-1: none), end (0/1), leader_only (0/1)]. leader_only: the
request carries the entries for TP rank 0 only (the other ranks' payloads are this entry alone) and rank 0 hands
them to the others over SGLang's TP group (GroupCoordinator.broadcast_tensor_dict: NCCL on GPU), so the HTTP body
holds them once instead of once per TP rank."""

FP8_BITS_SUFFIX = ".__e4m3fn_bits__"
"""`name + FP8_BITS_SUFFIX`: a float8_e4m3fn tensor (rollout.weight_dtype "fp8": the weights and their delta values)
as its uint8 bits. SGLang's SafeUnpickler reads a pickled tensor's storage with torch.load(weights_only=True), whose
legacy format has no storage type for float8 (torch 2.13: "UntypedStorage has no attribute dtype"), so float8 values
travel as their bytes and are viewed back on the server (bit for bit)."""

SHAPE_SUFFIX = ".__delta_shape__"
"""`name + SHAPE_SUFFIX`: int64 [ndim], `name`'s HF shape, sent before each delta pair of `name`: the placement is
traced on it the first time."""


@dataclass
class _Placement:
    """Where one HF tensor's elements land in one parameter: runs of `length` consecutive elements from HF flat index
    `hf_start` to the parameter's flat position `local_start` (int64 [r] each, sorted by hf_start, on CPU)."""

    param: str
    hf_start: Tensor
    local_start: Tensor
    length: Tensor


@dataclass
class _State:
    """Per model (one per server TP rank): the version this rank holds, the push in progress, the traced placements."""

    held: int | None = None
    pushing: int | None = None
    placements: dict[str, list[_Placement]] = field(default_factory=dict)


class UntraceableLoad(ValueError):
    """The model's load_weights does not place `name` by plain copies: a delta of it cannot be applied here."""


class _Trace(TorchFunctionMode):
    """Records the copies into parameters during one load_weights call instead of performing them."""

    def __init__(self, name: str, params: dict[str, Tensor]) -> None:
        super().__init__()
        self.name = name
        self.by_storage: dict[int, list[tuple[str, Tensor]]] = {}
        for pname, p in params.items():
            self.by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((pname, p))
        self.hits: dict[str, list[tuple[Tensor, Tensor]]] = {}

    def _owner(self, t: Any) -> list[tuple[str, Tensor]] | None:
        if not isinstance(t, Tensor) or t.device.type == "meta":
            return None
        return self.by_storage.get(t.untyped_storage().data_ptr())

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        owners = self._owner(target)
        if owners is None:
            return func(*args, **kwargs)
        fname = getattr(func, "__name__", str(func))
        if fname == "__setitem__":
            dst, src = target[args[1]], args[2]
            if dst.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
                raise UntraceableLoad(f"sglang loader: {self.name}: written by advanced indexing")
            self._record(owners, dst, src)
            return None
        if fname == "copy_":
            self._record(owners, target, args[1])
            return target
        # A constant (padding): the same in every load. SGLang's default loader also fills a one-element parameter
        # from the tensor's value, but such a tensor never goes as a delta (its index would outweigh it).
        if fname in ("fill_", "zero_"):
            return target
        if (fname.endswith("_") and not fname.startswith("__")) or fname == "__set__":
            raise UntraceableLoad(f"sglang loader: {self.name}: written by {fname}, not a copy")
        return func(*args, **kwargs)

    def _record(self, owners: list[tuple[str, Tensor]], dst: Tensor, src: Any) -> None:
        if not isinstance(src, Tensor) or src.dtype != torch.float64:
            got = src.dtype if isinstance(src, Tensor) else type(src).__name__
            raise UntraceableLoad(f"sglang loader: {self.name}: a parameter is written from {got}, not the tensor")
        values = src.detach().to("cpu").expand(dst.shape).reshape(-1)
        for pname, p in owners:
            offset = dst.storage_offset() - p.storage_offset()
            if p.dtype != dst.dtype or offset < 0:
                continue
            try:  # dst's positions within p (out of p's bounds: another parameter on the same storage)
                local = torch.arange(p.numel()).as_strided(dst.shape, dst.stride(), offset).reshape(-1)
            except RuntimeError:
                continue
            self.hits.setdefault(pname, []).append((local, values))
            return
        raise UntraceableLoad(f"sglang loader: {self.name}: written into a view no parameter holds")


def _runs(name: str, pname: str, local: Tensor, hf: Tensor) -> _Placement:
    """Compress (parameter position, HF index) pairs into runs; refuse an element placed twice."""
    hf, order = torch.sort(hf)
    local = local[order]
    if hf.numel() > 1 and ((hf[1:] == hf[:-1]).any() or local.unique().numel() != local.numel()):
        raise UntraceableLoad(f"sglang loader: {name}: {pname} holds an element twice")
    brk = torch.ones(hf.numel(), dtype=torch.bool)
    brk[1:] = (hf[1:] - hf[:-1] != 1) | (local[1:] - local[:-1] != 1)
    starts = torch.nonzero(brk).reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([hf.numel()])])
    return _Placement(pname, hf[starts], local[starts], ends - starts)


_PROBES = ((1.0, 0.0), (3.0, 1.0))
"""Two encodings of element i, scale * i + shift: a load that copies decodes both to the same i; one that computes
(a scale, an offset, a cast to a narrower dtype) cannot agree with both."""


def _traced(model: Any, name: str, shape: tuple[int, ...], numel: int, scale: float, shift: float) -> dict:
    """One traced load of a probe: {parameter: (its positions, the HF indices decoded from what landed there)}."""
    probe = (torch.arange(numel, dtype=torch.float64) * scale + shift).reshape(shape)
    trace = _Trace(name, dict(model.named_parameters()))
    with torch.no_grad(), trace:
        model.load_weights([(name, probe)])
    out = {}
    for pname, hits in trace.hits.items():
        local = torch.cat([h[0] for h in hits])
        decoded = (torch.cat([h[1] for h in hits]) - shift) / scale
        hf = decoded.round().long()
        if not torch.equal(hf.double(), decoded) or (hf < 0).any() or (hf >= numel).any():
            raise UntraceableLoad(f"sglang loader: {name}: {pname} is computed from the tensor, not copied")
        out[pname] = (local, hf)
    return out


def trace_placements(model: Any, name: str, shape: Sequence[int]) -> list[_Placement]:
    """Where model.load_weights([(name, tensor of `shape`)]) writes each element, on this rank (nothing on a rank
    that holds none of it); the model is left as it was. UntraceableLoad (one line) for anything but plain copies."""
    shape = tuple(int(s) for s in shape)
    numel = int(torch.tensor(shape).prod()) if shape else 1
    first, second = (_traced(model, name, shape, numel, *probe) for probe in _PROBES)
    for pname, (local, hf) in first.items():
        other = second.get(pname)
        if other is None or not (torch.equal(local, other[0]) and torch.equal(hf, other[1])):
            raise UntraceableLoad(f"sglang loader: {name}: {pname} is computed from the tensor, not copied")
    return [_runs(name, pname, local, hf) for pname, (local, hf) in first.items()]


def apply_placed(params: dict[str, Tensor], placements: list[_Placement], index: Tensor, values: Tensor) -> int:
    """Write `values` ([k], any dtype) at HF flat positions `index` ([k], any order: an engine rank forwarding the
    pieces' changes sends them piece by piece) into the parameters the placements name; returns how many elements
    this rank holds."""
    index = index.to("cpu", torch.int64)
    written = 0
    for pl in placements:
        run = torch.searchsorted(pl.hf_start, index, right=True) - 1
        safe = run.clamp(min=0)
        offset = index - pl.hf_start[safe]
        mine = (run >= 0) & (offset < pl.length[safe])
        if not bool(mine.any()):
            continue
        param = params[pl.param]
        positions = (pl.local_start[safe[mine]] + offset[mine]).to(param.device)
        param.data.view(-1)[positions] = values[mine.to(values.device)].to(device=param.device, dtype=param.dtype)
        written += int(mine.sum())
    return written


def _state(model: Any) -> _State:
    state = model.__dict__.get("_megatron_dapo_delta")
    if state is None:
        state = model.__dict__["_megatron_dapo_delta"] = _State()
    return state


def load_weights(model: Any, named_tensors: list[tuple[str, Tensor]]) -> None:
    """SGLang's custom-loader call on one TP rank (`--custom-weight-loader` LOADER): named_tensors = [(PUSH, int64
    [version, base, end])] + delta pairs (name + INDEX_SUFFIX: int32/int64 [k] or name + MASK_SUFFIX: its bitmap,
    then name + VALUES_SUFFIX: [k]) and full tensors, in any mix; float8 tensors as their bytes (FP8_BITS_SUFFIX).
    ValueError (one line; SGLang answers the request with it) on a push against a version this rank does not hold,
    a malformed call, or a name whose placement cannot be traced."""
    if not named_tensors or named_tensors[0][0] != PUSH:
        raise ValueError(f"sglang loader: the call does not start with {PUSH}")
    version, base, end, leader_only = (int(v) for v in named_tensors[0][1].tolist())
    if leader_only:
        named_tensors = _from_tp_leader(named_tensors)
    named_tensors = [_from_wire(name, t) for name, t in named_tensors]
    state = _state(model)
    if state.pushing != version:
        if base >= 0 and state.held != base:
            held = "no version" if state.held is None else f"version {state.held}"
            raise ValueError(f"sglang loader: push {version} is a delta against version {base} but this server "
                             f"holds {held}")  # fmt: skip
        state.held, state.pushing = None, version
    params = dict(model.named_parameters())
    index: tuple[str, Tensor] | None = None
    with torch.no_grad():
        for name, tensor in named_tensors[1:]:
            positions = wire_positions(name, tensor)
            if positions is not None:
                index = positions
            elif name.endswith(VALUES_SUFFIX):
                name = name[: -len(VALUES_SUFFIX)]
                if index is None or index[0] != name:
                    raise ValueError(f"sglang loader: delta values of {name!r} without its index")
                if name not in state.placements:
                    raise ValueError(f"sglang loader: a delta of {name!r} before its shape is known (send "
                                     f"{name + SHAPE_SUFFIX} first)")  # fmt: skip
                apply_placed(params, state.placements[name], index[1], tensor)
                index = None
            elif name.endswith(SHAPE_SUFFIX):
                name = name[: -len(SHAPE_SUFFIX)]
                if name not in state.placements:
                    state.placements[name] = trace_placements(model, name, tensor.tolist())
            else:
                model.load_weights([(name, tensor)])
    if end:
        state.held, state.pushing = version, None


def _from_tp_leader(named_tensors: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """A leader_only call on every TP rank: rank 0's entries, broadcast over SGLang's TP group (every rank of the
    server runs the same request, so all of them are here)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    mine = dict(named_tensors[1:]) if group.rank_in_group == 0 else None
    got = group.broadcast_tensor_dict(mine, src=0)
    return [named_tensors[0], *got.items()]


def _to_wire(name: str, t: Tensor) -> tuple[str, Tensor]:
    """One entry as request_body pickles it: a float8_e4m3fn tensor as its uint8 bits under FP8_BITS_SUFFIX."""
    return (name + FP8_BITS_SUFFIX, t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn else (name, t)


def _from_wire(name: str, t: Tensor) -> tuple[str, Tensor]:
    """_to_wire undone on the server: FP8_BITS_SUFFIX entries viewed back as float8_e4m3fn."""
    if name.endswith(FP8_BITS_SUFFIX):
        return name[: -len(FP8_BITS_SUFFIX)], t.view(torch.float8_e4m3fn)
    return name, t


def carried_names(named_tensors: Sequence[tuple[str, Tensor]]) -> list[str]:
    """The HF names a loader call writes (its full tensors and deltas; not PUSH, not the shapes)."""
    out = []
    for name, t in named_tensors:
        name, _ = _from_wire(name, t)
        if name == PUSH or name.endswith((SHAPE_SUFFIX, INDEX_SUFFIX, MASK_SUFFIX)):
            continue
        out.append(name[: -len(VALUES_SUFFIX)] if name.endswith(VALUES_SUFFIX) else name)
    return out


def request_body(entries: Sequence[tuple[str, Tensor]], *, version: int, base: int | None, end: bool,
                 server_tp: int) -> dict:  # fmt: skip
    """The body of one /update_weights_from_tensor call carrying `entries` to every TP rank of a server (body_bytes
    makes its JSON: the payloads are base64 bytes), the CPU tensors pickled by value: in TP rank 0's payload only,
    the others' hold the PUSH entry (leader_only), so the body carries the entries once (each rank keeps the
    elements it holds)."""
    leader_only = server_tp > 1 and bool(entries)
    push = torch.tensor([version, -1 if base is None else base, int(end), int(leader_only)], dtype=torch.int64)
    payload = [(PUSH, push)]
    for name, t in entries:
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # pickle carries the whole storage: a view would send its base
        payload.append(_to_wire(name, t))
    leader = base64.b64encode(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    others = base64.b64encode(pickle.dumps(payload[:1], protocol=pickle.HIGHEST_PROTOCOL))
    blobs = [leader] + [others if leader_only else leader] * (server_tp - 1)
    return {"serialized_named_tensors": blobs, "load_format": LOADER, "flush_cache": False}


def body_bytes(body: dict) -> bytes:
    """A request_body as JSON bytes, the base64 payloads joined in as they are (they need no escaping; json.dumps
    would scan every character of them: most of the sender's time for a large delta)."""
    parts = [b'{"serialized_named_tensors": ["']
    for i, blob in enumerate(body["serialized_named_tensors"]):
        parts += [b'", "'] if i else []
        parts.append(blob if isinstance(blob, bytes) else blob.encode())
    rest = json.dumps({k: v for k, v in body.items() if k != "serialized_named_tensors"}).encode()
    parts.append(b'"], ' + rest[1:] if rest != b"{}" else b'"]}')
    return b"".join(parts)
