"""The pre-flight planner (megatron_dapo/plan.py, `megatron-dapo plan`) against hand calculations.

The expected numbers are derived by hand in docs/planning.md ("Worked example" sections) and written out here as
arithmetic on the model's config.json fields, not taken from the planner's output. GiB = 2**30 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_dapo import cli
from megatron_dapo.config import load_config
from megatron_dapo.plan import KNOWN_MODELS
from megatron_dapo.plan import Assumptions
from megatron_dapo.plan import PlanError
from megatron_dapo.plan import actor_stages
from megatron_dapo.plan import kv_bytes_per_token
from megatron_dapo.plan import make_plan
from megatron_dapo.plan import padded_vocab
from megatron_dapo.plan import parse_assumptions
from megatron_dapo.plan import resolve_model

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
CFG_32B = ROOT / "examples/qwen2.5_32b_dapo.yaml"
CFG_7B = ROOT / "examples/qwen2.5_7b_dapo.yaml"
CFG_30B_A3B = ROOT / "examples/qwen3_30b_a3b_dapo.yaml"


def _gib(num_bytes: float) -> float:
    return num_bytes / GiB


def _fields(obj) -> dict:
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dict(vars(obj))


def _with(config, section: str, **extra):
    """A stand-in for a RunConfig whose `section` has extra fields (e.g. actor.offload, not in this config.py)."""
    sections = _fields(config)
    sections[section] = types.SimpleNamespace(**{**_fields(sections[section]), **extra})
    return types.SimpleNamespace(**sections)


def _config(path: Path, *overrides: str):
    """The example config with actor.offload "none" whether or not config.py has that field (hand calculations)."""
    return _with(load_config(path, list(overrides)), "actor", offload="none")


def _stage(plan, phase: str, stage: int):
    return next(p for p in plan.phases if p.name == phase and p.stage == stage)


# ---------------------------------------------------------------------------------------------------------------
# model shapes
# ---------------------------------------------------------------------------------------------------------------
def test_parameter_counts_match_the_published_sizes():
    # Qwen2.5-32B: h 5120, L 64, heads 40 (q_dim 5120), kv 8 x 128 = 1024, ffn 27648, V 152064, untied, qkv bias.
    # layer = 5120*(5120+2*1024) + (5120+2*1024) + 5120*5120 + 3*5120*27648 + 2*5120
    #       = 36,700,160 + 7,168 + 26,214,400 + 424,673,280 + 10,240 = 487,605,248
    # N = 64 * 487,605,248 + 2 * 152064*5120 + 5120 = 31,206,735,872 + 1,557,135,360 + 5,120
    assert KNOWN_MODELS["qwen2.5-32b"].num_params == 32_763_876_352
    # Qwen2.5-7B: h 3584, L 28, heads 28, kv 4 x 128 = 512, ffn 18944.
    # layer = 3584*4608 + 4608 + 3584*3584 + 3*3584*18944 + 2*3584 = 233,057,792
    # N = 28 * 233,057,792 + 2 * 152064*3584 + 3584 = 6,525,618,176 + 1,089,994,752 + 3,584
    assert KNOWN_MODELS["qwen2.5-7b"].num_params == 7_615_616_512
    # SmolLM2-135M: h 576, L 30, heads 9, kv 3 x 64 = 192, ffn 1536, V 49152, tied, no bias.
    # layer = 576*960 + 576*576 + 3*576*1536 + 2*576 = 3,540,096; N = 30 * 3,540,096 + 49152*576 + 576
    assert KNOWN_MODELS["smollm2-135m"].num_params == 134_515_008


def test_config_json_is_read_when_the_model_is_local(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    fields = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    fields.update(
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]
    )
    (model_dir / "config.json").write_text(json.dumps(fields))
    shape, source = resolve_model(str(model_dir))
    assert source.endswith("config.json")
    assert shape.num_params == 134_515_008 and shape.tied and not shape.qkv_bias
    # Qwen2 architecture -> q/k/v biases: + 30 layers x (576 + 2*192) bias values
    (model_dir / "config.json").write_text(json.dumps({**fields, "architectures": ["Qwen2ForCausalLM"]}))
    assert resolve_model(str(model_dir))[0].num_params == 134_515_008 + 30 * 960
    del fields["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(fields))
    with pytest.raises(PlanError, match="hidden_size"):
        resolve_model(str(model_dir))
    with pytest.raises(PlanError, match="actor.model_path"):
        resolve_model(str(tmp_path / "Unknown-3B"))
    assert resolve_model("/nowhere/Qwen2.5-7B-Instruct")[0].name == "Qwen2.5-7B"


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"])
def test_moe_parameter_counts_are_transformers(name):
    """Every expert, the router and (Qwen2-MoE) the gated shared expert counted as transformers counts them; the
    active parameters are those less the experts a token does not go through."""
    from tests.actor._tiny_models import every_tiny_checkpoint
    from tests.actor._tiny_models import load_hf

    path = every_tiny_checkpoint()[name]
    shape, _ = resolve_model(str(path))
    assert shape.experts == 8 and shape.topk == 2 and shape.moe_ffn == 38
    model = load_hf(path)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert shape.active_params == shape.num_params - experts * (8 - 2) // 8


def test_glm45_air_counts_are_the_published_ones():
    """GLM-4.5-Air as zai-org publishes it: 106 B parameters, 12 B active (embeddings aside); the first of its 46 layers
    dense (10944 wide), the others 128 experts of 1408 plus a shared one, no shared-expert gate, the router's
    correction bias a buffer (not counted, as transformers does not count it)."""
    m = KNOWN_MODELS["glm-4.5-air"]
    assert (m.dense_layers, m.moe_layers, m.shared_ffn, m.shared_gate) == (1, 45, 1408, False)
    assert round(m.num_params / 1e9) == 107 and round((m.active_params - 2 * m.vocab * m.hidden) / 1e9) == 12
    dense, moe = m.layer_params(0), m.layer_params(1)
    assert dense[1] == 0 and dense[2] == 2 * m.hidden and moe[1] == 128 * 3 * m.hidden * 1408
    assert moe[2] == 2 * m.hidden + 128 * m.hidden  # norms and the router, no gate


def test_deepseek_v3_counts_are_the_published_ones():
    """DeepSeek-V3 as deepseek-ai publishes it: 671 B parameters, 37 B active (its MTP module aside); multi-latent
    attention's projections per layer (q 7168 -> 1536 -> 128 x 192, kv 7168 -> 512 + 64 -> 128 x 256, o 128 x 128 ->
    7168) and its cache, the compressed latent: 61 x (512 + 64) x 2 bytes per token on every GPU of an engine."""
    m = KNOWN_MODELS["deepseek-v3"]
    assert round(m.num_params / 1e9) == 671 and int(m.active_params / 1e9) == 37
    h = 7168
    assert m.attention_shapes == [(1536, h), (128 * 192, 1536), (576, h), (128 * 256, 512), (h, 128 * 128)]
    assert m.attention_norms == 1536 + 512 and m.moe_layers == 58
    assert kv_bytes_per_token(m, 8, 2) == kv_bytes_per_token(m, 32, 2) == 61 * 576 * 2


# ---------------------------------------------------------------------------------------------------------------
# worked example 3: Qwen3-30B-A3B (MoE) on two nodes (examples/qwen3_30b_a3b_dapo.yaml)
# ---------------------------------------------------------------------------------------------------------------
def test_qwen3_30b_a3b_two_nodes_matches_the_hand_calculation():
    m = KNOWN_MODELS["qwen3-30b-a3b"]
    # h 2048, L 48, 32 heads x 128 (q 4096), 4 KV heads (kv 512), 128 experts of 768, top-8, V 151,936, untied.
    # 30,532,122,624 - 48 x 120 unused experts x 3 x 2048 x 768 = 3,353,032,704 (the model card: 30.5 B, 3.3 B active)
    assert m.num_params == 30_532_122_624 and m.active_params == 3_353_032_704
    plan = make_plan(load_config(CFG_30B_A3B), nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    # TP 1 x PP 1 -> DP 16; EP 8 -> expert DP 2. Per GPU and layer: attention 2048 x 5120 + 4096 x 2048 =
    # 18,874,368; experts 128 x 3 x 2048 x 768 / 8 = 75,497,472; norms, q/k norms and the router 2 x 2048 + 2 x 128 +
    # 128 x 2048 = 266,496; x 48 = 4,542,640,128. Embedding and LM head 151,936 x 2048 each (V a multiple of 128).
    experts = 48 * 75_497_472
    n = 48 * (18_874_368 + 75_497_472 + 266_496) + 2 * 151_936 * 2048 + 2048
    (stage,) = actor_stages(m, 1, 1, 8)
    assert (stage.params, stage.expert_params) == (n, experts) == (5_164_972_032, 3_623_878_656)
    update = plan.peak("update")
    # bf16: params 2 B, fp32 grads 4 B; the optimizer (fp32 master + Adam m, v: 12 B) over DP 16 for the dense part
    # and over expert DP 2 for the experts: 0.75 and 6 B per parameter.
    assert update.term("actor optimizer") == pytest.approx(_gib((n - experts) * 12 / 16 + experts * 12 / 2), abs=1e-9)
    # Stored activations (full recompute, no sequence parallel): 48 x h x 2 B x T; the recomputed layer per token:
    # norms 4h*2 + 8, q/k/v/o (2 q + 2 kv) x 2, the MoE MLP k x 3 x 768 + 2 k h (dispatched copies) x 2, softmax
    # stats 4 x 32, fp32 router 8 x 128.
    t = 20_480
    layer = 4 * 2048 * 2 + 8 + (2 * 4096 + 2 * 512 + 8 * 3 * 768 + 2 * 8 * 2048) * 2 + 4 * 32 + 8 * 128
    # The fused LM head's backward scratch: 5 token chunks of 4,096, tiles of 4,096 x 2,048 (fp32 + bf16), the fp32
    # d_hidden accumulator and an fp32 [2048, h] d_weight accumulator.
    tiles = 4096 * 2048 * 6 + t * 2048 * 4 + 2048 * 2048 * 4
    lm = 2 * t * 2048 * 2 + 12 * t + 151_936 * 2048 * 2 + tiles
    state = 2.5 + 1.0 + _gib(n * 2) + _gib(n * 4) + update.term("actor optimizer")
    assert update.total_gib == pytest.approx(state + _gib(48 * 2048 * 2 * t + layer * t + lm), abs=1e-9)
    # All-to-all per pass: 48 layers x tokens per GPU (2048 rows x 2713.6 / 16) x 2 k h b x 7/8 over NVLink.
    a2a = 48 * (2048 * 2713.6 / 16) * 2 * 8 * 2048 * 2 * 7 / 8 / 360e9
    flops = 2048 * 2713.6 * (2 * 3_353_032_704 + 2 * 48 * 4096 * 2713.6) / (16 * 989e12 * 0.35)
    assert plan.times_s["log-probs"] == pytest.approx(flops + a2a)
    assert plan.times_s["update"] == pytest.approx(4 * (flops + a2a))  # full recompute: 4 passes
    assert plan.exit_code == 0


def test_padded_vocab_is_megatrons():
    from megatron_dapo.actor.model import padded_vocab_size

    for vocab, tp in [(152064, 1), (152064, 8), (152064, 4), (49152, 3), (200, 2)]:
        assert padded_vocab(vocab, tp) == padded_vocab_size(vocab, tp)
    assert padded_vocab(152064, 8) == 152_576  # ceil(152064 / 1024) = 149 -> 149 * 1024


# ---------------------------------------------------------------------------------------------------------------
# worked example 1: the shipped 4-node Qwen2.5-32B layout (docs/planning.md)
# ---------------------------------------------------------------------------------------------------------------
def test_qwen32b_four_nodes_matches_the_hand_calculation():
    plan = make_plan(_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    # Layout: 32 GPUs, TP 8 x PP 2 -> DP 2.  Per GPU and layer: 487,595,008 / 8 + 10,240 = 60,959,616 params;
    # 32 layers per stage = 1,950,707,712; vocab 152,576 / 8 = 19,072 rows x 5120 = 97,648,640.
    stage0 = 1_950_707_712 + 97_648_640  # + embedding             = 2,048,356,352
    stage1 = 1_950_707_712 + 97_648_640 + 5120  # + LM head + final norm = 2,048,361,472
    assert [s.params for s in actor_stages(plan.model, 8, 2)] == [stage0, stage1]
    # Bytes per parameter, distributed optimizer at DP 2: bf16 param 2, fp32 grad 4, (fp32 master 4 + Adam 8) / 2 = 6.
    p1, g1, o1, m1 = _gib(2 * stage1), _gib(4 * stage1), _gib(6 * stage1), _gib(2 * stage1)  # 3.815, 7.631, 11.446
    # Engine start (stage 1, the fuller one), in generation's memory state (offload none: the actor as built):
    # free = 80 - 2.5 - 1.0 - P - G - master(4/2 B) = 61.239 GiB.
    free = 80 - 2.5 - 1.0 - p1 - g1 - m1
    # SGLang TP 4 weights: (32,763,215,872 sharded / 4 + 64*10,240 + 5120 replicated) x 2 B = 15.258 GiB.
    weights = _gib((32_763_215_872 / 4 + 64 * 10_240 + 5120) * 2)
    kv = 0.6 * free - weights  # 36.743 - 15.258 = 21.486 GiB
    start = plan.peak("engine start")
    assert start.stage == 1
    assert start.term("engine weights") == pytest.approx(weights, abs=1e-9)
    assert start.term("engine KV cache") == pytest.approx(kv, abs=1e-9)
    assert kv == pytest.approx(21.4856, abs=1e-3)
    # KV bytes/token/GPU = 2 x 64 layers x (8 kv heads / TP 4) x 128 x 2 B = 65,536 -> 352,015 tokens per engine.
    assert int(kv * GiB // 65_536) == 352_015
    # Generation = runtimes 3.5 + P + G + O (Adam exists after step 1) + 0.6 * free + graphs 2 + workspace 2.
    gen = plan.peak("generation")
    assert gen.total_gib == pytest.approx(3.5 + p1 + g1 + o1 + 0.6 * free + 4.0, abs=1e-9)
    assert gen.total_gib == pytest.approx(67.135, abs=1e-3)
    # Update (stage 0: two micro-batches in flight under 1F1B). T = 1 x (2048 + 20480) = 22,528 tokens.
    # Full recompute keeps each layer's input, split 8 ways by sequence parallelism: 5120 x 2 B / 8 = 1280 B/token
    # -> 2 x 32 x 1280 x 22,528 = 1.719 GiB; plus one layer recomputed without recompute:
    # (4*5120*2 + 8)/8 + (2*5120 + 2*1024 + 3*27648)*2/8 + 4*40/8 = 5121 + 23,808 + 20 = 28,949 B/token.
    p0, g0, o0 = _gib(2 * stage0), _gib(4 * stage0), _gib(6 * stage0)
    upd = _stage(plan, "update", 0)
    assert upd.term("activations (stored)") == pytest.approx(_gib(2 * 32 * 1280 * 22_528), abs=1e-9)
    assert upd.term("activations (recomputed layer)") == pytest.approx(_gib(28_949 * 22_528), abs=1e-9)
    expected_update = 3.5 + p0 + g0 + o0 + _gib(2 * 32 * 1280 * 22_528) + _gib(28_949 * 22_528)
    assert upd.total_gib == pytest.approx(expected_update, abs=1e-9)
    assert upd.total_gib == pytest.approx(28.718, abs=1e-3)
    # Stage 1's update holds one micro-batch and the fused_linear LM head (the hidden is gathered over the sequence
    # before the op): 2*T*h*2 + 12*T + 19,072*5120*2 bytes, plus the op's backward scratch: T = 22,528 tokens take 6
    # chunks of 3,755 (<= 4,096), tiles of 3,755 x 2,048 columns (the power of two within 8M elements) in fp32 and
    # bf16, the fp32 d_hidden accumulator and (several chunks) an fp32 [2048, h] d_weight accumulator.
    upd1 = _stage(plan, "update", 1)
    tiles = 3755 * 2048 * (4 + 2) + 22_528 * 5120 * 4 + 2048 * 5120 * 4
    lm = 2 * 22_528 * 5120 * 2 + 12 * 22_528 + 19_072 * 5120 * 2 + tiles
    assert upd1.term("LM head (fused_linear)") == pytest.approx(_gib(lm), abs=1e-9)
    # With it the last stage's update is the fuller one: one micro-batch in flight less (32 x 1280 x T stored), the LM
    # head and its final norm's 5120 parameters (12 B each) more.
    assert plan.peak("update").stage == 1
    assert upd1.total_gib - upd.total_gib == pytest.approx(_gib(lm - 32 * 1280 * 22_528 + 12 * 5120), abs=1e-9)
    # Sync = runtimes + P + G + O + engine weights + 2 x 2048 MiB buckets (4 GiB) = 45.65 GiB.
    assert plan.peak("sync").total_gib == pytest.approx(3.5 + p1 + g1 + o1 + weights + 4.0, abs=1e-9)
    assert plan.exit_code == 0 and plan.failing == []


def test_missing_offload_field_is_planned_as_none_with_a_note():
    cfg = load_config(CFG_32B)
    plan = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    has_field = hasattr(cfg.actor, "offload")
    assert any("config has no actor.offload" in n for n in plan.notes) != has_field
    if not has_field:
        explicit = make_plan(_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
        assert [p.total_gib for p in plan.phases] == [p.total_gib for p in explicit.phases]


def test_qwen32b_step_time_matches_the_hand_calculation():
    plan = make_plan(_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    n = 32_763_876_352
    # Log-probs: 512 x 16 = 8192 rows of 256 + 0.3 x 20480 = 6400 tokens (packed: no padding computed); forward
    # FLOPs per token 2N + 2 x 64 layers x 5120 x 6400; PP bubble 1 + 1/256; at 32 x 989e12 x 0.35 FLOP/s.
    fwd = 2 * n + 2 * 64 * 5120 * 6400
    logprobs = 8192 * 6400 * fwd * (1 + 1 / 256) / (32 * 989e12 * 0.35)
    assert plan.times_s["log-probs"] == pytest.approx(logprobs, rel=1e-12)
    assert plan.times_s["update"] == pytest.approx(4 * logprobs, rel=1e-12)  # fwd + 2 bwd + recompute fwd
    # Sync: S = 2N bytes; TP gather S*7/8/360e9 + PP broadcast over nodes S/2/40e9 + IPC S/400e9 + 31 buckets x
    # 0.2 s (SGLang's round trip per bucket) + 3 s of engine memory release / resume.
    s = 2 * n
    sync = s * 7 / 8 / 360e9 + s / 2 / 40e9 + s / 400e9 + 31 * 0.2 + 3.0
    assert plan.times_s["sync"] == pytest.approx(sync, rel=1e-12)
    # Generation, the stream: keep 0.5 -> 1024 sampled prompts x 16 x 6144 decode tokens in one pass, then one tail.
    # Per-sequence speed 60 tok/s (8.19e9 params per GPU at engine TP 4); the KV pool holds 352,015 / (256 + 6144)
    # = 55.0 sequences, so an engine decodes 55.0 x 60 = 3300 tok/s (< 1500 x 4 at a full batch); 8 engines.
    tps_seq = 60 * 8.2e9 / (n / 4)
    engine_tps = 352_015 / 6400 * tps_seq
    stream = 1024 * 16 * 6144 / (8 * engine_tps) + 20480 / tps_seq
    assert plan.times_s["generation"] == pytest.approx(stream, rel=1e-9)
    # The sequential rounds it replaced, on the same engines: 2 rounds, each its pass slowed by the slowest static
    # shard (x 1.5) plus its own tail.
    rounds = 2 * (512 * 16 * 6144 / (8 * engine_tps) * 1.5 + 20480 / tps_seq)
    assert f"as sequential rounds it was {rounds:,.0f} s" in plan.time_formulas["generation"]
    # Partial rollouts carry the tail instead of waiting for it.
    partial = make_plan(_config(CFG_32B, "--rollout.partial=true"), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    assert partial.times_s["generation"] == pytest.approx(stream - 20480 / tps_seq, rel=1e-9)
    # Evaluation every 10 steps (30 AIME prompts x 32 samples) and a checkpoint every 10 (14 B/param over 4 nodes).
    eval_once = 30 * 32 * 6144 / (8 * engine_tps) + 20480 / tps_seq
    assert plan.times_s["eval"] == pytest.approx(eval_once / 10, rel=1e-9)
    assert plan.times_s["checkpoint"] == pytest.approx(14 * n / (4 * 2e9) / 10, rel=1e-12)
    assert plan.times_s["offload"] == 0.0


def test_fp8_rollout_weights_are_one_byte_per_linear_parameter_and_shrink_the_sync():
    bf16 = make_plan(_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    fp8 = make_plan(_config(CFG_32B, "--rollout.weight_dtype=fp8"), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    h, q, kv, f, layers = 5120, 5120, 1024, 27648, 64
    linear = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]
    blocks = sum(-(-r // 128) * -(-c // 128) for r, c in linear)
    fp8_linear = layers * (sum(r * c for r, c in linear) + 4 * blocks)
    rest = layers * (q + 2 * kv) * 2 + 2 * 152_064 * h * 2  # qkv biases, embedding and LM head stay bf16
    replicated = (layers * 2 * h + h) * 2
    weights = _gib((fp8_linear + rest) / 4 + replicated)
    assert fp8.peak("engine start").term("engine weights") == pytest.approx(weights, abs=1e-9)
    assert weights < 0.55 * bf16.peak("engine start").term("engine weights")
    # The freed weight memory goes to the KV pool (the same mem_fraction of the same free memory).
    gained = bf16.peak("engine start").term("engine weights") - weights
    assert fp8.peak("engine start").term("engine KV cache") == pytest.approx(
        bf16.peak("engine start").term("engine KV cache") + gained, abs=1e-9
    )
    assert "(FP8)" in fp8.time_formulas["sync"] and fp8.times_s["sync"] < bf16.times_s["sync"]


# ---------------------------------------------------------------------------------------------------------------
# worked example 2: Qwen2.5-7B on one node (examples/qwen2.5_7b_dapo.yaml)
# ---------------------------------------------------------------------------------------------------------------
def test_qwen7b_one_node_matches_the_hand_calculation():
    plan = make_plan(_config(CFG_7B), nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    # TP 2 x PP 1 -> DP 4. Per GPU and layer 233,050,624 / 2 + 7168 = 116,532,480; x 28 = 3,262,909,440.
    # Vocab 152,064 is a multiple of 256: 76,032 rows x 3584 = 272,498,688, embedding + LM head, + final norm.
    n = 3_262_909_440 + 2 * 272_498_688 + 3584  # = 3,807,910,400
    assert [s.params for s in actor_stages(plan.model, 2, 1)] == [n]
    p, g, o, m = _gib(2 * n), _gib(4 * n), _gib(3 * n), _gib(1 * n)  # opt (4 + 8) / 4 = 3 B; master 4 / 4 = 1 B
    free = 80 - 3.5 - p - g - m  # 51.675 GiB
    weights = _gib(7_615_616_512 * 2)  # engine TP 1: the whole model, 14.185 GiB
    kv = 0.6 * free - weights  # 16.820 GiB; 2 x 28 x 4 x 128 x 2 = 57,344 B/token
    start = plan.peak("engine start")
    assert start.term("engine KV cache") == pytest.approx(kv, abs=1e-9)
    assert kv == pytest.approx(16.820, abs=1e-3)
    gen = plan.peak("generation")
    assert gen.total_gib == pytest.approx(3.5 + p + g + o + 0.6 * free + 4.0, abs=1e-9)
    assert gen.total_gib == pytest.approx(70.423, abs=1e-3)
    # Update: T = max(budget 20,480, one row 2048 + 8192) = 20,480; full recompute under sequence parallelism
    # 28 x 3584 x 2 B / 2 x T; recomputed layer (4*3584*2 + 8)/2 + (2*3584 + 2*512 + 3*18944)*2/2 + 4*28/2 =
    # 14,340 + 65,024 + 56 = 79,420 B/token; LM head 2*T*3584*2 + 12*T + 76,032*3584*2 and its backward scratch
    # (5 token chunks of 4,096, tiles of 4,096 x 2,048 in fp32 + bf16, fp32 d_hidden, fp32 [2048, h] d_weight).
    tiles = 4096 * 2048 * 6 + 20_480 * 3584 * 4 + 2048 * 3584 * 4
    lm = 2 * 20_480 * 3584 * 2 + 12 * 20_480 + 76_032 * 3584 * 2 + tiles
    acts = 28 * 3584 * 20_480 + 79_420 * 20_480 + lm
    assert plan.peak("update").total_gib == pytest.approx(3.5 + p + g + o + _gib(acts), abs=1e-9)
    assert plan.peak("update").total_gib == pytest.approx(39.975, abs=1e-3)
    # ~17 micro-batches per DP rank: 512 / 4 = 128 rows x (256 + 0.3 x 8192) tokens / 20,480 = 16.96 -> 17
    assert "~17 micro-batches" in plan.layout["micro-batch"]
    # Sync: + engine weights + 2 x 1024 MiB.
    assert plan.peak("sync").total_gib == pytest.approx(3.5 + p + g + o + weights + 2.0, abs=1e-9)
    assert plan.exit_code == 0


# ---------------------------------------------------------------------------------------------------------------
# what changes the answer
# ---------------------------------------------------------------------------------------------------------------
def test_a_layout_that_does_not_fit_exits_2_naming_the_phase():
    cfg = _config(CFG_32B, "--actor.pipeline_parallel=1")
    plan = make_plan(cfg, nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    assert plan.exit_code == 2
    assert [p.name for p in plan.failing] == ["generation", "sync"]
    assert "DOES NOT FIT: generation (stage 0" in plan.report()
    # The same layout on 141 GiB GPUs fits.
    assert make_plan(cfg, nodes=1, gpus_per_node=8, gpu_memory_gb=141).exit_code == 0


def test_an_evaluation_planned_longer_than_its_timeout_exits_2_naming_the_fields():
    """The shipped 32B job plans one evaluation at ~9.4 min (30 AIME prompts x 32 samples, eval_every 10): within
    trainer.eval_timeout_minutes=60, outside 5; 32 rows per AIME prompt would be de-duplicated (data.drop_duplicates)
    and eval_max_prompts caps the prompts."""
    assert make_plan(load_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80).over_timeouts == []
    short = make_plan(load_config(CFG_32B, ["--trainer.eval_timeout_minutes=5"]), nodes=4, gpus_per_node=8,
                      gpu_memory_gb=80)  # fmt: skip
    assert short.exit_code == 2 and not short.failing
    (line,) = short.over_timeouts
    assert line.startswith("one evaluation is planned at 9.4 min, more than trainer.eval_timeout_minutes=5 (lower ")
    assert f"OUTLASTS ITS TIMEOUT: {line}" in short.report()
    fewer = ["--trainer.eval_timeout_minutes=10", "--trainer.eval_max_prompts=10"]  # 6.9 min
    assert make_plan(load_config(CFG_32B, fewer), nodes=4, gpus_per_node=8, gpu_memory_gb=80).exit_code == 0


def test_kv_cache_smaller_than_one_sequence_fails_engine_start():
    cfg = load_config(CFG_32B, ["--rollout.mem_fraction=0.26"])
    plan = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    # 0.26 x 61.24 = 15.92 GiB - 15.26 weights = 0.67 GiB = 10,900 tokens < 22,528: SGLang could not hold one.
    assert plan.failing[0].name == "engine start" and "KV cache holds < 1 sequence" in plan.failing[0].error
    assert plan.exit_code == 2


def test_offload_setting_changes_what_coexists():
    base = load_config(CFG_32B)
    plans = {
        mode: make_plan(_with(base, "actor", offload=mode), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
        for mode in ("none", "optimizer", "all")
    }
    n = 2_048_361_472  # stage 1 params per GPU (compare stage 1 throughout: offload=all makes stage 0 the peak)
    gen = {k: _stage(p, "generation", 1).total_gib for k, p in plans.items()}
    # Off the GPU while generating: the optimizer (6 B/param), or params + grads + optimizer (12 B/param); the engine,
    # started in that state, takes mem_fraction 0.6 of what left beside it at its start (the master copy, 2 B/param,
    # with "optimizer"; params + grads + master, 8 B/param, with "all") for its KV pool.
    assert gen["none"] - gen["optimizer"] == pytest.approx(_gib(6 * n) - 0.6 * _gib(2 * n), abs=1e-9)
    assert gen["none"] - gen["all"] == pytest.approx(_gib(12 * n) - 0.6 * _gib(8 * n), abs=1e-9)
    sync = {k: _stage(p, "sync", 1).total_gib for k, p in plans.items()}
    assert sync["none"] - sync["all"] == pytest.approx(_gib(10 * n), abs=1e-9)  # params stay for the export
    assert not any("actor.offload" in note for note in plans["all"].notes)
    # Training phases hold the whole actor state whatever the offload.
    assert plans["all"].peak("update").total_gib == plans["none"].peak("update").total_gib
    # The engine starts in generation's memory state, so what offload frees goes to its KV pool: with "all" SGLang
    # sees 80 - 3.5 GiB free (0.6 x 76.5 - 15.258 = 30.642 GiB of KV instead of 21.486 beside the actor as built).
    kv = {k: _stage(p, "engine start", 1).term("engine KV cache") for k, p in plans.items()}
    assert kv["all"] == pytest.approx(0.6 * 76.5 - _gib((32_763_215_872 / 4 + 64 * 10_240 + 5120) * 2), abs=1e-9)
    assert kv["all"] == pytest.approx(30.642, abs=1e-3)
    assert kv["optimizer"] == pytest.approx(kv["none"] + 0.6 * _gib(2 * n), abs=1e-9)


def test_logits_impl_and_recompute_modes():
    base = _config(CFG_32B)
    fused = make_plan(_config(CFG_32B, "--actor.logprob_impl=fused"), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    upd1 = _stage(fused, "update", 1)
    # Full logits [T, V_pad/8] in bf16 plus their gradient: 2 x 22,528 x 19,072 x 2 B + 12 x 22,528.
    assert upd1.term("LM head (fused)") == pytest.approx(_gib(2 * 22_528 * 19_072 * 2 + 12 * 22_528), abs=1e-9)
    none = make_plan(_with(base, "actor", recompute="none"), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    sel = make_plan(_with(base, "actor", recompute="selective"), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    # No recompute, sequence parallel: 2 micro-batches x 32 layers x 28,949 B x 22,528 = 38.9 GiB on stage 0.
    assert none.peak("update").term("activations (stored)") == pytest.approx(_gib(2 * 32 * 28_949 * 22_528))
    assert none.exit_code == 0
    # Selective drops only the softmax stats (4 x 40 / 8 = 20 B per token and layer) under flash attention.
    assert sel.peak("update").term("activations (stored)") == pytest.approx(_gib(2 * 32 * 28_929 * 22_528))
    # Without sequence parallelism the norms' 4*h*b + 8 stay whole on every TP rank: 40,968 + 23,808 + 20 = 64,796
    # B/token -> 87.0 GiB of activations: the update does not fit.
    no_sp = make_plan(_with(base, "actor", recompute="none", sequence_parallel=False), nodes=4, gpus_per_node=8,
                      gpu_memory_gb=80)  # fmt: skip
    assert no_sp.peak("update").term("activations (stored)") == pytest.approx(_gib(2 * 32 * 64_796 * 22_528))
    assert [p.name for p in no_sp.failing] == ["update"]


def test_token_budget_per_microbatch_is_used_when_the_config_has_one():
    cfg = _with(_config(CFG_32B), "actor", max_tokens_per_microbatch=32_768)
    plan = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    assert "at most 32768 tokens (actor.max_tokens_per_microbatch 32768" in plan.layout["micro-batch"]
    # stage 0 under full recompute + SP: 2 in flight x 32 layers x 1280 B x 32,768 tokens
    assert _stage(plan, "update", 0).term("activations (stored)") == pytest.approx(_gib(2 * 32 * 1280 * 32_768))
    # 256 rows per DP rank x 6400 mean tokens / 32,768 = 50 micro-batches
    assert "~50 micro-batches" in plan.layout["micro-batch"]
    # A budget below one row at the cap: that row is a micro-batch alone, T = 22,528.
    small = make_plan(_with(cfg, "actor", max_tokens_per_microbatch=8192), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    assert _stage(small, "update", 0).term("activations (stored)") == pytest.approx(_gib(2 * 32 * 1280 * 22_528))


def test_server_mode_plans_only_the_actor():
    cfg = load_config(CFG_32B, ["--rollout.mode=server", "--rollout.server_urls=[http://a:1,http://b:1]"])
    plan = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    assert {p.name for p in plan.phases} == {"log-probs", "update", "sync"}
    n = 2_048_361_472  # stage 1: trainer runtime + params, grads, optimizer (12 B) + 2 x 2048 MiB buckets
    assert plan.peak("sync").total_gib == pytest.approx(2.5 + _gib(12 * n) + 4.0, abs=1e-9)
    assert all(t.name != "engine weights" for p in plan.phases for t in p.terms)
    assert any("server mode" in n for n in plan.notes)
    # Async with servers: the engines already run apart, only the overlap changes.
    t, sched = plan.times_s, plan.async_plan
    want = max(t["generation"], t["log-probs"] + t["update"]) + t["sync"] + t["eval"] + t["checkpoint"]
    assert sched.engine_gpus == 0 and sched.step_s == pytest.approx(want, rel=1e-12)
    assert "on the same servers + 32 actor GPUs" in plan.report()


def test_bad_layouts_and_assumptions_are_named():
    cfg = load_config(CFG_32B)
    with pytest.raises(PlanError, match="must divide 24 GPUs"):
        make_plan(cfg, nodes=3, gpus_per_node=8, gpu_memory_gb=80)
    with pytest.raises(PlanError, match="actor.pipeline_parallel: 3"):
        make_plan(load_config(CFG_32B, ["--actor.pipeline_parallel=3"]), nodes=3, gpus_per_node=8, gpu_memory_gb=80)
    with pytest.raises(PlanError, match="--assume mfu"):
        parse_assumptions(["mfu=2"])
    with pytest.raises(PlanError, match="NAME=VALUE"):
        parse_assumptions(["nope=1"])
    a = parse_assumptions(["mfu=0.7", "cuda_graph_gib=3"])
    assert (a.mfu, a.cuda_graph_gib) == (0.7, 3.0)
    slow = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    fast = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80, assumptions=a)
    assert fast.times_s["update"] == pytest.approx(slow.times_s["update"] / 2)
    assert fast.peak("generation").total_gib == pytest.approx(slow.peak("generation").total_gib + 1.0)
    assert Assumptions().safety_gib == 2.0


# ---------------------------------------------------------------------------------------------------------------
# the command line and train's start check
# ---------------------------------------------------------------------------------------------------------------
def test_cli_plan_prints_the_plan_and_exit_codes(capsys):
    assert cli.main(["plan", "--config", str(CFG_32B), "--nodes", "4", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "generation    stage 1:   67.14  fits" in out and "assumptions" in out and "mfu = 0.35" in out
    code = cli.main(["plan", "--config", str(CFG_32B), "--nodes", "1", "--actor.pipeline_parallel=1"])
    assert code == 2
    assert "DOES NOT FIT: generation" in capsys.readouterr().out
    assert cli.main(["plan", "--config", str(CFG_32B), "--nodes", "4", "--assume", "bogus=1"]) == 2
    assert "--assume 'bogus=1'" in capsys.readouterr().err


def test_cli_plan_entry_point_subprocess():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    args = [sys.executable, "-m", "megatron_dapo.cli", "plan", "--config", str(CFG_7B), "--nodes", "1"]
    ok = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert "fits: every phase is within the usable memory" in ok.stdout
    bad = subprocess.run([*args, "--gpu-memory-gb", "40"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "DOES NOT FIT: engine start (stage 0" in bad.stdout


def test_train_preflight_on_cuda(monkeypatch, capsys):
    import torch

    cfg = load_config(CFG_7B)
    assert cli.plan_preflight(cfg) == 0 or torch.cuda.is_available()  # no CUDA: nothing to check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    props = types.SimpleNamespace(total_memory=40 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_NNODES", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert cli.plan_preflight(cfg) == 2  # 40 GiB GPUs: generation needs ~70
    assert "preflight: a phase does not fit" in capsys.readouterr().err
    props.total_memory = 80 * GiB
    assert cli.plan_preflight(cfg) == 0
    props.total_memory = 40 * GiB
    assert cli.plan_preflight(load_config(CFG_7B, ["--trainer.preflight=false"])) == 0


# ---------------------------------------------------------------------------------------------------------------
# cross-check against megatron-core: the real per-rank parameter counts and optimizer buffers (CPU, gloo)
# ---------------------------------------------------------------------------------------------------------------
COUNT_LAYOUTS = ((2, 1, 1), (1, 2, 1), (1, 1, 2))  # (tp, pp, ep) on 2 ranks; EP for the MoE models only


def _megatron_counts(ckpts: dict[str, str]) -> dict[str, object]:
    """Per rank (2 ranks): numel of the GPTModel stage at TP 2 and at PP 2, and at DP 2 the DDP buffers and the
    distributed optimizer's Adam state of a MegatronActor (fp32 on CPU)."""
    import torch
    from transformers import AutoConfig

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.arch import is_moe
    from megatron_dapo.actor.checkpointing import allocate_adam_state
    from megatron_dapo.actor.checkpointing import torch_adam_states
    from megatron_dapo.actor.distributed import destroy_distributed
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.config import ActorConfig
    from megatron_dapo.config import AlgorithmConfig
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.config import RunConfig
    from megatron_dapo.config import TrainerConfig

    out: dict[str, object] = {}
    for tp, pp, ep in COUNT_LAYOUTS:
        groups = init_distributed(tp, pp, expert_parallel=ep)
        for name, path in ckpts.items():
            hf_config = AutoConfig.from_pretrained(path)
            if ep > 1 and not is_moe(hf_config):
                continue
            actor_cfg = ActorConfig(
                model_path=path, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, dtype="fp32"
            )
            model = build_gpt_model(hf_config, actor_cfg, groups)
            out[f"{tp}x{pp}x{ep}/{name}"] = (groups.pp_rank, sum(p.numel() for p in model.parameters()))
    groups = init_distributed(1, 1)
    cfg = RunConfig(
        actor=ActorConfig(model_path=ckpts["qwen2"], dtype="fp32", use_distributed_optimizer=True),
        trainer=TrainerConfig(prompts_per_step=4, gen_prompts_per_batch=4, mini_batch_prompts=4, micro_batch_size=2),
        algorithm=AlgorithmConfig(group_size=2, overlong_buffer=4),
        rollout=RolloutConfig(engine="transformers", max_response_length=8),
    )
    actor = MegatronActor(cfg, groups)
    allocate_adam_state(actor.optimizer)
    buffers = actor.model[0].buffers
    out["param_buffer"] = [(str(b.param_data.dtype), b.param_data.numel()) for b in buffers]
    out["grad_buffer"] = [(str(b.grad_data.dtype), b.grad_data.numel()) for b in buffers]
    out["grad_unpadded"] = sum(b.numel_unpadded for b in buffers)
    adam = [s for _, s in torch_adam_states(actor.optimizer)]
    out["adam_bytes"] = sum(s[k].numel() * s[k].element_size() for s in adam for k in ("exp_avg", "exp_avg_sq"))
    out["adam_dtype"] = sorted({str(s["exp_avg"].dtype) for s in adam})
    del torch
    destroy_distributed()
    return out


