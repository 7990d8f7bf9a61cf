"""Tiny random Hugging Face checkpoints for actor tests (written with save_pretrained into a directory).

    make_tiny_llama(dir)  LlamaForCausalLM, tied embeddings (like SmolLM2), GQA 4 query heads / 2 KV heads
    make_tiny_qwen2(dir)  Qwen2ForCausalLM, qkv bias, untied lm_head, GQA 4 / 2
    make_tiny_qwen3(dir)  Qwen3ForCausalLM, per-head q/k RMSNorm (q_norm, k_norm), no bias, untied, GQA 4 / 2
    make_tiny_qwen3_moe(dir)  Qwen3MoeForCausalLM: Qwen3's attention, 4 MoE layers of 8 experts, top-2
                          (renormalised), expert width 38 (19 per TP rank: a multiple of nothing convenient)
    make_tiny_qwen2_moe(dir)  Qwen2MoeForCausalLM: qkv bias, 8 experts top-2 (not renormalised) + a gated shared
                          expert of width 44
    make_tiny_mixtral(dir)  MixtralForCausalLM: Llama's attention, 8 experts top-2 (renormalised) of width 38 (its
                          intermediate_size), no sliding window; checkpoint names block_sparse_moe.experts.e.w1/w3/w2
    make_tiny_glm4_moe(dir)  Glm4MoeForCausalLM (GLM-4.5): layer 0 dense, then 8 experts top-2 by a sigmoid router
                          with a random correction bias, limited to the best 1 of 2 expert groups, renormalised and
                          scaled by 2.5, an ungated shared expert of width 38; q/k/v bias, q/k norms, RoPE on half
                          of each head
    make_tiny_deepseek_v3(dir)  DeepseekV3ForCausalLM: GLM-4.5's MoE (first layer dense, sigmoid router with a bias,
                          2 groups choosing 1, scaled, a shared expert) under multi-latent attention: q rank 24, kv
                          rank 20, per head 8 no-rope + 4 rope dims for q/k, 10 for v (all split over TP=2); YaRN
                          RoPE as DeepSeek-V3's (factor 4 over 64 positions, mscale_all_dim 1)
All: 2 layers (MoE: 4), hidden 64, head_dim 16, vocab 200 (not a multiple of 128 * TP, so padding is exercised),
fp32 safetensors. Norm weights and biases are randomised too, so a missed or swapped tensor changes logits.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import DeepseekV3Config
from transformers import DeepseekV3ForCausalLM
from transformers import Glm4MoeConfig
from transformers import Glm4MoeForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForCausalLM
from transformers import MixtralConfig
from transformers import MixtralForCausalLM
from transformers import Qwen2Config
from transformers import Qwen2ForCausalLM
from transformers import Qwen2MoeConfig
from transformers import Qwen2MoeForCausalLM
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM

from megatron_dapo.actor.arch import is_moe

VOCAB = 200
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # GLM-4.5's router bias: large enough to change the choice
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def _save(model: torch.nn.Module, seed: int, path: str | Path) -> Path:
    """fp32, randomised (`_randomise`), saved with save_pretrained; returns the directory."""
    model = model.float()
    _randomise(model, seed)
    model.save_pretrained(path)
    return Path(path)


def make_tiny_llama(path: str | Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """Save a tied-embedding GQA LlamaForCausalLM to `path`; returns the directory."""
    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": num_layers}, tie_word_embeddings=True, rope_theta=10000.0)
    return _save(LlamaForCausalLM(config), seed, path)


def make_tiny_qwen2(path: str | Path, *, seed: int = 1, num_layers: int = 2) -> Path:
    """Save an untied Qwen2ForCausalLM (qkv bias) to `path`; returns the directory."""
    config = Qwen2Config(
        **{**_COMMON, "num_hidden_layers": num_layers}, tie_word_embeddings=False, rope_theta=1000000.0
    )
    return _save(Qwen2ForCausalLM(config), seed, path)


def make_tiny_qwen3(path: str | Path, *, seed: int = 2, num_layers: int = 2) -> Path:
    """Save an untied Qwen3ForCausalLM (q_norm / k_norm, the attention of Qwen3-MoE) to `path`; returns it."""
    config = Qwen3Config(
        **{**_COMMON, "num_hidden_layers": num_layers}, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0
    )
    return _save(Qwen3ForCausalLM(config), seed, path)


MOE_FIELDS = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=38, decoder_sparse_step=1, mlp_only_layers=[]
)
"""The tiny MoE models' routed experts: 8 of width 38 (19 per TP rank), top-2, every layer MoE."""


def make_tiny_qwen3_moe(path: str | Path, *, seed: int = 3, num_layers: int = 4) -> Path:
    """Save a Qwen3MoeForCausalLM (every layer MoE, 8 experts, top-2 renormalised) to `path`; returns it."""
    config = Qwen3MoeConfig(
        **{**_COMMON, "num_hidden_layers": num_layers},
        **MOE_FIELDS,
        norm_topk_prob=True,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    )
    return _save(Qwen3MoeForCausalLM(config), seed, path)


