"""Tiny random causal LMs for the rollout tests (built with from_config, saved with save_pretrained)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import LlamaConfig
from transformers import Qwen2Config
from transformers import Qwen3Config

VOCAB = 96
EOS = 2


def tiny_config(kind: str = "qwen2", tied: bool = False, **overrides):
    """A 2-layer, hidden-32 config; "qwen2" (untied, qkv bias), "qwen3" (q/k norms) or "llama" (tied embeddings by
    default); overrides replace any field (e.g. a wider model)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    common.update(overrides)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "qwen3":
        return Qwen3Config(**{"head_dim": 8, **common})
    return LlamaConfig(**common)


def tiny_model(kind: str = "qwen2", tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny causal LM in fp32, eval mode; logits scaled up so sampling is not uniform."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, tied), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model("qwen2", tied=False, seed=1).save_pretrained(path)
    return path
