"""A tiny, fully offline model + tokenizer + dataset for CPU smoke runs (examples/tiny_cpu.yaml, CI).

The tokenizer is character-level over digits, a few symbols and ChatML markers (letters map to <unk>), so a random
model's samples are mostly digits and the "last_number" verifier gives it a few percent accuracy: enough mixed groups
for dynamic sampling to admit, which is all a smoke run needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHARS = list("0123456789") + list(" \n+-*=?:.") + list("Aanswer")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(out_dir: str | Path):
    """Save a character-level PreTrainedTokenizerFast with a ChatML chat template; returns it."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(CHARS), key=CHARS.index))}
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<pad>", bos_token=None
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    return tok


MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3")
"""The tiny MoE models make_tiny_model builds (moe_family)."""


def make_tiny_model(
    out_dir: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, moe: bool = False,
    moe_family: str = "qwen3_moe",
) -> Path:  # fmt: skip
    """A random tied-embedding GQA Llama (SmolLM2's architecture, scaled down) with the tiny tokenizer; moe=True: an
    untied MoE of the same size instead, every layer MoE with 8 experts of width 48, top-2: Qwen3-MoE (moe_family
    "qwen3_moe", its q/k norms, top-k renormalised), Mixtral ("mixtral": Llama's attention, full context), or GLM-4.5
    ("glm4_moe": the first layer dense, then a sigmoid router with a correction bias over 2 expert groups, scaled by
    2.5, a shared expert; q/k/v biases and norms, RoPE on half of each head), or DeepSeek-V3 ("deepseek_v3": that
    mixture of experts under multi-latent attention, q rank 32, kv rank 24, 8 + 8 q/k dims per head, 16 for v)."""
    from transformers import DeepseekV3Config
    from transformers import DeepseekV3ForCausalLM
    from transformers import Glm4MoeConfig
    from transformers import Glm4MoeForCausalLM
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM
    from transformers import MixtralConfig
    from transformers import MixtralForCausalLM
    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM

    if moe_family not in MOE_FAMILIES:
        raise ValueError(f"make_tiny_model: moe_family {moe_family!r} is not one of {MOE_FAMILIES}")

    out_dir = Path(out_dir)
    tok = make_tiny_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    sigmoid_moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                       n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                       first_k_dense_replace=1)  # GLM-4.5's and DeepSeek-V3's  # fmt: skip
    if moe and moe_family == "mixtral":
        common["intermediate_size"] = 48  # Mixtral's experts are intermediate_size wide
        config, cls = MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                                    tie_word_embeddings=False), MixtralForCausalLM  # fmt: skip
    elif moe and moe_family == "glm4_moe":
        config = Glm4MoeConfig(**common, **sigmoid_moe, attention_bias=True, use_qk_norm=True, head_dim=hidden // 4,
                               partial_rotary_factor=0.5, tie_word_embeddings=False)  # fmt: skip
        cls = Glm4MoeForCausalLM
    elif moe and moe_family == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]
        config = DeepseekV3Config(**common, **sigmoid_moe, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=8,
                                  qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)  # fmt: skip
        cls = DeepseekV3ForCausalLM
    elif moe:
        moe_fields = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
        config = Qwen3MoeConfig(**common, **moe_fields, head_dim=hidden // 4, tie_word_embeddings=False)
        cls = Qwen3MoeForCausalLM
    else:
        config, cls = LlamaConfig(**common, tie_word_embeddings=True), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float()
    for name, buffer in model.named_buffers():  # GLM-4.5's router bias (transformers starts it at 0): in use
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def make_tiny_run(
    root: str | Path, *, num_train: int = 64, num_test: int = 16, seed: int = 0, moe: bool = False,
    moe_family: str = "qwen3_moe",
) -> dict[str, str]:  # fmt: skip
    """Create root/model (tiny model; moe: the MoE one of moe_family) and root/data/{train,test}.jsonl (one-digit
    sums); returns their paths."""
    from megatron_dapo.data import make_dataset

    root = Path(root)
    model_dir = make_tiny_model(root / "model", seed=seed, moe=moe, moe_family=moe_family)
    kwargs = {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_negation": False,
        "allow_parentheses": False,
    }
    make_dataset(
        "basic_arithmetic",
        num_train=num_train,
        num_test=num_test,
        out_dir=root / "data",
        seed=seed,
        template="plain",
        formats=("jsonl",),
        task_kwargs=kwargs,
    )
    paths = {
        "model": str(model_dir),
        "train": str(root / "data" / "train.jsonl"),
        "test": str(root / "data" / "test.jsonl"),
    }
    (root / "paths.json").write_text(json.dumps(paths, indent=1))
    return paths


def tiny_overrides(paths: dict[str, str], run_dir: str | Path) -> list[str]:
    """The config overrides that point a run at `make_tiny_run`'s model and data, in run_dir, on one TP rank."""
    return [
        f"--actor.model_path={paths['model']}",
        f"--data.train_files={paths['train']}",
        f"--data.eval_files={paths['test']}",
        f"--trainer.run_dir={run_dir}",
        "--actor.tensor_parallel=1",
    ]


def make_sync_bench_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """The weight-sync benches' model (tools/bench/reshard.py, tools/bench/server_routes.py): a random Qwen2 of 43M
    parameters (vocab 16384, hidden 512, 8 layers, GQA 8/4, untied), saved in `dtype` to `path`."""
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    return Path(path)
