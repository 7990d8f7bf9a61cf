"""HF <-> Megatron weights: load an HF safetensors checkpoint into this rank's shards; export full HF tensors.

API:
    load_hf_into_model(model_chunks, hf_dir, hf_config, groups) -> None
    export_hf_weights(model_chunks, hf_config, groups, *, bucket_bytes=None, dtype=None, dst_rank=None)
        -> Iterator[tuple[str, Tensor]]
    hf_state_dict_keys(hf_config) -> list[str]     the names export yields, in order (= HF safetensors keys)

Layouts (megatron local spec names; the TE spec's fused layer_norm_weight names are accepted too):
    model.embed_tokens.weight [V, H]            embedding.word_embeddings.weight  [Vp/tp, H] rows, zero padded
    layers.i.self_attn.{q,k,v}_proj.{weight,bias}
                                                decoder.layers.j.self_attention.linear_qkv.{weight,bias}: per KV
                                                group g: [q heads of g | k_g | v_g] rows, groups split over TP
    layers.i.self_attn.o_proj.weight            ...linear_proj.weight     columns split over TP
    layers.i.mlp.{gate,up}_proj.weight          ...mlp.linear_fc1.weight  TP rank r holds [gate_r ; up_r]
    layers.i.mlp.down_proj.weight               ...mlp.linear_fc2.weight  columns split over TP
    layers.i.{input,post_attention}_layernorm   ...input_layernorm / pre_mlp_layernorm (replicated)
    MoE layers (Qwen3-MoE, Qwen2-MoE, Mixtral), instead of the dense mlp.{gate,up,down}_proj (Mixtral's checkpoint
    names: block_sparse_moe.gate, block_sparse_moe.experts.g.{w1,w3,w2} for gate, up, down; arch.MoeNames):
    layers.i.mlp.gate.weight [E, H]             ...mlp.router.weight      (replicated)
    layers.i.mlp.experts.g.{gate,up}_proj       ...mlp.experts.local_experts.k.linear_fc1.weight (TE grouped GEMM:
                                                mlp.experts.linear_fc1.weight{k}) on EP rank g // (E/ep), k = g mod
                                                E/ep; [gate_r ; up_r] per TP rank like the dense fc1
    layers.i.mlp.experts.g.down_proj            ...local_experts.k.linear_fc2.weight (linear_fc2.weight{k}), columns
    layers.i.mlp.shared_expert.*, shared_expert_gate.weight [1, H]
                                                ...mlp.shared_experts.linear_fc1 / linear_fc2 / gate_weight
    model.norm.weight                           decoder.final_layernorm.weight (last stage)
    lm_head.weight [V, H] (untied only)         output_layer.weight       [Vp/tp, H] rows (last stage)
Pipeline stage s holds layers [s*L/pp, (s+1)*L/pp) under local indices j = i - s*L/pp. Tied models
(tie_word_embeddings) have no lm_head.weight; with pp > 1 the last stage's output_layer.weight is a second copy
of the embedding and is loaded from model.embed_tokens.weight.

Export (dst_rank=None): EVERY rank of every model-parallel group yields EVERY tensor, in the same order
(hf_state_dict_keys): the stage that owns a bucket gathers it over tp_group (all_gather), then broadcasts it over
pp_group from that stage. Data-parallel replicas do the same independently, so a caller that pushes weights to an
engine usually consumes the iterator on all ranks (they must all iterate: the gathers are collectives) and sends
from one rank (e.g. groups.rank == 0). A bucket is one transformer layer (or the embedding, or final norm +
lm_head) when bucket_bytes is None, else consecutive tensors of one stage up to bucket_bytes; only one bucket of
gathered tensors is held at a time. Routed experts are gathered over TP by their EP rank and broadcast over the EP
group (one broadcast per owner and bucket). Tensors are in HF's dtype (hf_config.dtype / torch_dtype) unless `dtype` is
given, with the vocab padding stripped. Export with dst_rank=r (an HF checkpoint written by rank r): only r
yields; the ranks of r's model-parallel group gather each bucket's TP shards to the rank of that stage in r's
pipeline, which sends it to r when the stage is not r's; other data-parallel replicas do nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.actor.arch import MlaShape
from megatron_dapo.actor.arch import MoeNames
from megatron_dapo.actor.arch import MoeShape
from megatron_dapo.actor.arch import has_qk_norm
from megatron_dapo.actor.arch import has_qkv_bias
from megatron_dapo.actor.arch import mla_shape
from megatron_dapo.actor.arch import moe_layer
from megatron_dapo.actor.arch import moe_names
from megatron_dapo.actor.arch import moe_shape
from megatron_dapo.actor.arch import mtp_layers
from megatron_dapo.actor.model import padded_vocab_size

if TYPE_CHECKING:
    from megatron_dapo.actor.distributed import ParallelGroups

# kind: how a megatron parameter is split over TP and how it maps to its HF tensors.
#   replicated  same tensor on every TP rank          column  rows split          row  columns split
#   qkv         q/k/v interleaved per KV group, rows split           fc1  [gate_r ; up_r] per rank
#   vocab       rows split after zero-padding the vocabulary


@dataclass(frozen=True)
class _Unit:
    """One megatron parameter and the HF tensors it holds."""

    stage: int
    block: str  # bucket boundary when bucket_bytes is None: "embed", "layer.{i}" or "final"
    mcore: tuple[str, ...]  # accepted megatron names (local spec first, then TE spec)
    kind: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    layer: int | None = None  # global layer index (checked against TransformerLayer.layer_number)
    ep_owner: int | None = None  # routed expert: the expert-parallel rank holding it (None: every EP rank)

    @property
    def fp32(self) -> bool:
        """Exported in fp32 whatever the export dtype: GLM-4.5's router expert bias (a megatron fp32 buffer; HF
        keeps e_score_correction_bias in fp32 too: a bf16 bias would change which experts a token picks)."""
        return self.mcore[0].endswith(FP32_TENSORS)

    def dtype(self, out_dtype: torch.dtype) -> torch.dtype:
        """The dtype this unit's HF tensors are exported in."""
        return torch.float32 if self.fp32 else out_dtype