def make_tiny_qwen2_moe(path: str | Path, *, seed: int = 4, num_layers: int = 4) -> Path:
    """Save a Qwen2MoeForCausalLM (qkv bias, 8 experts top-2 not renormalised, gated shared expert) to `path`."""
    config = Qwen2MoeConfig(
        **{**_COMMON, "num_hidden_layers": num_layers},
        **MOE_FIELDS,
        shared_expert_intermediate_size=44,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    )
    return _save(Qwen2MoeForCausalLM(config), seed, path)


def make_tiny_mixtral(path: str | Path, *, seed: int = 5, num_layers: int = 4) -> Path:
    """Save a MixtralForCausalLM (every layer MoE, 8 experts of width 38, top-2 renormalised) to `path`."""
    experts = {k: v for k, v in MOE_FIELDS.items() if k in ("num_experts_per_tok",)}
    config = MixtralConfig(
        **{**_COMMON, "num_hidden_layers": num_layers, "intermediate_size": MOE_FIELDS["moe_intermediate_size"]},
        **experts,
        num_local_experts=MOE_FIELDS["num_experts"],
        sliding_window=None,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    )
    return _save(MixtralForCausalLM(config), seed, path)


SIGMOID_MOE_FIELDS = dict(
    n_routed_experts=MOE_FIELDS["num_experts"],
    num_experts_per_tok=MOE_FIELDS["num_experts_per_tok"],
    moe_intermediate_size=MOE_FIELDS["moe_intermediate_size"],
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
)
"""GLM-4.5's and DeepSeek-V3's mixture of experts in the tiny models: the first layer dense, then MOE_FIELDS' experts
behind a sigmoid router in 2 groups choosing 1, scaled by 2.5, with one shared expert."""


def make_tiny_glm4_moe(path: str | Path, *, seed: int = 6, num_layers: int = 4) -> Path:
    """Save a Glm4MoeForCausalLM (first layer dense, sigmoid group-limited router with a correction bias) to `path`."""
    config = Glm4MoeConfig(
        **{**_COMMON, "num_hidden_layers": num_layers},
        **SIGMOID_MOE_FIELDS,
        attention_bias=True,
        use_qk_norm=True,
        head_dim=16,
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    )
    return _save(Glm4MoeForCausalLM(config), seed, path)


def make_tiny_deepseek_v3(
    path: str | Path, *, seed: int = 7, num_layers: int = 4, q_lora_rank: int | None = 24
) -> Path:
    """Save a DeepseekV3ForCausalLM (multi-latent attention, GLM-4.5's mixture of experts) to `path`; q_lora_rank None:
    a full q projection (DeepSeek-V2-Lite's and Moonlight's form)."""
    config = DeepseekV3Config(
        **{**_COMMON, "num_hidden_layers": num_layers, "num_key_value_heads": 4},
        **SIGMOID_MOE_FIELDS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=20,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=10,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip
    return _save(DeepseekV3ForCausalLM(config), seed, path)


def load_hf(path: str | Path) -> torch.nn.Module:
    """The saved checkpoint as a transformers model (fp32, eval mode, eager attention)."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM

    # MoE: transformers' default grouped_mm experts need 16-byte strides (expert width 38 in fp32 has not): eager.
    moe = {"experts_implementation": "eager"} if is_moe(AutoConfig.from_pretrained(path)) else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **moe)
    return model.eval()


@functools.cache
def tiny_checkpoints() -> dict[str, Path]:
    """The Llama and Qwen2 tiny checkpoints (what the actor's feature tests run on), written once per process into a
    temporary directory removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="tiny_hf_"))
    atexit.register(shutil.rmtree, root, True)
    return {"llama": make_tiny_llama(root / "llama"), "qwen2": make_tiny_qwen2(root / "qwen2")}


@functools.cache
def every_tiny_checkpoint() -> dict[str, Path]:
    """tiny_checkpoints() and Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and DeepSeek-V3 ones: each architecture
    the actor supports (model parity, export, planner)."""
    root = Path(tempfile.mkdtemp(prefix="tiny_hf_"))
    atexit.register(shutil.rmtree, root, True)
    return {
        **tiny_checkpoints(),
        "qwen3": make_tiny_qwen3(root / "qwen3"),
        "qwen3_moe": make_tiny_qwen3_moe(root / "qwen3_moe"),
        "qwen2_moe": make_tiny_qwen2_moe(root / "qwen2_moe"),
        "mixtral": make_tiny_mixtral(root / "mixtral"),
        "glm4_moe": make_tiny_glm4_moe(root / "glm4_moe"),
        "deepseek_v3": make_tiny_deepseek_v3(root / "deepseek_v3"),
    }