def test_counts_match_megatron_core():
    from megatron_dapo.plan import actor_state_bytes_per_param
    from megatron_dapo.plan import shape_from_hf_config
    from tests.actor._dist import run_distributed
    from tests.actor._tiny_models import every_tiny_checkpoint

    ckpts = {k: str(v) for k, v in every_tiny_checkpoint().items()}
    shapes = {k: shape_from_hf_config(json.loads((Path(v) / "config.json").read_text()), k) for k, v in ckpts.items()}
    results = run_distributed(_megatron_counts, 2, ckpts, timeout_s=300)
    for res in results:
        for name, shape in shapes.items():
            for tp, pp, ep in COUNT_LAYOUTS:
                if ep > 1 and not shape.experts:
                    continue
                # tiny llama is tied: at PP 2 the last stage holds megatron's copy of the embedding as its LM head
                pp_rank, numel = res[f"{tp}x{pp}x{ep}/{name}"]
                assert numel == actor_stages(shape, tp, pp, ep)[pp_rank].params, (name, tp, pp, ep)
        stage = actor_stages(shapes["qwen2"], 1, 1)[0].params
        p_b, g_b, o_b = actor_state_bytes_per_param("fp32", 2, True)  # fp32 on CPU: (4, 4, 8 / 2)
        assert res["grad_unpadded"] == stage
        assert all(dtype == "torch.float32" for dtype, _ in res["param_buffer"] + res["grad_buffer"])
        padded = sum(n for _, n in res["grad_buffer"])
        assert stage <= padded < stage + 2 * 128 * len(res["grad_buffer"])  # megatron pads buckets for DP
        assert res["adam_dtype"] == ["torch.float32"]
        # each DP rank holds Adam m and v for its half of the (padded) buffer
        assert res["adam_bytes"] == pytest.approx(stage * o_b, rel=0.02)
        assert (p_b, g_b) == (4.0, 4.0)