FP32_TENSORS = ("mlp.router.expert_bias",)
"""Megatron tensors exported in fp32 (`_Unit.fp32`)."""


@dataclass(frozen=True)
class _Dims:
    vocab: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    layers: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoeShape | None = None
    ep: int = 1  # expert-parallel size (the experts of each MoE layer split into ep contiguous ranges)
    names: MoeNames = MoeNames()  # the checkpoint's names of an MoE block (Mixtral: block_sparse_moe, w1 / w3 / w2)
    mla: MlaShape | None = None  # multi-latent attention (DeepSeek-V3)


def _dims(hf_config: Any, ep: int = 1) -> _Dims:
    heads = hf_config.num_attention_heads
    return _Dims(
        vocab=hf_config.vocab_size,
        hidden=hf_config.hidden_size,
        ffn=hf_config.intermediate_size,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        layers=hf_config.num_hidden_layers,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=has_qkv_bias(hf_config),
        qk_norm=has_qk_norm(hf_config),
        moe=moe_shape(hf_config),
        ep=ep,
        names=moe_names(hf_config),
        mla=mla_shape(hf_config),
    )


def _layer_units(d: _Dims, i: int, stage: int, j: int) -> list[_Unit]:
    """Units of global layer i, held by `stage` as its local layer j."""
    h, q, kv, f = d.hidden, d.heads * d.head_dim, d.groups * d.head_dim, d.ffn
    qkv_w = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
    qkv_b = tuple(f"self_attn.{p}_proj.bias" for p in "qkv")
    rows = [  # (megatron names: local spec first, TE spec second), kind, HF names, HF shapes
        (("self_attention.linear_qkv.weight",), "qkv", qkv_w, ((q, h), (kv, h), (kv, h))),
        (("self_attention.linear_qkv.bias",), "qkv", qkv_b, ((q,), (kv,), (kv,))),
        (("self_attention.linear_proj.weight",), "row", ("self_attn.o_proj.weight",), ((h, q),)),
        (("mlp.linear_fc1.weight",), "fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ((f, h), (f, h))),
        (("mlp.linear_fc2.weight",), "row", ("mlp.down_proj.weight",), ((h, f),)),
        (
            ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
            "replicated",
            ("input_layernorm.weight",),
            ((h,),),
        ),
        (
            ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
            "replicated",
            ("post_attention_layernorm.weight",),
            ((h,),),
        ),
    ]
    sparse = d.moe is not None and moe_layer(d.moe, i)
    if sparse:  # the MLP is the MoE block: its rows replace the dense fc1 / fc2
        rows = [r for r in rows if r[0][0] not in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
        rows += _moe_rows(d)
    if not d.qkv_bias:
        rows.pop(1)
    if d.mla is not None:  # its projections replace q/k/v and o
        rows = _mla_rows(d) + [r for r in rows if not r[0][0].startswith("self_attention.")]
    if d.qk_norm:  # one [head_dim] RMSNorm weight shared by every head: the same on every TP rank
        for p in "qk":
            rows.append(
                (
                    (f"self_attention.{p}_layernorm.weight",),
                    "replicated",
                    (f"self_attn.{p}_norm.weight",),
                    ((d.head_dim,),),
                )
            )
    units = [
        _Unit(
            stage,
            f"layer.{i}",
            tuple(f"decoder.layers.{j}.{m}" for m in mcore),
            kind,
            tuple(f"model.layers.{i}.{n}" for n in names),
            shapes,
            i,
        )
        for mcore, kind, names, shapes in rows
    ]
    return units + (_expert_units(d, i, stage, j) if sparse else [])


def _mla_rows(d: _Dims) -> list[tuple]:
    """Multi-latent attention's parameters: the low-rank down projections of q and of kv + the rotary key (column: rows
    split over TP, megatron's ColumnParallelLinear then gathers them), their RMSNorms, the per-head up projections
    (column: heads split over TP; q heads [nope | rope], kv heads [k nope | v]) and o (row)."""
    assert d.mla is not None
    h, m, n = d.hidden, d.mla, d.heads
    attn = "self_attention"
    rows: list[tuple] = []
    if m.q_lora is None:
        rows.append(((f"{attn}.linear_q_proj.weight",), "column", ("self_attn.q_proj.weight",), ((n * m.q_head, h),)))
    else:
        rows += [
            ((f"{attn}.linear_q_down_proj.weight",), "column", ("self_attn.q_a_proj.weight",), ((m.q_lora, h),)),
            ((f"{attn}.q_layernorm.weight", f"{attn}.linear_q_up_proj.layer_norm_weight"), "replicated",
             ("self_attn.q_a_layernorm.weight",), ((m.q_lora,),)),
            ((f"{attn}.linear_q_up_proj.weight",), "column", ("self_attn.q_b_proj.weight",),
             ((n * m.q_head, m.q_lora),)),
        ]  # fmt: skip
    rows += [
        ((f"{attn}.linear_kv_down_proj.weight",), "column", ("self_attn.kv_a_proj_with_mqa.weight",),
         ((m.kv_lora + m.rope, h),)),
        ((f"{attn}.kv_layernorm.weight", f"{attn}.linear_kv_up_proj.layer_norm_weight"), "replicated",
         ("self_attn.kv_a_layernorm.weight",), ((m.kv_lora,),)),
        ((f"{attn}.linear_kv_up_proj.weight",), "column", ("self_attn.kv_b_proj.weight",),
         ((n * (m.nope + m.v), m.kv_lora),)),
        ((f"{attn}.linear_proj.weight",), "row", ("self_attn.o_proj.weight",), ((h, n * m.v),)),
    ]  # fmt: skip
    return rows


def _moe_rows(d: _Dims) -> list[tuple]:
    """The MoE block's parameters besides the routed experts: the router, (GLM-4.5) its expert bias, a megatron buffer
    kept in fp32, and the shared expert (Qwen2-MoE: gated) when there is one."""
    assert d.moe is not None
    h, e, s = d.hidden, d.moe.experts, d.moe.shared_ffn
    rows = [(("mlp.router.weight",), "replicated", (d.names.router,), ((e, h),))]
    if d.moe.expert_bias:
        rows.append((("mlp.router.expert_bias",), "replicated", (f"{d.names.block}.gate.e_score_correction_bias",),
                     ((e,),)))  # fmt: skip
    if s:
        shared = f"{d.names.block}.{d.names.shared}"
        fc1 = (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
        rows += [
            (("mlp.shared_experts.linear_fc1.weight",), "fc1", fc1, ((s, h), (s, h))),
            (("mlp.shared_experts.linear_fc2.weight",), "row", (f"{shared}.down_proj.weight",), ((h, s),)),
        ]
        if d.moe.shared_gate:
            rows.append((("mlp.shared_experts.gate_weight",), "replicated", ("mlp.shared_expert_gate.weight",),
                         ((1, h),)))  # fmt: skip
    return rows


def _expert_units(d: _Dims, i: int, stage: int, j: int) -> list[_Unit]:
    """The routed experts of global layer i (stage's local layer j): expert g lives on EP rank g // (E / ep) as its
    local expert g % (E / ep); each is split over TP like the dense MLP ([gate_r ; up_r] rows, down columns).
    megatron names: SequentialMLP (local spec) local_experts.k.linear_fc{1,2}.weight, TEGroupedMLP (Transformer
    Engine spec) linear_fc{1,2}.weight{k}."""
    assert d.moe is not None
    h, f, per_rank = d.hidden, d.moe.ffn, d.moe.experts // d.ep
    units = []
    for g in range(d.moe.experts):
        k, prefix = g % per_rank, f"decoder.layers.{j}.mlp.experts"
        for fc, kind, which, shapes in (
            ("linear_fc1", "fc1", ("gate", "up"), ((f, h), (f, h))),
            ("linear_fc2", "row", ("down",), ((h, f),)),
        ):
            mcore = (f"{prefix}.local_experts.{k}.{fc}.weight", f"{prefix}.{fc}.weight{k}")
            hf_names = tuple(f"model.layers.{i}.{d.names.expert(g, w)}" for w in which)
            units.append(_Unit(stage, f"layer.{i}", mcore, kind, hf_names, shapes, i, ep_owner=g // per_rank))
    return units


def _plan(d: _Dims, pp: int) -> list[_Unit]:
    """Every megatron parameter of the whole model (all stages), in export order. Same on every rank."""
    per_stage, last, vh = d.layers // pp, pp - 1, (d.vocab, d.hidden)
    units = [_Unit(0, "embed", ("embedding.word_embeddings.weight",), "vocab", ("model.embed_tokens.weight",), (vh,))]
    for i in range(d.layers):
        units += _layer_units(d, i, i // per_stage, i % per_stage)
    final = ("decoder.final_layernorm.weight",)
    units.append(_Unit(last, "final", final, "replicated", ("model.norm.weight",), ((d.hidden,),)))
    if not d.tied:
        units.append(_Unit(last, "final", ("output_layer.weight",), "vocab", ("lm_head.weight",), (vh,)))
    return units


def hf_state_dict_keys(hf_config: Any) -> list[str]:
    """HF tensor names that export_hf_weights yields, in order (the checkpoint's keys minus tied duplicates)."""
    return [name for unit in _plan(_dims(hf_config), 1) for name in unit.hf_names]  # EP does not change the names


# ---------------------------------------------------------------------------------------------- layouts


def _qkv_to_mcore(q: Tensor, k: Tensor, v: Tensor, d: _Dims) -> Tensor:
    """HF q [nh*hd, ...], k/v [ng*hd, ...] -> megatron [ng*(nh/ng + 2)*hd, ...] (per KV group: q heads, k, v)."""
    rest = q.shape[1:]
    g = d.groups
    parts = (q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _qkv_from_mcore(x: Tensor, d: _Dims) -> tuple[Tensor, Tensor, Tensor]:
    rest = x.shape[1:]
    per_group = d.heads // d.groups * d.head_dim
    grouped = x.reshape(d.groups, per_group + 2 * d.head_dim, *rest)
    q, k, v = grouped.split([per_group, d.head_dim, d.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _shard(kind: str, hf: list[Tensor], d: _Dims, tp: int, rank: int) -> Tensor:
    """This TP rank's megatron shard from the full HF tensors of one unit."""
    if kind == "replicated":
        return hf[0]
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[rank]
    if kind == "column":
        return hf[0].chunk(tp, dim=0)[rank]
    if kind == "qkv":
        return _qkv_to_mcore(*hf, d).chunk(tp, dim=0)[rank]
    if kind == "fc1":
        return torch.cat([hf[0].chunk(tp, dim=0)[rank], hf[1].chunk(tp, dim=0)[rank]], dim=0)
    if kind == "vocab":
        full = hf[0]
        padded = full.new_zeros((padded_vocab_size(d.vocab, tp), *full.shape[1:]))
        padded[: full.shape[0]] = full
        return padded.chunk(tp, dim=0)[rank]
    raise AssertionError(kind)


def _unshard(kind: str, shards: list[Tensor], d: _Dims) -> list[Tensor]:
    """Full HF tensors of one unit from the megatron shards of every TP rank (in TP rank order)."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "column":
        return [torch.cat(shards, dim=0)]
    if kind == "qkv":
        return list(_qkv_from_mcore(torch.cat(shards, dim=0), d))
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: d.vocab]]
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------- model access


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _stage_model(model_chunks: list[torch.nn.Module], d: _Dims, groups: ParallelGroups) -> torch.nn.Module:
    if len(model_chunks) != 1:
        raise ValueError(
            f"hf_weights: expected one model chunk per rank (no virtual pipeline), got {len(model_chunks)}"
        )
    model = _unwrap(model_chunks[0])
    per_stage = d.layers // groups.pp_size
    want = list(range(groups.pp_rank * per_stage + 1, (groups.pp_rank + 1) * per_stage + 1))
    got = [layer.layer_number for layer in model.decoder.layers]
    if got != want:
        raise ValueError(f"hf_weights: stage {groups.pp_rank} holds layers {got}, expected an even split {want}")
    return model


def _held_here(unit: _Unit, groups: ParallelGroups) -> bool:
    """Whether this rank holds (a TP shard of) the unit: its stage, and for a routed expert its EP rank."""
    return unit.stage == groups.pp_rank and unit.ep_owner in (None, groups.ep_rank)


def model_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """A stage model's parameters (first, in order) and then its buffers, by name: what the units name (the router's
    expert bias is a persistent buffer)."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def _find_param(params: dict[str, Tensor], unit: _Unit) -> Tensor:
    for name in unit.mcore:
        if name in params:
            return params[name]
    raise KeyError(f"hf_weights: megatron parameter {unit.mcore[0]} not found on stage {unit.stage}")


# ---------------------------------------------------------------------------------------------- load


class _SafetensorsDir:
    """Tensors of an HF checkpoint directory (model.safetensors or a sharded index), read on demand."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.exists():
            self.where = {k: self.dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
            self.source = index
        elif single.exists():
            with safe_open(str(single), "pt") as f:
                self.where = {k: single for k in f.keys()}
            self.source = single
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._files: dict[Path, Any] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in self.where:
            raise KeyError(f"{self.source}: missing tensor {name!r}")
        path = self.where[name]
        if path not in self._files:
            self._files[path] = self._open(str(path), "pt")
        tensor = self._files[path].get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor


def load_hf_into_model(
    model_chunks: list[torch.nn.Module], hf_dir: str | Path, hf_config: Any, groups: ParallelGroups
) -> None:
    """Copy an HF checkpoint into this rank's megatron parameters (its TP shard of its PP stage).

    Every parameter of the stage must be covered (KeyError otherwise); tensors are cast to the parameter
    dtype. Call before the optimizer is built (a distributed optimizer copies fp32 main params at construction).
    """
    d = _dims(hf_config, groups.ep_size)
    model = _stage_model(model_chunks, d, groups)
    params = model_tensors(model)
    ckpt = _SafetensorsDir(hf_dir)
    units = [u for u in _plan(d, groups.pp_size) if _held_here(u, groups)]
    if d.tied and groups.pp_size > 1 and groups.is_last_stage:
        embed = ("model.embed_tokens.weight",)
        units.append(_Unit(groups.pp_rank, "final", ("output_layer.weight",), "vocab", embed, ((d.vocab, d.hidden),)))
    done = set()
    with torch.no_grad():
        for unit in units:
            param = _find_param(params, unit)
            hf = [ckpt.get(n, s) for n, s in zip(unit.hf_names, unit.hf_shapes)]
            shard = _shard(unit.kind, hf, d, groups.tp_size, groups.tp_rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"hf_weights: {unit.hf_names[0]} gives a shard of shape {tuple(shard.shape)} for "
                    f"{unit.mcore[0]} of shape {tuple(param.shape)}"
                )
            param.copy_(shard.to(param.dtype))
            done.add(id(param))
    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    if missing:
        raise KeyError(f"hf_weights: megatron parameters not loaded from {ckpt.source}: {missing}")
    unused = unused_tensors(ckpt.where, hf_config)
    if unused:  # a variant of the family whose part the converter does not map: refused, never dropped
        from megatron_dapo.launch import StartupError

        more = f" (+{len(unused) - 3} more)" if len(unused) > 3 else ""
        raise StartupError(f"actor.model_path: {ckpt.source} holds tensors the converter does not load (a variant "
                           f"of the family it does not map): {', '.join(unused[:3])}{more}")  # fmt: skip


def unused_tensors(names: Iterable[str], hf_config: Any) -> list[str]:
    """The checkpoint tensors no megatron parameter takes (sorted): none of export's names, nor a tied model's stored
    lm_head copy, nor a rotary embedding's cached inverse frequencies, nor a multi-token-prediction layer's (dropped:
    arch.mtp_layers)."""
    wanted = set(hf_state_dict_keys(hf_config))
    tied = {"lm_head.weight"} if _dims(hf_config).tied else set()
    mtp = tuple(f"model.layers.{i}." for i in mtp_layers(hf_config))
    return sorted(
        n
        for n in names
        if n not in wanted and n not in tied and not n.endswith(".inv_freq") and not (mtp and n.startswith(mtp))
    )


# ---------------------------------------------------------------------------------------------- export


def _export_dtype(hf_config: Any, fallback: torch.dtype) -> torch.dtype:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else fallback


def _buckets(units: list[_Unit], bucket_bytes: int | None, itemsize: int) -> list[list[_Unit]]:
    out: list[list[_Unit]] = []
    size = 0
    for unit in units:
        nbytes = sum(int(torch.Size(s).numel()) for s in unit.hf_shapes) * itemsize
        if (
            out
            and out[-1][0].stage == unit.stage
            and (
                (bucket_bytes is None and out[-1][0].block == unit.block)
                or (bucket_bytes is not None and size + nbytes <= bucket_bytes)
            )
        ):
            out[-1].append(unit)
            size += nbytes
        else:
            out.append([unit])
            size = nbytes
    return out


def _gather_unit(param: Tensor, unit: _Unit, d: _Dims, groups: ParallelGroups) -> list[Tensor]:
    local = param.detach()
    if unit.kind == "replicated" or groups.tp_size == 1:
        shards = [local]
    else:
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(groups.tp_size)]
        dist.all_gather(shards, local, group=groups.tp_group)
    return _unshard(unit.kind, shards, d)


def export_hf_weights(
    model_chunks: list[torch.nn.Module],
    hf_config: Any,
    groups: ParallelGroups,
    *,
    bucket_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    dst_rank: int | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Yield (hf_name, full tensor) for the whole model.

    dst_rank None: on every rank of every model-parallel group; all ranks must consume the iterator to the end (it
    runs collectives over tp_group and pp_group). dst_rank = a global rank: only that rank yields (the writer of an
    HF checkpoint). The other ranks of its model-parallel group must still consume the iterator (they yield nothing,
    only send: per bucket a gather of the TP shards to the stage rank in dst's pipeline, then a point-to-point send
    to dst when the bucket's stage is not dst's); ranks of other data-parallel replicas return at once. So no rank but
    dst ever holds more than its own shards and one bucket.

    Tensors: full HF shapes (vocab padding stripped), dtype = `dtype` or the HF config's dtype, on groups.device.
    They may alias the live parameters (pp_size == 1, same dtype) or a shared bucket buffer: send or copy each
    tensor before advancing the iterator / stepping the optimizer.
    """
    d = _dims(hf_config, groups.ep_size)
    model = _stage_model(model_chunks, d, groups)
    params = model_tensors(model)
    out_dtype = dtype or _export_dtype(hf_config, next(model.parameters()).dtype)
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    buckets = _buckets(_plan(d, groups.pp_size), bucket_bytes, itemsize)
    if dst_rank is not None and groups.ep_size > 1:
        # Experts live on other data-parallel ranks (the EP group): every rank walks the full export, dst keeps it.
        for name, tensor in export_hf_weights(model_chunks, hf_config, groups, bucket_bytes=bucket_bytes, dtype=dtype):
            if groups.rank == dst_rank:
                yield name, tensor
        return
    if dst_rank is not None:
        yield from _export_to_rank(buckets, params, d, groups, out_dtype, dst_rank)
        return
    with torch.no_grad():
        for bucket in buckets:
            stage = bucket[0].stage
            names = [n for u in bucket for n in u.hf_names]
            shapes = [s for u in bucket for s in u.hf_shapes]
            if groups.pp_rank == stage:
                tensors = []
                for u in bucket:
                    if _held_here(u, groups):
                        gathered = _gather_unit(_find_param(params, u), u, d, groups)
                        tensors += [t.to(u.dtype(out_dtype)) for t in gathered]
                    else:  # a routed expert of another EP rank: filled by _share_experts
                        tensors += [torch.empty(s, dtype=out_dtype, device=groups.device) for s in u.hf_shapes]
                if groups.ep_size > 1:
                    _share_experts(bucket, tensors, groups)
            if groups.pp_size > 1:
                dtypes = [u.dtype(out_dtype) for u in bucket for _ in u.hf_names]
                tensors = _broadcast_bucket(tensors if groups.pp_rank == stage else None, shapes, dtypes,
                                            groups.pp_ranks[stage], groups)  # fmt: skip
            yield from zip(names, tensors)
            del tensors


def _flat_runs(dtypes: list[torch.dtype]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive tensors of one dtype: each travels as one flat tensor."""
    runs: list[tuple[int, int]] = []
    for i, dt in enumerate(dtypes):
        if runs and dtypes[runs[-1][0]] == dt:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _broadcast_bucket(
    tensors: list[Tensor] | None, shapes: list, dtypes: list[torch.dtype], src: int, groups: ParallelGroups
) -> list[Tensor]:
    """A bucket's tensors from the stage rank `src` to the other ranks of pp_group (tensors None there): one flat
    broadcast per run of one dtype."""
    out: list[Tensor] = []
    for a, b in _flat_runs(dtypes):
        numels = [int(torch.Size(s).numel()) for s in shapes[a:b]]
        if tensors is not None:
            flat = torch.cat([t.reshape(-1) for t in tensors[a:b]])
        else:
            flat = torch.empty(sum(numels), dtype=dtypes[a], device=groups.device)
        dist.broadcast(flat, src=src, group=groups.pp_group)
        out += [p.view(s) for p, s in zip(flat.split(numels), shapes[a:b])]
    return out


def _share_experts(bucket: list[_Unit], tensors: list[Tensor], groups: ParallelGroups) -> None:
    """Fill the bucket's routed experts held by other EP ranks: one broadcast over ep_group per owner (its experts'
    gathered tensors flattened), in place. `tensors` is the bucket's HF tensors in unit order."""
    assert groups.ep_group is not None
    slots: dict[int, list[int]] = {}  # owner EP rank -> indices into tensors
    at = 0
    for u in bucket:
        if u.ep_owner is not None:
            slots.setdefault(u.ep_owner, []).extend(range(at, at + len(u.hf_names)))
        at += len(u.hf_names)
    for owner, idx in slots.items():
        mine = owner == groups.ep_rank
        numels = [tensors[i].numel() for i in idx]
        if mine:
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        else:
            flat = torch.empty(sum(numels), dtype=tensors[idx[0]].dtype, device=groups.device)
        dist.broadcast(flat, group=groups.ep_group, group_src=owner)
        if not mine:
            for i, part in zip(idx, flat.split(numels), strict=True):
                tensors[i] = part.view(tensors[i].shape)


def _export_to_rank(
    buckets: list[list[_Unit]],
    params: dict[str, Tensor],
    d: _Dims,
    groups: ParallelGroups,
    out_dtype: torch.dtype,
    dst_rank: int,
) -> Iterator[tuple[str, Tensor]]:
    """`export_hf_weights(dst_rank=...)`: full tensors on dst_rank only (see there)."""
    if dst_rank not in groups.mp_ranks:
        return  # another data-parallel replica holds the same weights: nothing to send
    # (tp, pp) of every rank of the model-parallel group, to find the rank of each stage in dst's pipeline.
    coords = torch.tensor([groups.tp_rank, groups.pp_rank], dtype=torch.int64, device=groups.device)
    table = [torch.empty_like(coords) for _ in groups.mp_ranks]
    dist.all_gather(table, coords, group=groups.mp_group)
    where = {rank: (int(t[0]), int(t[1])) for rank, t in zip(groups.mp_ranks, table)}
    dst_tp, dst_pp = where[dst_rank]
    # The rank holding stage s in dst's pipeline (the same TP rank as dst): it gathers stage s's shards.
    leader = {pp: rank for rank, (tp, pp) in where.items() if tp == dst_tp}
    with torch.no_grad():
        for bucket in buckets:
            stage = bucket[0].stage
            names = [n for u in bucket for n in u.hf_names]
            shapes = [s for u in bucket for s in u.hf_shapes]
            tensors: list[Tensor] = []
            if groups.pp_rank == stage:
                for unit in bucket:
                    local = _find_param(params, unit).detach()
                    if unit.kind == "replicated" or groups.tp_size == 1:
                        shards = [local]
                    else:
                        local = local.contiguous()
                        is_leader = groups.rank == leader[stage]
                        shards = [torch.empty_like(local) for _ in range(groups.tp_size)] if is_leader else None
                        dist.gather(local, shards, dst=leader[stage], group=groups.tp_group)
                    if groups.rank == leader[stage]:
                        tensors.extend(t.to(unit.dtype(out_dtype)) for t in _unshard(unit.kind, shards, d))
            if stage != dst_pp and groups.rank in (leader[stage], dst_rank):
                dtypes = [u.dtype(out_dtype) for u in bucket for _ in u.hf_names]
                received: list[Tensor] = []
                for a, b in _flat_runs(dtypes):
                    numels = [int(torch.Size(s).numel()) for s in shapes[a:b]]
                    if groups.rank == dst_rank:
                        flat = torch.empty(sum(numels), dtype=dtypes[a], device=groups.device)
                        dist.recv(flat, src=leader[stage], group=groups.pp_group)
                        received += [p.view(s) for p, s in zip(flat.split(numels), shapes[a:b])]
                    else:
                        flat = torch.cat([t.reshape(-1) for t in tensors[a:b]])
                        dist.send(flat, dst=dst_rank, group=groups.pp_group)
                if groups.rank == dst_rank:
                    tensors = received
            if groups.rank == dst_rank:
                yield from zip(names, tensors)
            del tensors
