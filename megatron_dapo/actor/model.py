"""Hugging Face config -> megatron TransformerConfig + layer spec -> GPTModel for one pipeline stage.

API (the architectures, model_arch, moe_shape and check_moe, torch-free, are in actor/arch.py):
    padded_vocab_size(vocab, tp, divisible_by=128) -> int
    to_transformer_config(hf_config, actor_config, *, on_cpu) -> TransformerConfig
    use_transformer_engine(actor_config, *, on_cpu) -> bool   (GPU without TE: RuntimeError naming the fix)
    check_shared_prefix(actor_config, *, on_cpu) -> None      (actor.shared_prefix needs the local spec)
    build_gpt_model(hf_config, actor_config, groups, *, pre_process=None, post_process=None) -> GPTModel
        (a GPTModel subclass whose last stage returns the final hidden states [S, B, H] instead of logits while
        its `return_hidden` attribute is True, and takes RoPE at per-token position_ids while its
        `rope_from_position_ids` is True; the output layer and the tied-embedding machinery stay as built)
    masked_block_attention(q, k, v, masked, *, scale) -> Tensor   (one row under an explicit [S, S] mask)
    forward_logits(model_chunks, tokens, groups) -> Tensor | None   (test/debug helper, forward-only schedule)

`to_transformer_config` is the only place that translates HF fields to megatron's. On CPU: fp32, local spec
(get_gpt_layer_local_spec(normalization="RMSNorm")), every fusion off. On GPU: bf16/fp16 per actor_config.dtype
and the Transformer Engine spec; without TE on GPU it stops (use_transformer_engine) unless
actor.allow_local_spec_on_gpu allows the local spec for debugging; bf16/fp16 models must be wrapped in
megatron's Float16Module (or DDP with a Float16Module inside) by the caller.

Tied embeddings (SmolLM2): share_embeddings_and_output_weights=True. With pipeline_parallel > 1 megatron keeps a
copy of the embedding as output_layer.weight on the last stage and all-reduces its gradient with the first stage
over the embedding group (megatron.core.distributed.finalize_model_grads does this when the caller uses it);
hf_weights.load_hf_into_model fills both copies.

Building a model for a test (2 gloo processes, after torchrun-style env vars are set):
    groups = init_distributed(tensor_parallel=2, pipeline_parallel=1)          # applies the CPU shims
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    actor_cfg = ActorConfig(model_path=hf_dir, tensor_parallel=2, dtype="fp32")
    model = build_gpt_model(hf_config, actor_cfg, groups)
    load_hf_into_model([model], hf_dir, hf_config, groups)
    logits = forward_logits([model], tokens, groups, vocab_size=hf_config.vocab_size)  # [B, S, V] last stage
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_dapo.actor.arch import MoeShape
from megatron_dapo.actor.arch import check_moe
from megatron_dapo.actor.arch import has_qk_norm
from megatron_dapo.actor.arch import has_qkv_bias
from megatron_dapo.actor.arch import mla_shape
from megatron_dapo.actor.arch import model_arch
from megatron_dapo.actor.arch import moe_layer
from megatron_dapo.actor.arch import rotary_fraction

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_dapo.actor.distributed import ParallelGroups
    from megatron_dapo.config import ActorConfig

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest multiple of divisible_by * tp that holds `vocab` rows (megatron's vocab padding)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def _rope_parameters(hf_config: Any) -> tuple[dict[str, Any], float, str]:
    """(rope parameters, theta, rope type) of an HF config (transformers 5's rope_parameters, or a legacy
    rope_scaling)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params, theta, params.get("rope_type", params.get("type", "default")) or "default"


