"""What the actor supports of a Hugging Face config, without torch or megatron: the architectures, their families'
traits, the mixture-of-experts shape and the checks of the actor's expert settings against it. The start-up checks
(launch.preflight, `megatron-dapo check`) run these before any process starts; the model build (actor/model.py) runs
the same ones.

    SUPPORTED_ARCHITECTURES                    {"LlamaForCausalLM": "llama", ..., "Glm4MoeForCausalLM": "glm4_moe"}
    model_arch(hf_config) -> str               the family (ValueError naming the fields otherwise)
    moe_shape(hf_config) -> MoeShape | None    experts, top-k, expert width, norm_topk, shared expert width
    moe_names(hf_config) -> MoeNames           the checkpoint names of its MoE blocks (router, experts)
    moe_layer(moe, i) -> bool                  whether decoder layer i is MoE (GLM-4.5: its first ones are dense)
    mtp_layers(hf_config) -> range             the checkpoint's multi-token-prediction layers (dropped)
    mla_shape(hf_config) -> MlaShape | None    multi-latent attention's ranks and head sizes (DeepSeek-V3)
    check_moe(hf_config, actor_config)         the actor's expert_parallel / routing_replay against the model

hf_config: a transformers config, or any object with its fields as attributes (a namespace of config.json).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    from megatron_dapo.config import ActorConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_MODEL_TYPES = {arch: arch for arch in SUPPORTED_ARCHITECTURES.values()}
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
"""Architectures with an RMSNorm over each head's query and key (HF q_norm / k_norm, megatron q_ / k_layernorm);
GLM-4.5 has them when its config sets use_qk_norm (has_qk_norm)."""
QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe")
"""Architectures whose q/k/v projections have biases (Qwen2-MoE: unless its config sets qkv_bias false); GLM-4.5:
when its config sets attention_bias (q/k/v only, o_proj never)."""
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
"""Mixture-of-experts architectures: every decoder layer's MLP is a routed MoE block (+ a gated shared expert for
Qwen2-MoE). Mixtral is Llama's attention with a renormalised top-k softmax router (its top-k probabilities always
sum to 1) and experts as wide as intermediate_size. GLM-4.5 (Glm4Moe) is DeepSeek-V3's MoE under GQA attention: its
first `first_k_dense_replace` layers dense (intermediate_size), the others a sigmoid router whose top-k choice adds
a per-expert correction bias (e_score_correction_bias, not trained: megatron's expert_bias at update rate 0) and may
be limited to the best `topk_group` of `n_group` expert groups, the chosen sigmoid scores renormalised and scaled by
routed_scaling_factor, plus an ungated shared expert; RoPE on the first partial_rotary_factor of each head. Its
multi-token-prediction layers (num_nextn_predict_layers, stored as layers past num_hidden_layers) are dropped: RL
trains the main model only, and the engine's MTP head (speculative decoding) keeps the checkpoint's weights.
DeepSeek-V3 has the same mixture of experts (and MTP layers) under multi-latent attention (`MlaShape`)."""
SIGMOID_MOE_ARCHS = ("glm4_moe", "deepseek_v3")
"""The DeepSeek-V3-style MoE: dense first layers, sigmoid router with a correction bias, groups, scaling, shared
experts."""
MLA_ARCHS = ("deepseek_v3",)
"""Multi-latent attention (DeepSeek-V3): low-rank q (q_lora_rank; None: a full q_proj) and a compressed kv
(kv_lora_rank) with one shared rotary key (qk_rope_head_dim), expanded per head to a no-rope key (qk_nope_head_dim)
and a value (v_head_dim)."""


@dataclass(frozen=True)
class MoeNames:
    """How an MoE architecture's checkpoint names a layer's MoE block (under model.layers.{i}.): the block, its
    router, and each routed expert's gate / up / down projections (under {block}.experts.{e}.)."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"  # the shared expert's module under {block}. (GLM-4.5: shared_experts)

    @property
    def router(self) -> str:
        return f"{self.block}.gate.weight"

    def expert(self, e: int, which: str) -> str:
        """`which` ("gate", "up" or "down") of routed expert e, relative to the layer."""
        return f"{self.block}.experts.{e}.{getattr(self, which)}.weight"


MOE_NAMES = {
    "mixtral": MoeNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
    "glm4_moe": MoeNames(shared="shared_experts"),
    "deepseek_v3": MoeNames(shared="shared_experts"),
}
"""Checkpoint names that differ from the Qwen MoE ones (MoeNames' defaults); transformers 5 fuses every family's
experts in memory as mlp.experts.gate_up_proj / down_proj and converts these names on load."""


def moe_names(hf_config: Any) -> MoeNames:
    """The checkpoint names of the model's MoE blocks (MoeNames' defaults for a dense or Qwen model)."""
    return MOE_NAMES.get(model_arch(hf_config), MoeNames())


_GEMMA = (
    "(1 + weight) RMSNorms, norms after attention and after the MLP (sandwich norms), embeddings scaled by "
    "sqrt(hidden_size), GeGLU (gelu_pytorch_tanh)"
)
UNSUPPORTED_WHY = {
    "gemma3_text": f"Gemma 3's {_GEMMA}, query_pre_attn_scalar and interleaved sliding-window layers with their own "
    "RoPE base have no counterpart in megatron-core 0.16.1's GPT layer spec (nor in the embedded engine's "
    "full-attention slot cache)",
    "gemma2": f"Gemma 2's {_GEMMA}, attention and final-logit soft-capping and sliding-window layers have no "
    "counterpart in megatron-core 0.16.1's GPT layer spec",
}
"""Families the actor is asked for and refuses, by model_type, with what is missing (the start-up error names it)."""
UNSUPPORTED_WHY["gemma3"] = UNSUPPORTED_WHY["gemma3_text"]  # Gemma3ForConditionalGeneration: its text model


def model_arch(hf_config: Any) -> str:
    """The supported architecture family of an HF config: a value of SUPPORTED_ARCHITECTURES. ValueError (one line)
    otherwise, naming what is missing for a family of UNSUPPORTED_WHY."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    why = f" ({UNSUPPORTED_WHY[model_type]})" if model_type in UNSUPPORTED_WHY else ""
    raise ValueError(
        f"hf config: architectures {getattr(hf_config, 'architectures', None)} / model_type {model_type!r} "
        f"not supported{why}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def has_qkv_bias(hf_config: Any) -> bool:
    """Whether the model's q/k/v projections have biases."""
    if model_arch(hf_config) == "glm4_moe":
        return bool(getattr(hf_config, "attention_bias", False))
    return model_arch(hf_config) in QKV_BIAS_ARCHS and bool(getattr(hf_config, "qkv_bias", True))


def has_qk_norm(hf_config: Any) -> bool:
    """Whether the model has a per-head RMSNorm over its queries and keys."""
    if model_arch(hf_config) == "glm4_moe":
        return bool(getattr(hf_config, "use_qk_norm", False))
    return model_arch(hf_config) in QK_NORM_ARCHS


def rotary_fraction(hf_config: Any) -> float:
    """The fraction of each head's dimensions RoPE rotates (HF partial_rotary_factor, in rope_parameters for
    transformers 5; megatron's rotary_percent): the first ones, in rotate-half order."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)


@dataclass(frozen=True)
class MoeShape:
    """The routed-expert part of an MoE model's config (HF names in comments)."""

    experts: int  # num_experts (config.json: num_experts or num_local_experts)
    topk: int  # num_experts_per_tok
    ffn: int  # moe_intermediate_size: one expert's hidden width
    norm_topk: bool  # norm_topk_prob: the top-k softmax weights renormalised to sum to 1
    shared_ffn: int  # shared_expert_intermediate_size (Qwen2-MoE; GLM-4.5: n_shared_experts x ffn; 0: none)
    shared_gate: bool = True  # the shared expert's output scaled by sigmoid(shared_expert_gate) (Qwen2-MoE)
    score: str = "softmax"  # the router's score function: "softmax", or "sigmoid" (GLM-4.5)
    expert_bias: bool = False  # e_score_correction_bias added to the scores for the top-k choice only (GLM-4.5)
    scaling: float = 1.0  # routed_scaling_factor: the chosen experts' weights multiplied by it (GLM-4.5)
    groups: int = 1  # n_group: expert groups; top-k only within the best `group_topk` of them (by top-2 sums)
    group_topk: int = 1  # topk_group
    dense_layers: int = 0  # first_k_dense_replace: the first layers have a dense MLP of intermediate_size


def num_experts(hf_config: Any) -> int:
    """The routed experts per MoE layer (num_experts, num_local_experts or n_routed_experts), 0 for a dense model."""
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(hf_config, field, None):
            return int(getattr(hf_config, field))
    return 0


def is_moe(hf_config: Any) -> bool:
    """Whether a config describes a mixture of experts (num_experts, num_local_experts or n_routed_experts set),
    whatever its architecture: what decides how its checkpoints reshard (checkpoint.check_compatible)."""
    return num_experts(hf_config) > 0


def moe_shape(hf_config: Any) -> MoeShape | None:
    """MoeShape of an MoE architecture's config, None for dense ones."""
    arch = model_arch(hf_config)
    if arch not in MOE_ARCHS:
        return None
    mixtral = arch == "mixtral"  # experts as wide as the dense MLP, top-k always renormalised
    ffn = int(hf_config.intermediate_size if mixtral else hf_config.moe_intermediate_size)
    shape = MoeShape(
        experts=num_experts(hf_config),
        topk=int(hf_config.num_experts_per_tok),
        ffn=ffn,
        norm_topk=mixtral or bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_ffn=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
    )
    if arch not in SIGMOID_MOE_ARCHS:
        return shape
    return dataclasses.replace(
        shape,
        shared_ffn=ffn * int(getattr(hf_config, "n_shared_experts", 0) or 0),
        shared_gate=False,
        score="sigmoid",
        expert_bias=True,
        scaling=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        groups=int(getattr(hf_config, "n_group", 1) or 1),
        group_topk=int(getattr(hf_config, "topk_group", 1) or 1),
        dense_layers=int(getattr(hf_config, "first_k_dense_replace", 0) or 0),
    )


def mtp_layers(hf_config: Any) -> range:
    """The checkpoint's multi-token-prediction layers (GLM-4.5: num_nextn_predict_layers stored as model.layers.{L..}
    after the L decoder layers), which the actor drops (MOE_ARCHS' note); empty for the other families."""
    layers = int(hf_config.num_hidden_layers)
    mtp = model_arch(hf_config) in SIGMOID_MOE_ARCHS
    count = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0) if mtp else 0
    return range(layers, layers + count)


