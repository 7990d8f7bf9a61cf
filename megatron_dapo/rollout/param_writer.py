"""Writes full Hugging Face-named tensors into a transformers model's parameters in place: the receiving side of a
weight sync into the embedded engine (rollout/transformers_engine.py).

    begin() -> write(bucket)* -> end(full)
    a name resolves to its parameter (tied aliases to one), or to its rows of a fused MoE expert parameter; an FP8
    payload (rollout.weight_dtype "fp8": the float8 weight and its "_scale_inv") is dequantized once both halves
    are here, in whatever order or bucket; end(full=True) checks that every parameter arrived exactly as named.
    A changed-weights sync (rollout/delta.py) sends WeightDelta entries: each is applied only when the engine holds
    the version it was computed against, which only a completed delta-mode update sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_dapo.actor.arch import MoeNames
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.delta import WeightDelta
from megatron_dapo.rollout.delta import apply_delta

_QWEN_NAMES = MoeNames()


def fused_expert_rows(params: dict[str, Tensor], names: MoeNames = _QWEN_NAMES) -> dict[str, tuple[str, int, slice]]:
    """Per-expert checkpoint names of transformers' fused MoE experts (transformers 5: `mlp.experts.gate_up_proj`
    [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I], whatever the family; its conversion mapping
    merges the checkpoint's per-expert tensors into them on load) -> (fused parameter name, expert, rows). `names`:
    how the checkpoint names them (Qwen's `mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral's
    `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`: arch.moe_names). Models without fused experts give {}."""
    out: dict[str, tuple[str, int, slice]] = {}
    for name, p in params.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or p.dim() != 3:
            continue
        layer = prefix[: -len("mlp.experts")]  # "model.layers.{i}."
        if leaf == "gate_up_proj":
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[layer + names.expert(e, "gate")] = (name, e, slice(0, half))
                out[layer + names.expert(e, "up")] = (name, e, slice(half, None))
        elif leaf == "down_proj":
            for e in range(p.shape[0]):
                out[layer + names.expert(e, "down")] = (name, e, slice(None))
    return out


def _checkpoint_names(model: torch.nn.Module) -> MoeNames:
    """How the model's checkpoint names its MoE blocks (arch.moe_names of its config; Qwen's names for a model of a
    family the actor does not know)."""
    from megatron_dapo.actor.arch import moe_names

    try:
        return moe_names(model.config)
    except (AttributeError, ValueError):
        return _QWEN_NAMES


def _router_aliases(params: dict[str, Tensor], names: MoeNames) -> dict[str, str]:
    """{checkpoint name: parameter name} of routers the checkpoint names differently (Mixtral's
    `block_sparse_moe.gate.weight` is transformers 5's `mlp.gate.weight`)."""
    here = _QWEN_NAMES.router
    if names.router == here:
        return {}
    return {n[: -len(here)] + names.router: n for n in params if n.endswith("." + here)}


class ParameterWriter:
    """The HF names of one model's parameters and the sessions that write them.

    model: the transformers model (its parameters, and its persistent buffers such as GLM-4.5's
        e_score_correction_bias, are written in place, cast to their dtype and device).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_name = type(model).__name__
        self._params: dict[str, Tensor] = {}
        self._canonical: dict[str, str] = {}
        first_name: dict[int, str] = {}
        stored = model.state_dict(keep_vars=True)
        buffers = [(n, b) for n, b in model.named_buffers() if n in stored]  # persistent: GLM-4.5's router bias
        for name, p in [*model.named_parameters(remove_duplicate=False), *buffers]:
            canonical = first_name.setdefault(id(p), name)
            self._params[name] = p
            self._canonical[name] = canonical
        names = _checkpoint_names(model)
        self._experts = fused_expert_rows(self._params, names)
        self._aliases = _router_aliases(self._params, names)
        fused = {param for param, _, _ in self._experts.values()} | set(self._aliases.values())
        self.parameter_names = frozenset(set(first_name.values()) - fused | set(self._experts) | set(self._aliases))
        """The names a full update must bring: one per parameter (tied aliases once), per expert for fused ones."""
        self._received: set[str] | None = None
        self._fp8_pending: dict[str, dict[str, Tensor]] = {}  # FP8 weights waiting for their scale (or vice versa)
        self.version: int | None = None
        """The delta-mode sync whose update completed last (None: none, or plain tensors or an unfinished session
        since): the only base a WeightDelta may apply to."""
        self._base: int | None = None  # the version held when this session began
        self._session: int | None = None  # the delta-mode version this session writes

    def target(self, name: str) -> Tensor | None:
        """The tensor an HF name writes into (a view of a fused expert parameter for per-expert names), or None."""
        if name in self._experts:
            param, expert, rows = self._experts[name]
            return self._params[param][expert, rows]
        return self._params.get(self._aliases.get(name, name))

    def begin(self) -> None:
        """Open a session: `end` checks what arrived since. Until it completes the engine holds no version (a session
        that never ends leaves a mix no delta may build on)."""
        self._base = self.version if self._received is None else None
        self.version = self._session = None
        self._received = set()
        self._fp8_pending = {}

    @torch.no_grad()
    def write(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into the parameters; each tensor has the parameter's full shape, any float
        dtype / device, or is one half of an FP8 weight (rollout/fp8.py). Raises WeightUpdateError naming the tensor
        on an unknown name or a shape mismatch."""
        from megatron_dapo.rollout.fp8 import SCALE_SUFFIX

        cls = self.model_name
        for name, tensor in bucket:
            base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
            if base is not None and self.target(base) is not None:
                self._fp8_part(base, "scale_inv", tensor)
                continue
            target = self.target(name)
            if isinstance(tensor, WeightDelta):
                self._write_delta(name, target, tensor)
                continue
            if target is None:
                raise WeightUpdateError(
                    f"update_weights: unknown tensor {name!r} (not a parameter of {self.model_name})"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(
                    f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, {cls} expects "
                    f"{tuple(target.shape)}"
                )
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                self._fp8_part(name, "q", tensor)
                continue
            self._copy_in(name, tensor)

    def _write_delta(self, name: str, target: Tensor | None, delta: WeightDelta) -> None:
        """One WeightDelta: the full tensor (base None) or its changed elements, on the version they were computed
        against only."""
        if target is None:
            raise WeightUpdateError(f"update_weights: unknown tensor {name!r} (not a parameter of {self.model_name})")
        if delta.base is not None and delta.base != self._base:
            held = "no version" if self._base is None else f"version {self._base}"
            raise WeightUpdateError(
                f"update_weights: tensor {name!r} is a delta against weight version {delta.base} but the engine holds "
                f"{held}: a full sync is needed"
            )
        if self._session not in (None, delta.version):
            raise WeightUpdateError(
                f"update_weights: tensor {name!r} belongs to weight version {delta.version}, this update writes "
                f"version {self._session}"
            )
        self._session = delta.version
        if delta.index is None:
            self.write([(name, delta.values)])
            return
        apply_delta(target, delta)
        self._received.add(self._canonical.get(name, name))

    def note_written(self, names: Sequence[str]) -> None:
        """HF names written into the parameters by other means during this session (a custom loader writing changed
        elements in place: the CPU SGLang stand-in's delta loader): `end` counts them as received."""
        if self._received is not None:
            self._received.update(self._canonical.get(n, n) for n in names)

    def _copy_in(self, name: str, tensor: Tensor) -> None:
        self.target(name).copy_(tensor)
        if self._received is not None:
            self._received.add(self._canonical.get(name, name))

    def _fp8_part(self, name: str, part: str, tensor: Tensor) -> None:
        """Hold one half of an FP8 weight (q or scale_inv); dequantize into the parameter when both are here."""
        from megatron_dapo.rollout.fp8 import dequantize_block_fp8

        pending = self._fp8_pending.setdefault(name, {})
        pending[part] = tensor
        if len(pending) == 2:
            del self._fp8_pending[name]
            try:
                weight = dequantize_block_fp8(pending["q"], pending["scale_inv"], self.target(name).dtype)
            except ValueError as err:
                raise WeightUpdateError(f"update_weights: tensor {name!r}: {err}") from None
            self._copy_in(name, weight)

    def end(self, *, full: bool = True) -> None:
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
        self.version = self._session if full else None
