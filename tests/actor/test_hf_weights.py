"""HF -> Megatron -> HF is bit-exact; exported weights load into transformers and give identical logits."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers import AutoModelForCausalLM

from megatron_dapo.actor import hf_weights
from megatron_dapo.actor.hf_weights import hf_state_dict_keys
from tests.actor._actor_checks import MOE
from tests.actor._actor_checks import cached_results
from tests.actor._actor_checks import case_params
from tests.actor._actor_checks import layout_id
from tests.actor._actor_checks import tokens
from tests.actor._tiny_models import every_tiny_checkpoint
from tests.actor._tiny_models import load_hf

CASES = case_params()


def _expected_keys(name: str) -> set[str]:
    """The checkpoint's names: transformers' own state_dict, per-expert names as save_pretrained writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    model = load_hf(every_tiny_checkpoint()[name])
    keys = set(revert_weight_conversion(model, model.state_dict()))
    if model.config.tie_word_embeddings:
        keys.discard("lm_head.weight")
    return keys


@pytest.mark.parametrize(("world", "tp", "pp", "ep", "model"), CASES)
def test_roundtrip_bit_exact_on_every_rank(world, tp, pp, ep, model):
    expected = _expected_keys(model)
    order = hf_state_dict_keys(AutoConfig.from_pretrained(every_tiny_checkpoint()[model]))
    for rank, res in enumerate(cached_results(world)):
        out = res[f"{layout_id(tp, pp, ep)}/{model}"]
        assert set(out["export_keys"]) == expected == set(out["source_keys"]), rank
        assert out["export_keys"] == order, rank
        assert out["mismatched"] == [], rank
        assert out["dtypes"] == ["torch.float32"], rank
        assert out["small_bucket_same"], rank
        assert out["dst_ok"] == [True] * world, (rank, out["dst_ok"])  # export_hf_weights(dst_rank=r)


@pytest.mark.parametrize(("world", "tp", "pp", "ep", "model"), CASES)
def test_export_loads_into_transformers(world, tp, pp, ep, model):
    """The export (per-expert names for MoE, as in the checkpoint) loads into a fresh transformers model through its
    own checkpoint conversion (save_pretrained + from_pretrained) and gives the original's logits bit for bit."""
    exported = cached_results(world)[0][f"{layout_id(tp, pp, ep)}/{model}"]["exported"]
    path = every_tiny_checkpoint()[model]
    config = AutoConfig.from_pretrained(path)
    fresh = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    if model in MOE:  # fused experts in memory: load the exported names the way a checkpoint is loaded
        out = Path(tempfile.mkdtemp(prefix="export_"))
        save_file({k: v.contiguous() for k, v in exported.items()}, str(out / "model.safetensors"))
        config.save_pretrained(out)
        fresh = load_hf(out)
        shutil.rmtree(out)
    else:
        result = fresh.load_state_dict(exported, strict=False)
        assert result.unexpected_keys == []
        assert result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    if config.tie_word_embeddings:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        got = fresh(tokens()).logits
        want = load_hf(path)(tokens()).logits
    assert torch.equal(got, want)


class _Dims:
    heads, groups, head_dim, vocab = 8, 2, 3, 10


def test_qkv_layout_groups_heads_per_kv_head():
    d = _Dims()
    q = torch.arange(8 * 3).float().reshape(24, 1)
    k = 100 + torch.arange(2 * 3).float().reshape(6, 1)
    v = 200 + torch.arange(2 * 3).float().reshape(6, 1)
    fused = hf_weights._qkv_to_mcore(q, k, v, d)
    # group 0: q heads 0-3 (rows 0-11), k head 0 (rows 0-2), v head 0; then group 1.
    want = torch.cat([q[:12], k[:3], v[:3], q[12:], k[3:], v[3:]])
    assert torch.equal(fused, want)
    assert all(torch.equal(a, b) for a, b in zip(hf_weights._qkv_from_mcore(fused, d), (q, k, v)))
    bias = hf_weights._qkv_to_mcore(q[:, 0], k[:, 0], v[:, 0], d)
    assert torch.equal(bias, want[:, 0])


@pytest.mark.parametrize("kind", ["replicated", "row", "qkv", "fc1", "vocab"])
def test_shard_unshard_inverse(kind):
    d = _Dims()
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "replicated": [(5,)],
        "row": [(5, 6)],
        "qkv": [(24, 5), (6, 5), (6, 5)],
        "fc1": [(6, 5), (6, 5)],
        "vocab": [(10, 5)],
    }[kind]
    full = [torch.randn(s, generator=gen) for s in shapes]
    shards = [hf_weights._shard(kind, full, d, 2, r) for r in range(2)]
    if kind == "fc1":  # rank r holds [gate_r ; up_r]
        assert torch.equal(shards[1], torch.cat([full[0][3:], full[1][3:]]))
    if kind == "vocab":  # padded to 256 rows, split in two
        assert shards[0].shape == (128, 5) and torch.equal(shards[0][:10], full[0])
    back = hf_weights._unshard(kind, shards, d)
    assert len(back) == len(full) and all(torch.equal(a, b) for a, b in zip(back, full))


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf_weights._SafetensorsDir(tmp_path)
    ckpt = hf_weights._SafetensorsDir(every_tiny_checkpoint()["qwen2"])
    with pytest.raises(KeyError, match="model.safetensors: missing tensor 'nope'"):
        ckpt.get("nope", (1,))
    with pytest.raises(ValueError, match="has shape"):
        ckpt.get("model.norm.weight", (3,))


def test_a_checkpoint_tensor_the_converter_would_drop_is_named():
    """mbridge dropped Qwen2-MoE's shared-expert gate without a word (docs/integration.md): its loader walks the
    megatron parameters only. Ours also asks the other way: a checkpoint tensor no parameter takes (a family variant
    the converter does not map) is refused in one line; every tiny family's own tensors pass, as do a tied model's
    stored lm_head copy and cached rotary frequencies. (An o_proj bias stands for such a variant: no family here has
    one.)"""
    from transformers import AutoConfig

    for name, path in every_tiny_checkpoint().items():
        cfg = AutoConfig.from_pretrained(path)
        keys = hf_weights._SafetensorsDir(path).where
        assert hf_weights.unused_tensors(keys, cfg) == [], name
        extra = [*keys, "model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.rotary_emb.inv_freq"]
        assert hf_weights.unused_tensors(extra, cfg) == ["model.layers.0.self_attn.o_proj.bias"], name
        if hf_weights._dims(cfg).tied:
            assert "lm_head.weight" not in keys and hf_weights.unused_tensors([*keys, "lm_head.weight"], cfg) == []