# ---------------------------------------------------------------------------------------------------------------
# the shipped launch files and docs agree with the planner
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sbatch",
    [
        "dapo_qwen2.5_32b.sbatch",
        "dapo_qwen2.5_7b.sbatch",
        "dapo_qwen3_30b_a3b.sbatch",
        "dapo_mixtral_8x7b.sbatch",
        "dapo_glm45_air.sbatch",
        "dapo_deepseek_v3.sbatch",
    ],
)
def test_shipped_sbatch_layouts_fit(sbatch):
    import re

    text = (ROOT / "examples/slurm" / sbatch).read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", text, re.M).group(1))
    assert per_node == int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))  # one task per GPU
    assert per_node == int(re.search(r"^GPUS_PER_NODE=(\d+)$", text, re.M).group(1))
    config = re.search(r"^CONFIG=\$\{CONFIG:-(\S+)\}$", text, re.M).group(1)
    memory = float(re.search(r"^GPU_MEMORY_GB=\$\{GPU_MEMORY_GB:-([\d.]+)\}", text, re.M).group(1))
    assert re.search(r'^source "\$\{SLURM_SUBMIT_DIR:-\$PWD\}/examples/slurm/job.sh" "\$@"$', text, re.M)
    assert "#SBATCH --requeue" in text and re.search(r"^#SBATCH --signal=B:USR1@\d+", text, re.M)
    job = (ROOT / "examples/slurm/job.sh").read_text()
    # the pre-flight runs before the launch; srun starts the trainers; one variable sets both socket interfaces; a
    # signalled clean exit asks the run whether to requeue (tests/reliability/test_slurm_job.py runs it)
    assert job.index("megatron_dapo.cli check") < job.index("megatron_dapo.cli plan") < job.index("cli train")
    assert re.search(r"^\s*srun [^\n]*\\\n\s+python -m megatron_dapo.cli train", job, re.M)
    assert 'GLOO_SOCKET_IFNAME="$DAPO_SOCKET_IFNAME" NCCL_SOCKET_IFNAME="$DAPO_SOCKET_IFNAME"' in job
    assert 'megatron_dapo.cli status --config "$CONFIG" --requeue' in job
    assert not re.search(r"^\s*torchrun\b", text + job, re.M)
    plan = make_plan(load_config(ROOT / config), nodes=nodes, gpus_per_node=per_node, gpu_memory_gb=memory)
    assert plan.exit_code == 0, plan.report()
    # the backstop signal gives at least the planner's preemption lead time (job.sh's own timer uses exactly it)
    backstop = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)", text, re.M).group(1))
    assert plan.preempt_lead_s <= backstop <= 65535, (plan.preempt_lead_s, plan.preempt_lead_formula)
    # an H100 80GB reports 79.6 GiB: still fits
    assert make_plan(load_config(ROOT / config), nodes=nodes, gpus_per_node=per_node, gpu_memory_gb=79.6).exit_code == 0


