"""Sparse upcycling: a dense Llama checkpoint (SmolLM2) turned into a Qwen2-MoE one, for CPU MoE experiments.

    upcycle_llama_to_moe(src_dir, out_dir, num_experts=4, top_k=2, noise=0.0, ...) -> Path

Every MLP becomes `num_experts` copies of itself (sparse upcycling, Komatsuzaki et al. 2022) behind a fresh router;
attention, norms, embeddings and the tokenizer (when src has one) are copied unchanged. Qwen2-MoE is the MoE
architecture that can hold a Llama exactly: `qkv_bias=False` gives Llama's attention (Qwen3-MoE would add q/k
RMSNorms), and `norm_topk_prob=True` makes the top-k weights sum to one, so with noise=0 every token's MLP output is
the dense MLP's whatever the router picks (tested: logits equal the source model's in fp64). Qwen2-MoE always
carries a gated shared expert: it gets `shared_width` neurons with a zero down projection and a zero gate (it
contributes exactly 0 until training moves it).

noise > 0 makes the experts differ: expert e's gate/up/down weights are W + noise * std(W) * N(0, 1) (seeded), so the
router's choice changes the output and routing disagreement between an engine and the actor costs log-prob. The
router is N(0, router_std) (config.initializer_range by default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def upcycle_llama_to_moe(
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    noise: float = 0.0,
    router_std: float | None = None,
    shared_width: int = 64,
    seed: int = 0,
) -> Path:
    """Write out_dir: a Qwen2MoeForCausalLM (safetensors, config, generation config, tokenizer) upcycled from the
    LlamaForCausalLM in src_dir. Weights are kept in the source's dtype; returns out_dir."""
    from transformers import AutoConfig
    from transformers import AutoTokenizer
    from transformers import GenerationConfig
    from transformers import LlamaForCausalLM
    from transformers import Qwen2MoeForCausalLM

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    src_cfg = AutoConfig.from_pretrained(src_dir)
    if src_cfg.model_type != "llama":
        raise ValueError(f"{src_dir}/config.json: model_type {src_cfg.model_type!r}, upcycling reads a llama model")
    if getattr(src_cfg, "attention_bias", False) or getattr(src_cfg, "mlp_bias", False):
        raise ValueError(f"{src_dir}/config.json: attention_bias / mlp_bias are not carried by Qwen2-MoE")
    if not 1 <= top_k <= num_experts or (top_k == 1 and num_experts > 1):
        raise ValueError(f"upcycle: top_k {top_k} with {num_experts} experts (need 2 <= top_k <= num_experts)")
    cfg = _moe_config(src_cfg, num_experts, top_k, shared_width)
    src = LlamaForCausalLM.from_pretrained(src_dir)
    dtype = next(src.parameters()).dtype
    dst = Qwen2MoeForCausalLM(cfg).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    std = src_cfg.initializer_range if router_std is None else router_std

    def perturbed(w: torch.Tensor) -> torch.Tensor:
        if noise == 0.0:
            return w.clone()
        z = torch.randn(w.shape, generator=gen, dtype=torch.float64)
        return (w.double() + noise * w.double().std() * z).to(w.dtype)

    with torch.no_grad():
        dst.model.embed_tokens.weight.copy_(src.model.embed_tokens.weight)
        dst.model.norm.weight.copy_(src.model.norm.weight)
        if not cfg.tie_word_embeddings:
            dst.lm_head.weight.copy_(src.lm_head.weight)
        for s, d in zip(src.model.layers, dst.model.layers):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(d.self_attn, name).weight.copy_(getattr(s.self_attn, name).weight)
            d.input_layernorm.weight.copy_(s.input_layernorm.weight)
            d.post_attention_layernorm.weight.copy_(s.post_attention_layernorm.weight)
            moe = d.mlp
            for e in range(num_experts):
                gate, up = perturbed(s.mlp.gate_proj.weight), perturbed(s.mlp.up_proj.weight)
                moe.experts.gate_up_proj[e].copy_(torch.cat([gate, up], dim=0))
                moe.experts.down_proj[e].copy_(perturbed(s.mlp.down_proj.weight))
            router = torch.randn(moe.gate.weight.shape, generator=gen, dtype=torch.float64) * std
            moe.gate.weight.copy_(router.to(dtype))
            shared = torch.randn(moe.shared_expert.gate_proj.weight.shape, generator=gen, dtype=torch.float64) * std
            moe.shared_expert.gate_proj.weight.copy_(shared.to(dtype))
            shared = torch.randn(moe.shared_expert.up_proj.weight.shape, generator=gen, dtype=torch.float64) * std
            moe.shared_expert.up_proj.weight.copy_(shared.to(dtype))
            moe.shared_expert.down_proj.weight.zero_()
            moe.shared_expert_gate.weight.zero_()
    out_dir.mkdir(parents=True, exist_ok=True)
    dst.generation_config = GenerationConfig.from_model_config(cfg)
    if (src_dir / "generation_config.json").exists():
        dst.generation_config = GenerationConfig.from_pretrained(src_dir)
    dst.save_pretrained(out_dir)
    if (src_dir / "tokenizer_config.json").exists():  # a checkpoint without a tokenizer (tests) gets none
        AutoTokenizer.from_pretrained(src_dir).save_pretrained(out_dir)
    return out_dir


_KEPT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip
"""The Llama config's fields the upcycled Qwen2-MoE config keeps as they are."""


def _moe_config(src_cfg: Any, num_experts: int, top_k: int, shared_width: int) -> Any:
    """The Qwen2-MoE config of the upcycled model: the Llama's shapes, every layer sparse, experts as wide as the
    Llama's MLP, a shared expert of `shared_width`, renormalised top-k, no auxiliary loss."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **{name: getattr(src_cfg, name) for name in _KEPT_FIELDS},
        rope_parameters=dict(src_cfg.rope_parameters),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=src_cfg.intermediate_size,
        shared_expert_intermediate_size=shared_width,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        qkv_bias=False,
        router_aux_loss_coef=0.0,
    )
