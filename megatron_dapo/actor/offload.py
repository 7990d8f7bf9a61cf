"""Actor offload: parameters, gradients and optimizer state to host memory between actor phases, and back.

    part        what it is (megatron-core 0.16.1 as actor/actor.py builds it)
    params      the model's parameters: with the distributed optimizer views of DDP's param buffer
                (_ParamAndGradBuffer.param_data), else one storage per parameter
    grads       DDP's grad buffers (_ParamAndGradBuffer.grad_data; param.main_grad are views of it) and any .grad
    optimizer   the inner torch optimizer: its parameters (the fp32 main params of a bf16 model, shards of them
                with the distributed optimizer) and its state (Adam's exp_avg, exp_avg_sq)

The move works on storages, not on tensors: every tensor of a part is a view of some storage, so copying each
storage's bytes to a host buffer and shrinking the storage to 0 bytes frees the device memory while every view
(param.data, param.main_grad, bucket views, the optimizer's shard views) stays the same Python object and points at
the same storage again after the reload. Aliasing is kept: a storage belongs to the first part that names it
(params, grads, optimizer), e.g. the main params of an fp32 model are views of the param buffer, so they move with
"params", never twice. Each part has one host buffer of exactly its size, page-locked on CUDA (cudaHostRegister:
asynchronous copies), reused across steps while the part's storages stay the same.

On CPU there is no device memory to free: release="poison" (the CPU default) copies to the host buffer the same way,
then overwrites the storage with 0xFF bytes (NaN in every float dtype) instead of freeing it, so a phase that runs
on offloaded state produces NaN, and the reload must really restore every byte. release="free" is what CUDA uses
(storage.resize_(0), as megatron's own _ParamAndGradBuffer.offload_to_cpu does); reading a freed view is undefined.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.memory import PARTS


def _as_bytes(storage: torch.UntypedStorage) -> Tensor:
    """A uint8 tensor [nbytes] over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ActorOffloader:
    """Moves the parts of an actor (PARTS) between its device and host memory.

    model: the DDP-wrapped model chunks; optimizer: the megatron optimizer (chained or not); device: the actor's
    device (only storages on it move). release: "free" or "poison" (module docstring); None picks "free" on CUDA,
    "poison" elsewhere.
    """

    def __init__(self, model: Sequence[Any], optimizer: Any, device: torch.device, release: str | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.release = release or ("free" if self.device.type == "cuda" else "poison")
        if self.release not in ("free", "poison"):
            raise ValueError(f"ActorOffloader.release: must be 'free' or 'poison', got {self.release!r}")
        self._moved: dict[str, list[tuple[torch.UntypedStorage, Tensor]]] = {}
        self._host: dict[str, _HostBuffer] = {}  # part -> its host buffer, reused while the part's storages stay

    # --------------------------------------------------------------------------------------------- collection
    def _part_tensors(self, part: str) -> Iterator[Tensor]:
        if part == "params":
            for chunk in self.model:
                yield from chunk.parameters()
        elif part == "grads":
            for chunk in self.model:
                # DDP's gradient buffers (lists); a model without DDP (the frozen reference) has none, and its
                # `buffers` is nn.Module.buffers, a method.
                ddp = [getattr(chunk, name, None) for name in ("buffers", "expert_parallel_buffers")]
                for buffer in [b for bufs in ddp if isinstance(bufs, list | tuple) for b in bufs]:
                    if getattr(buffer, "grad_data", None) is not None:
                        yield buffer.grad_data
                for p in chunk.parameters():
                    if p.grad is not None:
                        yield p.grad
        else:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner = getattr(opt, "optimizer", None)
                if inner is None:
                    continue
                for group in inner.param_groups:
                    for p in group["params"]:
                        yield p
                        if p.grad is not None:
                            yield p.grad
                for state in inner.state.values():
                    yield from (v for v in state.values() if isinstance(v, Tensor))

    def storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """Every device storage of each part, now (Adam's state appears at the first step; a checkpoint load may
        replace it), each storage listed under the first part that holds a view of it."""
        seen: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {}
        for part in PARTS:
            out[part] = []
            for t in self._part_tensors(part):
                if t.device != self.device:
                    continue
                s = t.untyped_storage()
                if s._cdata in seen:  # the storage's identity (one StorageImpl, many wrappers)
                    continue
                seen.add(s._cdata)
                out[part].append(s)
        return out

    # --------------------------------------------------------------------------------------------- moves
    @property
    def offloaded(self) -> tuple[str, ...]:
        """Parts now in host memory, in PARTS order."""
        return tuple(p for p in PARTS if p in self._moved)

    def device_bytes(self) -> dict[str, int]:
        """Bytes each part holds on the device now (0 for an offloaded part; poisoned storages count as 0)."""
        current = self.storages()
        return {p: 0 if p in self._moved else sum(s.nbytes() for s in current[p]) for p in PARTS}

    def offload(self, parts: Iterable[str]) -> int:
        """Copy the parts' storages to host memory and release them on the device; returns the bytes moved.
        Parts already offloaded are skipped."""
        todo = [p for p in _checked(parts) if p not in self._moved]
        if not todo:
            return 0
        current = self.storages()
        pin = self.device.type == "cuda"
        moved = 0
        for part in todo:
            storages = [s for s in current[part] if s.nbytes() > 0]
            key = tuple((s._cdata, s.nbytes()) for s in storages)
            buf = self._host.get(part)
            if buf is None or buf.key != key:  # first offload, or the state changed (e.g. a checkpoint load)
                if buf is not None:
                    buf.release()
                buf = self._host[part] = _HostBuffer(key, pin)
            pairs, offset = [], 0
            for s in storages:
                n = s.nbytes()
                host = buf.tensor[offset : offset + n]
                host.copy_(_as_bytes(s), non_blocking=buf.pinned)
                pairs.append((s, host))
                offset += n
            self._moved[part] = pairs
            moved += offset
        if pin:
            torch.cuda.synchronize(self.device)  # the copies must finish before the memory is released
        for part in todo:
            for s, _ in self._moved[part]:
                if self.release == "free":
                    s.resize_(0)
                else:
                    _as_bytes(s).fill_(0xFF)
        return moved

    def reload(self, parts: Iterable[str] | None = None) -> int:
        """Bring offloaded parts (None: all of them) back to the device, byte for byte; returns the bytes moved."""
        todo = [p for p in (_checked(parts) if parts is not None else PARTS) if p in self._moved]
        moved = 0
        for part in todo:
            pinned = self._host[part].pinned
            for s, host in self._moved.pop(part):
                if s.nbytes() != host.numel():
                    s.resize_(host.numel())
                _as_bytes(s).copy_(host, non_blocking=pinned)
                moved += host.numel()
        if self.device.type == "cuda" and todo:
            torch.cuda.synchronize(self.device)  # the host buffers may be overwritten by the next offload
        return moved


class _HostBuffer:
    """One host buffer per part, exactly as large as the part's storages (key: their ids and sizes), page-locked on
    CUDA with cudaHostRegister. Not torch's pinned allocator: it rounds every allocation up to a power of two
    (CachingHostAllocator.h, PowerOf2Ceil; up to 2x the host memory for tens of GiB)."""

    def __init__(self, key: tuple[tuple[int, int], ...], pin: bool) -> None:
        self.key = key
        self.tensor = torch.empty(sum(n for _, n in key), dtype=torch.uint8)
        self.pinned = False
        if pin and self.tensor.numel():
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
            if rc != cudart.cudaError.success:
                raise RuntimeError(
                    f"actor.offload: cudaHostRegister of {self.tensor.numel() / 2**30:.2f} GiB of host memory failed "
                    f"({rc!r}); raise the locked-memory limit (ulimit -l) or set actor.offload=none"
                )
            self.pinned = True

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def _checked(parts: Iterable[str]) -> list[str]:
    out = list(parts)
    for p in out:
        if p not in PARTS:
            raise ValueError(f"actor offload: unknown part {p!r} (expected one of {PARTS})")
    return out
