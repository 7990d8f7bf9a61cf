"""What the actor supports of a Hugging Face config, without torch or megatron: the architectures, their families'
traits, the mixture-of-experts shape and the checks of the actor's expert settings against it. The start-up checks
(launch.preflight, `megatron-dapo check`) run these before any process starts; the model build (actor/model.py) runs
the same ones.

    SUPPORTED_ARCHITECTURES                    {"LlamaForCausalLM": "llama", ..., "MixtralForCausalLM": "mixtral"}
    model_arch(hf_config) -> str               the family (ValueError naming the fields otherwise)
    moe_shape(hf_config) -> MoeShape | None    experts, top-k, expert width, norm_topk, shared expert width
    moe_names(hf_config) -> MoeNames           the checkpoint names of its MoE blocks (router, experts)
    check_moe(hf_config, actor_config)         the actor's expert_parallel / routing_replay against the model

hf_config: a transformers config, or any object with its fields as attributes (a namespace of config.json).
"""

from __future__ import annotations

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
}
_MODEL_TYPES = {arch: arch for arch in SUPPORTED_ARCHITECTURES.values()}
QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
"""Architectures with an RMSNorm over each head's query and key (HF q_norm / k_norm, megatron q_ / k_layernorm)."""
QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe")
"""Architectures whose q/k/v projections have biases (Qwen2-MoE: unless its config sets qkv_bias false)."""
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Mixture-of-experts architectures: every decoder layer's MLP is a routed MoE block (+ a gated shared expert for
Qwen2-MoE). Mixtral is Llama's attention with a renormalised top-k softmax router (its top-k probabilities always
sum to 1) and experts as wide as intermediate_size."""


@dataclass(frozen=True)
class MoeNames:
    """How an MoE architecture's checkpoint names a layer's MoE block (under model.layers.{i}.): the block, its
    router, and each routed expert's gate / up / down projections (under {block}.experts.{e}.)."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    @property
    def router(self) -> str:
        return f"{self.block}.gate.weight"

    def expert(self, e: int, which: str) -> str:
        """`which` ("gate", "up" or "down") of routed expert e, relative to the layer."""
        return f"{self.block}.experts.{e}.{getattr(self, which)}.weight"


MOE_NAMES = {"mixtral": MoeNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")}
"""Checkpoint names that differ from the Qwen MoE ones (MoeNames' defaults); transformers 5 fuses every family's
experts in memory as mlp.experts.gate_up_proj / down_proj and converts these names on load."""


def moe_names(hf_config: Any) -> MoeNames:
    """The checkpoint names of the model's MoE blocks (MoeNames' defaults for a dense or Qwen model)."""
    return MOE_NAMES.get(model_arch(hf_config), MoeNames())


def model_arch(hf_config: Any) -> str:
    """The supported architecture family of an HF config: "llama", "qwen2" or "qwen3"."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"hf config: architectures {getattr(hf_config, 'architectures', None)} / model_type {model_type!r} "
        f"not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def has_qkv_bias(hf_config: Any) -> bool:
    """Whether the model's q/k/v projections have biases."""
    return model_arch(hf_config) in QKV_BIAS_ARCHS and bool(getattr(hf_config, "qkv_bias", True))


@dataclass(frozen=True)
class MoeShape:
    """The routed-expert part of an MoE model's config (HF names in comments)."""

    experts: int  # num_experts (config.json: num_experts or num_local_experts)
    topk: int  # num_experts_per_tok
    ffn: int  # moe_intermediate_size: one expert's hidden width
    norm_topk: bool  # norm_topk_prob: the top-k softmax weights renormalised to sum to 1
    shared_ffn: int  # shared_expert_intermediate_size (Qwen2-MoE; 0: no shared expert)


def is_moe(hf_config: Any) -> bool:
    """Whether a config describes a mixture of experts (num_experts or num_local_experts set), whatever its
    architecture: what decides how its checkpoints reshard (checkpoint.check_compatible)."""
    return bool(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None))


def moe_shape(hf_config: Any) -> MoeShape | None:
    """MoeShape of an MoE architecture's config, None for dense ones."""
    if model_arch(hf_config) not in MOE_ARCHS:
        return None
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    mixtral = model_arch(hf_config) == "mixtral"  # experts as wide as the dense MLP, top-k always renormalised
    return MoeShape(
        experts=int(experts),
        topk=int(hf_config.num_experts_per_tok),
        ffn=int(hf_config.intermediate_size if mixtral else hf_config.moe_intermediate_size),
        norm_topk=mixtral or bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_ffn=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
    )


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
    return moe  # HF's router_aux_loss_coef is not read: actor.moe_aux_loss_coeff decides (0 for RL)