@dataclass(frozen=True)
class MlaShape:
    """Multi-latent attention's sizes (HF names)."""

    q_lora: int | None  # q_lora_rank (None: q_proj [heads * (nope + rope), h] instead of q_a / q_b)
    kv_lora: int  # kv_lora_rank
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v: int  # v_head_dim

    @property
    def q_head(self) -> int:
        return self.nope + self.rope


def mla_shape(hf_config: Any) -> MlaShape | None:
    """MlaShape of a multi-latent-attention config, None for the other families."""
    if model_arch(hf_config) not in MLA_ARCHS:
        return None
    q_lora = getattr(hf_config, "q_lora_rank", None)
    return MlaShape(
        q_lora=int(q_lora) if q_lora else None,
        kv_lora=int(hf_config.kv_lora_rank),
        nope=int(hf_config.qk_nope_head_dim),
        rope=int(hf_config.qk_rope_head_dim),
        v=int(hf_config.v_head_dim),
    )


def moe_layer(moe: MoeShape, layer: int) -> bool:
    """Whether global decoder layer `layer` (from 0) has the MoE block (else the dense MLP)."""
    return layer >= moe.dense_layers


def check_moe(hf_config: Any, actor_config: ActorConfig) -> MoeShape | None:
    """The model's MoeShape after checking what the actor supports (one-line ValueError otherwise)."""
    moe = moe_shape(hf_config)
    ep = actor_config.expert_parallel
    if moe is None:
        for field, value, off in (("expert_parallel", ep, 1), ("routing_replay", actor_config.routing_replay, "none")):
            if value != off:
                raise ValueError(
                    f"actor.{field}: {value} needs a mixture-of-experts model; {model_arch(hf_config)} is dense"
                )
        return None
    if moe.experts % ep != 0:
        raise ValueError(f"actor.expert_parallel: {ep} must divide the model's num_experts {moe.experts}")
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise ValueError(
            f"hf config: mlp_only_layers {dense} / decoder_sparse_step {step} not supported: every layer must be MoE "
            "(SGLang 0.5.23 builds every Qwen MoE layer sparse and would drop dense-layer weights)"
        )
    if moe.topk < 2 and moe.norm_topk:
        raise ValueError("hf config: num_experts_per_tok 1 with norm_topk_prob not supported (megatron's router)")
    if moe.score == "sigmoid" and not moe.norm_topk:
        raise ValueError("hf config: norm_topk_prob false with a sigmoid router not supported (megatron renormalises)")
    if moe.groups > 1 and (moe.experts % moe.groups or moe.topk % moe.group_topk or moe.topk // moe.group_topk != 2):
        raise ValueError(
            f"hf config: n_group {moe.groups} / topk_group {moe.group_topk} with {moe.experts} experts top-"
            f"{moe.topk} not supported: megatron ranks a group by its top num_experts_per_tok/topk_group scores, "
            "transformers by its top 2, so they agree only when that quotient is 2 (DeepSeek-V3: 8/4)"
        )
    freq = getattr(hf_config, "moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"hf config: moe_layer_freq {freq} not supported (every layer past the dense ones is MoE)")
    if moe.dense_layers >= hf_config.num_hidden_layers:
        raise ValueError(
            f"hf config: first_k_dense_replace {moe.dense_layers} leaves no MoE layer of {hf_config.num_hidden_layers}"
        )
    pp, layers = actor_config.pipeline_parallel, hf_config.num_hidden_layers
    if actor_config.routing_replay != "none" and moe.dense_layers >= layers // pp:
        raise ValueError(
            f"actor.pipeline_parallel: {pp} leaves the first stage only dense layers (first_k_dense_replace "
            f"{moe.dense_layers} of {layers}); every stage needs an MoE layer for routing replay"
        )
    return moe  # HF's router_aux_loss_coef is not read: actor.moe_aux_loss_coeff decides (0 for RL)