def _rope_params(hf_config: Any) -> dict[str, Any]:
    """rope theta and scaling as GPTModel kwargs; unsupported rope types are a one-line error."""
    params, theta, rope_type = _rope_parameters(hf_config)
    out: dict[str, Any] = {"rotary_base": theta}
    if rope_type == "default":
        return out
    if rope_type == "linear":
        out["seq_len_interpolation_factor"] = float(params["factor"])
        return out
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: params.get(k) for k in expected}
        if any(got[k] is None or float(got[k]) != v for k, v in expected.items()):
            raise ValueError(f"hf config: rope_parameters llama3 {got} unsupported (megatron fixes {expected})")
        out["rope_scaling"] = True
        out["rope_scaling_factor"] = float(params["factor"])
        return out
    raise ValueError(
        f"hf config: rope_parameters.rope_type {rope_type!r} not supported (supported: default, linear, llama3)"
    )


def _have_te() -> bool:
    try:
        from megatron.core.extensions import transformer_engine
    except Exception:  # TE missing or broken: fall back to the local spec
        return False
    return bool(getattr(transformer_engine, "HAVE_TE", True))


def use_transformer_engine(actor_config: ActorConfig, *, on_cpu: bool) -> bool:
    """True when the Transformer Engine layer spec is used: on GPU, when TE imports.

    On GPU without TE it stops with a one-line RuntimeError naming the fix, unless actor.allow_local_spec_on_gpu is
    set: the local spec materialises full [b, heads, s, s] attention scores (~4 GB per layer at 21k tokens for
    Qwen2.5-32B) and runs without TE's fused kernels, so a long-response run would OOM or crawl.
    """
    if on_cpu:
        return False
    if _have_te():
        return True
    if actor_config.allow_local_spec_on_gpu:
        return False
    raise RuntimeError(
        "actor: Transformer Engine is not importable on this CUDA machine and the local layer spec materialises full "
        "attention scores; install it (pip install -e .[te], i.e. transformer-engine[pytorch]) or set "
        "actor.allow_local_spec_on_gpu=true to debug with the local spec"
    )


def check_shared_prefix(actor_config: ActorConfig, *, on_cpu: bool) -> None:
    """actor.shared_prefix needs the local layer spec (its attention takes the prefix/branch mask; Transformer
    Engine's does not): CPU, or a GPU without TE with actor.allow_local_spec_on_gpu. One-line ValueError otherwise."""
    if actor_config.shared_prefix and use_transformer_engine(actor_config, on_cpu=on_cpu):
        raise ValueError(
            "actor.shared_prefix: needs the local layer spec (CPU, or a GPU without Transformer Engine and "
            "actor.allow_local_spec_on_gpu=true); Transformer Engine's attention takes no prefix/branch mask"
        )


def sequence_parallel_on(actor_config: ActorConfig, *, use_te: bool) -> bool:
    """Megatron sequence parallel: actor.sequence_parallel at TP > 1 with the Transformer Engine spec only (CPU has
    no TE and gloo no reduce-scatter; the local spec has no sequence-parallel norm)."""
    return bool(actor_config.sequence_parallel and actor_config.tensor_parallel > 1 and use_te)


