"""Weight updates into the TransformersEngine and the bucketing WeightSync."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout import WeightSync
from megatron_dapo.rollout import WeightUpdateError
from megatron_dapo.rollout import bucket_named_tensors
from tests.rollout.conftest import tiny_model

IDS = torch.tensor([[1, 4, 9, 16, 25, 36, 49]])


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("kind,tied", [("qwen2", False), ("llama", True)])
def test_sync_makes_engine_logits_equal_source(kind, tied):
    engine = TransformersEngine(tiny_model(kind, tied, seed=0))
    source = tiny_model(kind, tied, seed=7)
    source.set_attn_implementation(engine.model.config._attn_implementation)  # the same attention arithmetic
    assert not torch.allclose(_logits(engine.model), _logits(source))
    named = list(source.state_dict().items())
    if tied:  # Megatron exports a tied model without lm_head.weight
        named = [(n, t) for n, t in named if n != "lm_head.weight"]
    metrics = WeightSync(engine, bucket_bytes=20_000).sync(iter(named))
    torch.testing.assert_close(_logits(engine.model), _logits(source), rtol=0, atol=0)
    assert metrics["weight_sync/num_buckets"] > 1
    assert metrics["weight_sync/bytes"] == sum(t.numel() * 4 for _, t in named)
    assert metrics["weight_sync/gb_per_s"] > 0


def test_bf16_source_is_cast_into_fp32_engine():
    engine = TransformersEngine(tiny_model(seed=0))
    source = tiny_model(seed=3).to(torch.bfloat16)
    WeightSync(engine).sync(source.state_dict().items())
    for name, p in engine.model.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, source.state_dict()[name].float(), rtol=0, atol=0)


def test_unknown_missing_and_misshaped_tensors_fail_naming_the_tensor():
    engine = TransformersEngine(tiny_model(seed=0))
    named = list(tiny_model(seed=1).state_dict().items())
    sync = WeightSync(engine)
    with pytest.raises(WeightUpdateError, match=r"unknown tensor 'model\.layers\.9\.mlp\.up_proj\.weight'") as err:
        sync.sync(named + [("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))])
    assert "\n" not in str(err.value)
    with pytest.raises(WeightUpdateError, match=r"tensor 'model\.norm\.weight' was not received") as err:
        sync.sync([(n, t) for n, t in named if n != "model.norm.weight"])
    assert "\n" not in str(err.value)
    bad = [(n, t[:-1] if n == "model.layers.1.self_attn.k_proj.weight" else t) for n, t in named]
    with pytest.raises(WeightUpdateError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(15, 32\)"):
        sync.sync(bad)
    # A partial update is allowed when asked for explicitly.
    sync.sync(named[:3], full=False)


def test_buckets_are_bounded_and_ordered():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 50, 5, 5, 5, 30])]  # fp32: 4 bytes each
    buckets = list(bucket_named_tensors(iter(named), bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"], ["t6"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for b in buckets:
        assert len(b) == 1 or sum(t.numel() * 4 for _, t in b) <= 80


def test_deepseeks_fused_a_projections_share_a_bucket():
    """SGLang 0.5.23's DeepSeek loader loads q_a_proj and kv_a_proj_with_mqa (and their FP8 scales) only together in
    one call (LOADED_TOGETHER): a bucket bound between them stretches the bucket; the next tensor starts a new one."""
    attn = "model.layers.3.self_attn."
    names = [f"{attn}q_a_proj.weight", f"{attn}q_a_proj.weight_scale_inv", f"{attn}q_a_layernorm.weight",
             f"{attn}q_b_proj.weight", f"{attn}kv_a_proj_with_mqa.weight", f"{attn}kv_a_proj_with_mqa.weight_scale_inv",
             f"{attn}kv_a_layernorm.weight", f"{attn}kv_b_proj.weight"]  # fmt: skip
    buckets = list(bucket_named_tensors(((n, torch.zeros(10)) for n in names), bucket_bytes=40))
    assert [[n for n, _ in b] for b in buckets] == [names[:6], names[6:7], names[7:]]


def test_rank_without_engine_drains_the_export():
    seen = []

    def export():
        for i in range(5):
            seen.append(i)
            yield f"w{i}", torch.ones(100)

    metrics = WeightSync(None, bucket_bytes=1000).sync(export())
    assert seen == list(range(5))
    assert metrics["weight_sync/num_buckets"] == 3 and metrics["weight_sync/bytes"] == 2000
