"""Tiny random Hugging Face checkpoints for actor tests (written with save_pretrained into a directory).

    make_tiny_llama(dir)  LlamaForCausalLM, tied embeddings (like SmolLM2), GQA 4 query heads / 2 KV heads
    make_tiny_qwen2(dir)  Qwen2ForCausalLM, qkv bias, untied lm_head, GQA 4 / 2
    make_tiny_qwen3(dir)  Qwen3ForCausalLM, per-head q/k RMSNorm (q_norm, k_norm), no bias, untied, GQA 4 / 2
All: 2 layers, hidden 64, head_dim 16, vocab 200 (not a multiple of 128 * TP, so padding is exercised),
fp32 safetensors. Norm weights and biases are randomised too, so a missed or swapped tensor changes logits.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM
from transformers import Qwen2Config
from transformers import Qwen2ForCausalLM
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM

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
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def make_tiny_llama(path: str | Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """Save a tied-embedding GQA LlamaForCausalLM to `path`; returns the directory."""
    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": num_layers}, tie_word_embeddings=True, rope_theta=10000.0)
    model = LlamaForCausalLM(config).float()
    _randomise(model, seed)
    model.save_pretrained(path)
    return Path(path)


def make_tiny_qwen2(path: str | Path, *, seed: int = 1, num_layers: int = 2) -> Path:
    """Save an untied Qwen2ForCausalLM (qkv bias) to `path`; returns the directory."""
    config = Qwen2Config(
        **{**_COMMON, "num_hidden_layers": num_layers}, tie_word_embeddings=False, rope_theta=1000000.0
    )
    model = Qwen2ForCausalLM(config).float()
    _randomise(model, seed)
    model.save_pretrained(path)
    return Path(path)


def make_tiny_qwen3(path: str | Path, *, seed: int = 2, num_layers: int = 2) -> Path:
    """Save an untied Qwen3ForCausalLM (q_norm / k_norm, the attention of Qwen3-MoE) to `path`; returns it."""
    config = Qwen3Config(
        **{**_COMMON, "num_hidden_layers": num_layers}, head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0
    )
    model = Qwen3ForCausalLM(config).float()
    _randomise(model, seed)
    model.save_pretrained(path)
    return Path(path)


def load_hf(path: str | Path) -> torch.nn.Module:
    """The saved checkpoint as a transformers model (fp32, eval mode, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
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
    """tiny_checkpoints() and a Qwen3 one: each architecture the actor supports (model parity, export, planner)."""
    root = Path(tempfile.mkdtemp(prefix="tiny_hf_"))
    atexit.register(shutil.rmtree, root, True)
    return {**tiny_checkpoints(), "qwen3": make_tiny_qwen3(root / "qwen3")}