def test_train_runs_the_preflight_first(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "preflight", lambda config, world: None)  # the start-up checks (model path) pass
    monkeypatch.setattr(cli, "plan_preflight", lambda config: seen.append(config.actor.model_path) or 2)
    assert cli.main(["train", "--config", str(CFG_7B)]) == 2  # stops before building the trainer
    assert seen == ["/models/Qwen2.5-7B"]


def test_docs_show_the_current_planner_output():
    docs = (ROOT / "docs/planning.md").read_text()
    for cfg, nodes in [(CFG_32B, 4), (CFG_7B, 1), (CFG_30B_A3B, 2)]:
        report = make_plan(load_config(cfg), nodes=nodes, gpus_per_node=8, gpu_memory_gb=80).report()
        assert report in docs, f"docs/planning.md: refresh the output of `megatron-dapo plan --config {cfg.name}`"


def test_a_kl_loss_plans_the_frozen_reference_model():
    """GRPO with loss.kl_coef > 0 builds a second, frozen copy of the parameters (actor/reference.py): 2 B/param in
    bf16 wherever the actor's parameters are on the GPU (they move together under actor.offload), and a second
    log-prob pass."""
    from megatron_dapo.algorithms.losses.grpo import GRPOConfig

    base = load_config(CFG_32B)
    n = 2_048_361_472  # stage 1 params per GPU

    def grpo(offload: str, kl: float):
        cfg = _with(_with(base, "actor", offload=offload), "algorithm", policy_loss="grpo")
        cfg.loss = GRPOConfig(kl_coef=kl)
        return make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)

    for offload in ("none", "all"):
        without, with_ref = grpo(offload, 0.0), grpo(offload, 0.04)
        for phase in ("log-probs", "update"):
            extra = _stage(with_ref, phase, 1).total_gib - _stage(without, phase, 1).total_gib
            assert extra == pytest.approx(_gib(2 * n), abs=1e-9), (offload, phase)
            assert _stage(with_ref, phase, 1).term("reference params") == pytest.approx(_gib(2 * n), abs=1e-9)
        gen = _stage(with_ref, "generation", 1).total_gib - _stage(without, "generation", 1).total_gib
        # Resident while generating (none): the engine started beside it and took 0.6 of what was left; offloaded
        # with the actor's parameters (all): nothing changes.
        expected = _gib(2 * n) - 0.6 * _gib(2 * n) if offload == "none" else 0.0
        assert gen == pytest.approx(expected, abs=1e-9), offload
        assert with_ref.times_s["log-probs"] == pytest.approx(2 * without.times_s["log-probs"])
        assert "reference" in with_ref.time_formulas["log-probs"]