def _moe_fields(moe: MoeShape | None, actor_config: ActorConfig, *, use_te: bool, layers: int) -> dict[str, Any]:
    """TransformerConfig fields of the MoE layers: HF's router (softmax over all experts in fp32, top-k, renormalised
    when norm_topk_prob) is megatron's softmax router with pre_softmax False (top-k of the logits, softmax over the
    k: the same numbers) or True (softmax over all, top-k, not renormalised); experts split over expert_parallel
    ranks, each expert's matrices over tensor_parallel (expert tensor parallel = TP); aux loss per actor config, no
    z-loss; grouped GEMM with Transformer Engine, one SequentialMLP expert at a time on the local spec.

    GLM-4.5's router (moe.score "sigmoid") is megatron's sigmoid router: the expert bias (HF e_score_correction_bias)
    added for the choice only, group-limited top-k, the chosen scores renormalised (always, top-k > 1) and scaled;
    the bias is a checkpoint value here, never updated (moe_router_bias_update_rate 0: megatron's aux-loss-free
    balancing would move the routing away from the engine's). Dense first layers: moe_layer_freq."""
    if moe is None:
        return {}
    coeff = actor_config.moe_aux_loss_coeff
    fields: dict[str, Any] = dict(
        num_moe_experts=moe.experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn,
        moe_router_score_function=moe.score,
        moe_router_pre_softmax=not moe.norm_topk and moe.score == "softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if coeff > 0 else "none",
        moe_aux_loss_coeff=coeff,
        moe_z_loss_coeff=None,
        moe_grouped_gemm=use_te,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=actor_config.routing_replay != "none",
        expert_model_parallel_size=actor_config.expert_parallel,
        expert_tensor_parallel_size=actor_config.tensor_parallel,
    )
    if moe.shared_ffn:
        fields.update(moe_shared_expert_intermediate_size=moe.shared_ffn, moe_shared_expert_gate=moe.shared_gate)
    if moe.expert_bias:
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if moe.scaling != 1.0:
        fields.update(moe_router_topk_scaling_factor=moe.scaling)
    if moe.groups > 1:
        fields.update(moe_router_num_groups=moe.groups, moe_router_group_topk=moe.group_topk)
    if moe.dense_layers:
        fields.update(moe_layer_freq=[int(moe_layer(moe, i)) for i in range(layers)])
    return fields


def _check_hf_config(hf_config: Any, arch: str, pipeline_parallel: int) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hf config: hidden_act {act!r} not supported (only 'silu')")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("hf config: mlp_bias=True not supported")
    if arch in ("llama", "qwen3", "qwen3_moe", "mixtral") and getattr(hf_config, "attention_bias", False):
        raise ValueError(f"hf config: attention_bias=True not supported for {arch}")
    fraction = rotary_fraction(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if not 0 < fraction <= 1 or int(head_dim * fraction) % 2:
        raise ValueError(f"hf config: partial_rotary_factor {fraction} of head_dim {head_dim} not supported")
    if arch != "llama" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("hf config: use_sliding_window=True not supported")
    window, positions = getattr(hf_config, "sliding_window", None), hf_config.max_position_embeddings
    if arch == "mixtral" and window is not None and window < positions:  # Mixtral applies it whenever it is set
        raise ValueError(
            f"hf config: sliding_window {window} < max_position_embeddings {positions} not supported (the actor's "
            "attention is full); Mixtral-8x7B and 8x22B set it to null"
        )
    layers = hf_config.num_hidden_layers
    if layers % pipeline_parallel != 0:
        raise ValueError(
            f"actor.pipeline_parallel: {pipeline_parallel} must divide num_hidden_layers {layers} of the model"
        )


def to_transformer_config(hf_config: Any, actor_config: ActorConfig, *, on_cpu: bool) -> TransformerConfig:
    """Translate a supported HF config plus the actor's parallelism and precision into a TransformerConfig.

    On CPU the dtype is fp32 whatever actor_config.dtype says, and every fusion that needs CUDA/TE is off.
    """
    from megatron.core.transformer import TransformerConfig

    arch = model_arch(hf_config)
    tp, pp = actor_config.tensor_parallel, actor_config.pipeline_parallel
    _check_hf_config(hf_config, arch, pp)
    moe = check_moe(hf_config, actor_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if kv_heads % tp != 0 and tp % kv_heads != 0:
        raise ValueError(f"actor.tensor_parallel: {tp} incompatible with num_key_value_heads {kv_heads}")
    if kv_heads % tp != 0:
        raise ValueError(f"actor.tensor_parallel: {tp} must divide num_key_value_heads {kv_heads} (no KV replication)")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    dtype = torch.float32 if on_cpu else _DTYPES[actor_config.dtype]
    recompute = actor_config.recompute_activations
    use_te = use_transformer_engine(actor_config, on_cpu=on_cpu)
    config_class, mla = TransformerConfig, _mla_fields(hf_config)
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as config_class
    return config_class(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        **({} if mla else {"kv_channels": head_dim}),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # Sequence parallel (norms, dropout and residuals split over TP along the sequence) needs reduce-scatter /
        # all-gather of tensors, which gloo lacks: GPU only. Passes pad their sequences to a multiple of tp for it.
        # The local spec (CPU, or GPU with allow_local_spec_on_gpu) has no sequence-parallel norm: TE only.
        sequence_parallel=sequence_parallel_on(actor_config, use_te=use_te),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        variable_seq_lengths=pp > 1,  # micro-batches may differ in length under PP (shapes exchanged first)
        moe_token_dispatcher_type=actor_config.moe_dispatcher,  # megatron checks it on dense models too
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=use_te,
        bias_activation_fusion=not on_cpu,
        masked_softmax_fusion=False,
        bias_dropout_fusion=not on_cpu,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **_moe_fields(moe, actor_config, use_te=use_te, layers=hf_config.num_hidden_layers),
        **mla,
    )


def _mla_fields(hf_config: Any) -> dict[str, Any]:
    """MLATransformerConfig fields of a multi-latent-attention model ({} for the others): its ranks and head sizes,
    its RoPE (plain: megatron's "rope"; the q/k rotary halves of HF's interleaved layout are what megatron's MLA RoPE
    de-interleaves), no query/key layer scaling; or YaRN (DeepSeek-V3's: megatron's YarnRotaryEmbedding and its
    softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(q head), as transformers' yarn_apply_mscale). Other RoPE
    types are refused in one line."""
    mla = mla_shape(hf_config)
    if mla is None:
        return {}
    params, theta, rope_type = _rope_parameters(hf_config)
    rope: dict[str, Any] = dict(rope_type="rope", mscale=1.0, mscale_all_dim=0.0)
    if rope_type == "yarn":
        if params.get("attention_factor") is not None or not params.get("truncate", True):
            raise ValueError("hf config: yarn attention_factor / truncate false not supported (megatron's YaRN)")
        rope = dict(
            rope_type="yarn",
            rotary_scaling_factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 1.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    elif rope_type != "default":
        raise ValueError(
            f"hf config: rope_parameters.rope_type {rope_type!r} with multi-latent attention not supported (supported: "
            "default, yarn)"
        )
    return dict(
        q_lora_rank=mla.q_lora,
        kv_lora_rank=mla.kv_lora,
        qk_head_dim=mla.nope,
        qk_pos_emb_head_dim=mla.rope,
        v_head_dim=mla.v,
        rotary_base=theta,
        rotary_percent=1.0,
        kv_channels=mla.q_head,
        **rope,
    )


@functools.cache
def hidden_output_gpt_class() -> type:
    """GPTModel with one switch, `return_hidden`: when True, forward() on the last stage returns the decoder's output
    (after the final norm) [S, B, H] (S / tp under sequence parallel) instead of the output layer's logits, so the
    caller can run a fused LM-head op on it with the output weight. Nothing else changes: post_process stays True, so
    the output layer (or the tied copy of the embedding on the last stage under PP) keeps existing, is saved, loaded
    and exported, and megatron's finalize_model_grads still all-reduces the tied embedding gradient between the first
    and last stage. Multi-token prediction (unused here) is not supported with return_hidden."""
    from megatron.core.models.gpt import GPTModel

    class HiddenOutputGPTModel(GPTModel):
        return_hidden: bool = False
        rope_from_position_ids: bool = False
        """When True (actor.shared_prefix, scoped to one call like return_hidden): the input is one BSHD row
        (batch 1, no packed_seq_params) and RoPE is taken at `position_ids` per token instead of 0..S-1."""

        def _preprocess(self, input_ids: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> tuple:
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
            if not self.rope_from_position_ids:
                return out
            if kwargs.get("packed_seq_params") is not None or position_ids is None or position_ids.shape[0] != 1:
                raise ValueError("rope_from_position_ids: needs position_ids [1, S] and no packed_seq_params")
            if out[1] is None or self.position_embedding_type != "rope":
                raise ValueError("rope_from_position_ids: the model must use plain RoPE (no flash decode, no mrope)")
            return (out[0], rope_at_positions(self.rotary_pos_emb, position_ids[0]), *out[2:])

        def _postprocess(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            if self.return_hidden and self.post_process:
                if self.config.mtp_num_layers:
                    raise ValueError("return_hidden: multi-token prediction layers are not supported")
                return hidden_states
            return super()._postprocess(hidden_states, *args, **kwargs)

    return HiddenOutputGPTModel


def rope_at_positions(rotary_pos_emb: torch.nn.Module, positions: Tensor) -> Tensor:
    """megatron's RoPE table (RotaryEmbedding.forward(max_seq_len): rotary base, scaling and interpolation as
    built) gathered at per-token positions: [S, 1, 1, D] fp32, what its BSHD rope (`_apply_rotary_pos_emb_bshd`,
    freqs indexed by sequence position) expects.

    Args:
        rotary_pos_emb: the model's RotaryEmbedding.
        positions: [S] int64 RoPE positions (>= 0).
    """
    table = rotary_pos_emb(int(positions.max()) + 1 if positions.numel() else 1)
    return table[positions.to(table.device)]


@functools.cache
def varlen_attention_class() -> type:
    """megatron's local DotProductAttention plus packed sequences: with `packed_seq_params` (qkv_format "thd",
    cu_seqlens) it runs causal attention within each sequence, in plain torch (scaled_dot_product_attention per
    sequence, grouped-query heads repeated); with an attention_mask [1, 1, S, S] and no packed_seq_params (one BSHD
    row of actor.shared_prefix) it runs `masked_block_attention`; with neither, it is DotProductAttention unchanged.
    A small reference path for CPU and debugging: on GPU the Transformer Engine spec is used instead."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class VarlenDotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.v_channels = v_channels
            """Multi-latent attention's value head size (its key's is the query's): megatron's local attention
            assumes one head size, so every path here is the plain-torch one."""

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> Tensor:
            if packed_seq_params is None and attention_mask is not None and attention_bias is None:
                # actor.shared_prefix: one BSHD row [S, 1, heads, D] with a [1, 1, S, S] mask (True = masked out)
                if query.shape[1] != 1 or tuple(attention_mask.shape) != (1, 1, query.shape[0], key.shape[0]):
                    raise ValueError(
                        f"VarlenDotProductAttention: a mask needs batch 1 and [1, 1, S, S], got query "
                        f"{tuple(query.shape)} and mask {tuple(attention_mask.shape)}"
                    )
                out = masked_block_attention(
                    query[:, 0], key[:, 0], value[:, 0], attention_mask[0, 0], scale=self._effective_scale()
                )
                return out.unsqueeze(1)
            if packed_seq_params is None and self.v_channels is not None and attention_bias is None:
                # multi-latent attention, BSHD [S, b, heads, D]: causal, row by row
                rows = [
                    varlen_causal_attention(
                        query[:, j], key[:, j], value[:, j], torch.tensor([0, query.shape[0]]),
                        scale=self._effective_scale(),
                    )
                    for j in range(query.shape[1])
                ]  # fmt: skip
                return torch.stack(rows, dim=1)
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
                raise ValueError("VarlenDotProductAttention: only qkv_format 'thd' without attention_bias")
            return varlen_causal_attention(
                query, key, value, packed_seq_params.cu_seqlens_q, scale=self._effective_scale()
            )

        def _effective_scale(self) -> float:
            # DotProductAttention divides softmax_scale by the layer number under apply_query_key_layer_scaling and
            # multiplies it back inside its softmax: the product is what the scores see.
            if self.config.apply_query_key_layer_scaling:
                return self.softmax_scale * self.layer_number
            return self.softmax_scale

    return VarlenDotProductAttention


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *, scale: float) -> Tensor:
    """Causal attention within each packed sequence (no attention across sequence boundaries).

    Args:
        query: [T, heads, D]; key: [T, kv_heads, D], value: [T, kv_heads, Dv] with heads a multiple of kv_heads
            (grouped-query; Dv = D but for multi-latent attention).
        cu_seqlens: [n + 1] int, sequence boundaries in T (cu_seqlens[-1] == T).
        scale: softmax scale applied to q.k.
    Returns:
        [T, heads * Dv] in query's dtype.
    """
    t, heads, dim = query.shape[0], query.shape[1], value.shape[-1]
    group = heads // key.shape[1]
    bounds = cu_seqlens.tolist()
    if bounds[-1] != t:
        raise ValueError(f"varlen_causal_attention: cu_seqlens ends at {bounds[-1]}, packed length is {t}")
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b == a:
            continue
        q = query[a:b].transpose(0, 1)  # [heads, L, D]
        k = key[a:b].transpose(0, 1).repeat_interleave(group, dim=0)
        v = value[a:b].transpose(0, 1).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out.append(o.transpose(0, 1).reshape(b - a, heads * dim))
    return torch.cat(out) if out else query.new_zeros(0, heads * dim)


def _mask_blocks(masked: Tensor) -> list[int]:
    """Boundaries 0 = c_0 < c_1 < ... < c_n = S of independent diagonal blocks of a causal mask [S, S] (True =
    masked out): at c no query >= c sees a key < c. A mask that is not causal is one block."""
    s = masked.shape[0]
    allowed = ~masked
    if s == 0:
        return [0]
    if torch.triu(allowed, diagonal=1).any():
        return [0, s]
    cols = torch.arange(s, device=masked.device).expand(s, s)
    first = torch.where(allowed, cols, torch.full_like(cols, s)).amin(dim=1)  # first key each query sees
    suffix_min = torch.flip(torch.cummin(torch.flip(first, [0]), 0).values, [0])
    starts = (suffix_min == torch.arange(s, device=masked.device)).nonzero().flatten().tolist()
    return sorted(set(starts) | {0}) + [s]


def masked_block_attention(query: Tensor, key: Tensor, value: Tensor, masked: Tensor, *, scale: float) -> Tensor:
    """Attention of one packed row under an explicit mask, block by block (actor.shared_prefix).

    The mask is cut into independent diagonal blocks (`_mask_blocks`: for the shared-prefix layout, one per prompt
    group), each run with scaled_dot_product_attention and its slice of the mask; grouped-query heads are repeated.

    Args:
        query: [S, heads, D]; key: [S, kv_heads, D], value: [S, kv_heads, Dv] with heads a multiple of kv_heads.
        masked: [S, S] bool, True = query may not see key (megatron's convention); every query sees itself.
        scale: softmax scale applied to q.k.
    Returns:
        [S, heads * Dv] in query's dtype.
    """
    heads, dim = query.shape[1], value.shape[-1]
    group = heads // key.shape[1]
    bounds = _mask_blocks(masked)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q = query[a:b].transpose(0, 1)  # [heads, L, D]
        k = key[a:b].transpose(0, 1).repeat_interleave(group, dim=0)
        v = value[a:b].transpose(0, 1).repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked[a:b, a:b], scale=scale)
        out.append(o.transpose(0, 1).reshape(b - a, heads * dim))
    return torch.cat(out) if out else query.new_zeros(0, heads * dim)


def build_gpt_model(
    hf_config: Any,
    actor_config: ActorConfig,
    groups: ParallelGroups,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
) -> GPTModel:
    """GPTModel for this rank's pipeline stage (randomly initialised; load weights with hf_weights).

    pre_process / post_process default to groups.is_first_stage / groups.is_last_stage. The model lives on
    groups.device; its vocabulary is padded to padded_vocab_size(vocab_size, tp). Logits from forward() are
    [B, S, V_padded / tp] (vocab-parallel), in the compute dtype; with `model.return_hidden = True` the last stage
    returns hidden states instead (see `hidden_output_gpt_class`).
    """
    on_cpu = groups.device.type == "cpu"
    config = to_transformer_config(hf_config, actor_config, on_cpu=on_cpu)
    use_te = use_transformer_engine(actor_config, on_cpu=on_cpu)
    if config.num_moe_experts and not use_te:
        from megatron_dapo.actor.cpu_compat import moe_without_te_compat

        moe_without_te_compat()
    if getattr(config, "multi_latent_attention", False) and not use_te:
        from megatron_dapo.actor.cpu_compat import mla_without_te_compat

        mla_without_te_compat()
    spec = _layer_spec(config, config.num_moe_experts, use_te=use_te)
    if isinstance(config.moe_layer_freq, list):  # dense first layers (GLM-4.5): a spec per layer of this stage
        from megatron.core.transformer.transformer_block import LayerNormImpl
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        dense = _layer_spec(config, None, use_te=use_te)
        per_stage = config.num_layers // groups.pp_size
        mine = config.moe_layer_freq[groups.pp_rank * per_stage : (groups.pp_rank + 1) * per_stage]
        spec = TransformerBlockSubmodules(layer_specs=[spec if m else dense for m in mine], layer_norm=LayerNormImpl)
    model = hidden_output_gpt_class()(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, groups.tp_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=groups.is_first_stage if pre_process is None else pre_process,
        post_process=groups.is_last_stage if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=rotary_fraction(hf_config),
        **({} if mla_shape(hf_config) else _rope_params(hf_config)),  # MLA: its attention builds its RoPE
    )
    return model.to(groups.device)


def _layer_spec(config: TransformerConfig, experts: int | None, *, use_te: bool) -> Any:
    """One decoder layer's megatron spec: the Transformer Engine one, or the local one whose core attention also
    takes packed sequences (`varlen_attention_class`); an MoE MLP when `experts`, else the dense one. Multi-latent
    attention (DeepSeek-V3) with its two low-rank norms (megatron builds them only with qk_layernorm)."""
    mla = bool(getattr(config, "multi_latent_attention", False))
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=config.qk_layernorm or mla,
            multi_latent_attention=mla,
        )  # fmt: skip
        if mla:  # the down projections split over TP as on the local spec (one checkpoint layout; TE duplicates them)
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

            attention = spec.submodules.self_attention.submodules
            attention.linear_q_down_proj = attention.linear_kv_down_proj = TEColumnParallelLinear
        return spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=config.qk_layernorm or mla,
        multi_latent_attention=mla,
    )  # fmt: skip
    # The local DotProductAttention refuses packed (THD) input; this subclass runs it, so the actor's packed
    # path is the same on CPU as on GPU (where Transformer Engine's attention takes cu_seqlens natively).
    spec.submodules.self_attention.submodules.core_attention = varlen_attention_class()
    return spec


def forward_logits(
    model_chunks: list[torch.nn.Module], tokens: Tensor, groups: ParallelGroups, *, vocab_size: int | None = None
) -> Tensor | None:
    """Forward-only pass through megatron's pipeline schedule; full-vocabulary logits on the last stage.

    tokens: [B, S] int64, the same on every rank of the model-parallel group (one micro-batch).
    Returns [B, S, V] fp32 logits gathered over tp_group on last-stage ranks (V = vocab_size when given, which
    strips the vocab padding, else the padded vocabulary), None on other stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = tokens.to(groups.device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    outputs: list[Tensor] = []

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[Tensor, Any]:
        del data_iterator
        out = model(tokens, position_ids, None)

        def collect(output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            outputs.append(output.detach())
            return output.sum() * 0.0, {}

        return out, collect

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=model_chunks,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=True,
    )
    if not groups.is_last_stage:
        return None
    local = outputs[0].float().contiguous()
    if groups.tp_size > 1:
        parts = [torch.empty_like(local) for _ in range(groups.tp_size)]
        torch.distributed.all_gather(parts, local, group=groups.tp_group)
        local = torch.cat(parts, dim=-1)
    return local if vocab_size is None else local[..., :vocab_size]