# ---------------------------------------------------------------------------------------------------------------
# the async schedule (issue 24 item 6): worked example 4 in docs/planning.md
# ---------------------------------------------------------------------------------------------------------------
def test_qwen32b_async_schedule_matches_the_hand_calculation():
    plan = make_plan(_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    sched = plan.async_plan
    n = 32_763_876_352
    # The actor needs TP 8 x PP 2 = 16 GPUs per replica: the only split of 32 is 16 engine GPUs (4 engines of TP 4)
    # + 16 actor GPUs (DP 1).
    assert (sched.engine_gpus, sched.actor_gpus) == (16, 16) and [e for e, _ in sched.candidates] == [16]
    # An engine alone on its GPUs: 0.85 x (80 - 1) GiB for weights + KV; weights per GPU: every parameter at 2 B split
    # 4 ways but the 64 x 2 + 1 norms of 5120 (replicated); KV 2 x 64 layers x 8/4 heads x 128 x 2 B per token.
    norms = (64 * 2 + 1) * 5120
    weights = 2 * (n - norms) / 4 + 2 * norms
    kv_tokens = (0.85 * 79 * GiB - weights) // (2 * 64 * 2 * 128 * 2)
    tps_seq = 60 * 8.2e9 / (n / 4)
    engine_tps = min(1500 * 32.8e9 / n * 4, kv_tokens / 6400 * tps_seq)  # here the full-batch rate, not the KV
    assert engine_tps == pytest.approx(1500 * 32.8e9 / n * 4)
    gen = 1024 * 16 * 6144 / (4 * engine_tps) + 20480 / tps_seq
    assert sched.times_s["generation"] == pytest.approx(gen, rel=1e-9)
    # The actor on 16 GPUs: DP 1 runs 512 micro-batches per mini-batch (bubble 1 + 1/512).
    fwd = 2 * n + 2 * 64 * 5120 * 6400
    logprobs = 8192 * 6400 * fwd * (1 + 1 / 512) / (16 * 989e12 * 0.35)
    assert sched.times_s["log-probs"] == pytest.approx(logprobs, rel=1e-12)
    assert sched.times_s["update"] == pytest.approx(4 * logprobs, rel=1e-12)
    # Sync: the engines are on other nodes: the load is a broadcast over the network (S / 40e9) instead of IPC, and
    # there is no engine memory release / resume.
    s = 2 * n
    sync = s * 7 / 8 / 360e9 + s / 2 / 40e9 + s / 40e9 + 31 * 0.2
    assert sched.times_s["sync"] == pytest.approx(sync, rel=1e-12)
    assert sched.times_s["offload"] == 0.0
    evaluation = (30 * 32 * 6144 / (4 * engine_tps) + 20480 / tps_seq) / 10
    assert sched.times_s["eval"] == pytest.approx(evaluation, rel=1e-9)
    ckpt = 14 * n / (4 * 2e9) / 10
    assert sched.step_s == pytest.approx(max(gen, 5 * logprobs) + sync + evaluation + ckpt, rel=1e-9)
    report = plan.report()
    assert f"async schedule (split launch, trainer.max_staleness >= 1): {sched.step_s:,.0f} s" in report
    assert f"x{sum(plan.times_s.values()) / sched.step_s:.2f} the synchronous step" in report


def test_async_schedule_picks_the_fastest_split_and_says_when_none_runs():
    # Qwen2.5-7B (engine TP 1, actor TP 2): on 2 nodes every split leaving the actor an even number of GPUs runs.
    plan = make_plan(_config(CFG_7B), nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    sched = plan.async_plan
    steps = dict(sched.candidates)
    assert sorted(steps) == list(range(2, 16, 2))
    assert sched.step_s == min(steps.values()) == steps[sched.engine_gpus] == sched.candidates[0][1]
    assert sched.engine_gpus + sched.actor_gpus == 16
    # More engine GPUs: faster generation, slower training (each side's time is monotone in its share).
    fewer = [step for e, step in sorted(steps.items()) if e < sched.engine_gpus]
    assert all(a >= b for a, b in zip(fewer, fewer[1:]))
    # One actor replica fills the GPUs: no split.
    one = make_plan(_config(CFG_32B), nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    assert one.async_plan is None and "async schedule: no disaggregated split can run" in one.report()


# ---------------------------------------------------------------------------------------------------------------
# every flag at 0, negative, NaN, huge (issue 38 item 4): one line, exit 2, at once
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--nodes", "--gpus-per-node", "--gpu-memory-gb"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "1e400", "100000000", "2.5"])
def test_every_bad_layout_flag_is_one_line_and_exit_2(capsys, flag, value):
    from megatron_dapo.plan import LAYOUT_LIMITS

    if flag != "--gpu-memory-gb" and value in ("nan", "inf", "-inf", "1e400", "2.5"):
        # argparse reads --nodes / --gpus-per-node as int: its own one-line usage error, exit 2
        with pytest.raises(SystemExit) as stop:
            cli.main(["plan", "--config", str(CFG_7B), "--nodes", "1", f"{flag}={value}"])
        assert stop.value.code == 2 and f"argument {flag}: invalid int value" in capsys.readouterr().err
        return
    low, high = LAYOUT_LIMITS[flag[2:].replace("-", "_")]
    assert not low <= float(value) <= high or value == "2.5"  # the cases are outside the limits but one
    code = cli.main(["plan", "--config", str(CFG_7B), "--nodes", "1", f"{flag}={value}"])
    err = capsys.readouterr().err.strip()
    if value == "2.5":  # 2.5 GiB is a (small) GPU: planned, and nothing fits
        assert code == 2 and not err
        return
    assert code == 2 and err.count("\n") == 0 and err.startswith(f"error: {flag} "), err


@pytest.mark.parametrize("assume", ["mfu=nan", "offload_gbps=inf", "ipc_gbps=-1", "mean_response_frac=0"])
def test_non_finite_or_negative_assumptions_are_named(assume):
    with pytest.raises(PlanError, match=f"--assume {assume.split('=')[0]}"):
        parse_assumptions([assume])


def test_engine_splits_are_every_split_the_old_scan_took():
    """_engine_splits (an arithmetic progression) against the scan it replaced, over worlds, engine TPs and actor
    units up to 64 x 8 x 16."""
    from megatron_dapo.plan import _engine_splits

    for world in range(1, 65):
        for etp in (1, 2, 4, 8):
            for unit in (1, 2, 3, 4, 6, 8, 16):
                brute = [e for e in range(etp, world, etp) if (world - e) % unit == 0]
                assert list(_engine_splits(world, etp, unit)) == brute, (world, etp, unit)


def test_the_async_schedule_of_a_huge_world_is_bounded_and_agrees_with_the_full_scan(monkeypatch):
    """Past MAX_SPLITS splits the schedule samples, then refines around the best sample: it evaluates a bounded
    number of splits for any world (was: one per split, 400,000 at 100,000 nodes, and no answer at 1e8), and on a
    world where the full scan is affordable it finds the same split."""
    import megatron_dapo.plan as plan_module

    calls = []
    original = plan_module.step_times
    monkeypatch.setattr(plan_module, "step_times", lambda *a, **k: calls.append(1) or original(*a, **k))
    make_plan(_config(CFG_7B), nodes=1_000_000, gpus_per_node=8, gpu_memory_gb=80)
    assert len(calls) <= plan_module.MAX_SPLITS + 20 * 130
    sampled = make_plan(_config(CFG_7B), nodes=600, gpus_per_node=8, gpu_memory_gb=80).async_plan  # 2,399 splits
    monkeypatch.setattr(plan_module, "MAX_SPLITS", 10**6)
    full = make_plan(_config(CFG_7B), nodes=600, gpus_per_node=8, gpu_memory_gb=80).async_plan
    assert len(full.candidates) == 2399 and len(sampled.candidates) < len(full.candidates)
    assert (sampled.engine_gpus, sampled.step_s) == (full.engine_gpus, full.step_s)


def test_multi_turn_tool_time_is_added_to_generation():
    """reward.environment python_tool: each engine's rank runs its trajectories' tool calls one at a time, so the
    generation phase grows by sampled prompts x G x calls per trajectory x seconds per call / engines."""
    from megatron_dapo.plan import Assumptions

    base = make_plan(_config(CFG_32B), nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    cfg = _config(CFG_32B, "--reward.environment=python_tool", "--rollout.partial=false")
    a = Assumptions(tool_calls_per_trajectory=2.0, tool_seconds_per_call=0.25)
    tools = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80, assumptions=a)
    no_tools = make_plan(_config(CFG_32B, "--rollout.partial=false"), nodes=4, gpus_per_node=8, gpu_memory_gb=80,
                         assumptions=a)  # fmt: skip
    c = cfg
    sampled = c.trainer.prompts_per_step / c.algorithm.expected_keep_ratio
    engines = 32 // c.rollout.tensor_parallel
    expected = sampled * c.algorithm.group_size * 2.0 * 0.25 / engines
    assert tools.times_s["generation"] - no_tools.times_s["generation"] == pytest.approx(expected, rel=1e-12)
    assert "+ tools" in tools.time_formulas["generation"] and "+ tools" not in base.time_formulas["generation"]


def test_sync_estimate_delta_and_direct_terms_by_hand():
    """Issue 39 item 5: the sync term's options, by hand on Qwen2.5-32B colocated (S = 65.5 GB in bf16).
    delta: the load and the buckets follow S' = S x delta_bytes_fraction, and the sender compares all of S with its
    host copy at offload_gbps; direct: no TP gather or PP broadcast, each engine GPU receives S'/etp and each actor GPU
    sends S' x engines / actor GPUs, the larger at the link's rate; each rank compares only its slices."""
    from dataclasses import replace

    from megatron_dapo.plan import KNOWN_MODELS
    from megatron_dapo.plan import Assumptions
    from megatron_dapo.plan import SyncLayout
    from megatron_dapo.plan import engine_weight_bytes
    from megatron_dapo.plan import sync_estimate

    m, a = KNOWN_MODELS["qwen2.5-32b"], Assumptions()
    S = engine_weight_bytes(m, 1, 2)
    base = SyncLayout(8, 2, 1, 8, 16, 8, "colocated", engine_gpus=128, engine_tp=4, bucket_mb=2048)
    _, _, full = sync_estimate(m, base, a)
    total, formula, delta = sync_estimate(m, replace(base, delta=True), a)
    assert total == pytest.approx(sum(delta.values()))
    assert delta["load"] == pytest.approx(full["load"] * a.delta_bytes_fraction)
    assert delta["delta compare"] == pytest.approx(S / 25e9)
    assert delta["buckets"] == math.ceil(S * a.delta_bytes_fraction / 2**31) * 0.2 < full["buckets"]
    assert delta["tp gather"] == full["tp gather"] and "delta compare" in formula
    _, _, direct = sync_estimate(m, replace(base, transport="direct", delta=True), a)
    assert "tp gather" not in direct and "pp broadcast" not in direct
    sent = S * a.delta_bytes_fraction
    assert direct["transfer"] == pytest.approx(max(sent / 4, sent * 32 / 128) / (a.ipc_gbps * 1e9))
    assert direct["delta compare"] == pytest.approx(S / 16 / 25e9)  # its TP x PP = 16th of a dense model
    assert direct["engine release/resume"] == 3.0


def test_the_relay_into_sglang_servers_is_priced_from_its_hops():
    """transport "relay" (rollout.weight_sync_route direct in mode server): the actor's pieces (or their deltas) to one
    engine rank per server node over the network, streamed (placement.RelayReceiver): the whole model from host to
    GPU and broadcast to the servers in full, bucket by bucket, or with delta the changed elements forwarded to the
    servers' loader over HTTP, while the transfer goes on, so the transfer adds only its first bucket and whatever
    it takes beyond that chain; refused colocated."""
    from dataclasses import replace

    from megatron_dapo.plan import KNOWN_MODELS
    from megatron_dapo.plan import Assumptions
    from megatron_dapo.plan import SyncLayout
    from megatron_dapo.plan import engine_weight_bytes
    from megatron_dapo.plan import sync_estimate

    m, a = KNOWN_MODELS["qwen3-30b-a3b"], Assumptions()
    S = engine_weight_bytes(m, 1, 2)
    base = SyncLayout(1, 1, 8, 8, 2, 8, "split", engine_gpus=8, engine_tp=4, transport="relay", bucket_mb=1024)
    _, _, full = sync_estimate(m, base, a)
    _, _, delta = sync_estimate(m, replace(base, delta=True), a)
    buckets = math.ceil(S / 2**30)
    assert full["host to gpu"] == pytest.approx(S / (a.offload_gbps * 1e9))
    assert full["load"] == pytest.approx(S / (a.nvlink_gbps * 1e9))  # full tensors: the whole model to the servers
    assert full["buckets"] == buckets * a.bucket_overhead_s
    sent = S * a.delta_bytes_fraction  # forwarded to the servers' loader: HTTP on the node, encoded and decoded
    assert "host to gpu" not in delta and delta["load"] == pytest.approx(2 * sent / (a.http_gbps * 1e9))
    assert delta["buckets"] == math.ceil(sent / 2**30) * a.bucket_overhead_s
    for terms, moved in ((full, S), (delta, sent)):
        transfer = moved / (a.internode_gbps * 1e9)  # one relay rank receives everything
        chain = terms.get("host to gpu", 0.0) + terms["load"] + terms["buckets"]
        assert transfer < chain  # here the chain hides it: the first bucket's share is what adds
        assert terms["transfer"] == pytest.approx(transfer / (terms["buckets"] / a.bucket_overhead_s))
    slow = replace(a, internode_gbps=1.0)  # a link slow enough to outlast the chain: the excess adds too
    _, _, terms = sync_estimate(m, base, slow)
    chain = terms["host to gpu"] + terms["load"] + terms["buckets"]
    assert terms["transfer"] == pytest.approx(S / 1e9 - chain + S / 1e9 / buckets)
    with pytest.raises(ValueError, match="relay"):
        sync_estimate(m, replace(base, placement="colocated"), a)


def test_deltas_into_sglang_servers_on_the_rank0_route_are_priced_as_their_http_bodies():
    """rollout.weight_sync_delta into servers on the rank-0 route: the changed elements S' are encoded once by actor
    rank 0 and decoded by each server at http_gbps, and go base64 (x 4/3) to every server over rank 0's link; the
    full route's NCCL load is S over the network."""
    from dataclasses import replace

    from megatron_dapo.plan import KNOWN_MODELS
    from megatron_dapo.plan import Assumptions
    from megatron_dapo.plan import SyncLayout
    from megatron_dapo.plan import engine_weight_bytes
    from megatron_dapo.plan import sync_estimate

    m, a = KNOWN_MODELS["qwen3-30b-a3b"], Assumptions()
    S = engine_weight_bytes(m, 1, 2)
    base = SyncLayout(1, 1, 8, 8, 2, 8, "split", engine_gpus=8, engine_tp=4, bucket_mb=1024)
    _, _, full = sync_estimate(m, base, a)
    _, formula, delta = sync_estimate(m, replace(base, delta=True), a)
    assert full["load"] == pytest.approx(S / (a.internode_gbps * 1e9))
    sent = S * a.delta_bytes_fraction
    assert delta["load"] == pytest.approx(2 * sent / (a.http_gbps * 1e9) + sent * 4 / 3 * 2 / (a.internode_gbps * 1e9))
    assert "HTTP 2 x S'/0.38 + S' x 4/3 x 2 servers/40" in formula


def test_docs_show_the_sync_targets_at_scale():
    from megatron_dapo.plan import format_sync_targets

    assert format_sync_targets() in (ROOT / "docs/planning.md").read_text(), "refresh docs/planning.md's table"
