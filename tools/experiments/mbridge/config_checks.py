# ruff: noqa: E402  (an exploratory script: imports staged to show where each failure happens)
"""Config-level checks (no model build): what the bridges set for DeepSeek-V3 / GLM-4.5 routing, and name mapping
of the local-spec norm names."""

import os
import warnings

warnings.filterwarnings("ignore")
import logging

logging.disable(logging.WARNING)

import torch
import torch.distributed as dist
import transformers

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29751")
from megatron_dapo.actor.cpu_compat import apply_cpu_compat
from megatron_dapo.actor.cpu_compat import import_megatron_core

import_megatron_core()
dist.init_process_group("gloo", rank=0, world_size=1)
apply_cpu_compat()
from megatron.core import parallel_state as ps

ps.initialize_model_parallel(1, 1)
from mbridge import AutoBridge

q = transformers.AutoConfig.from_pretrained(
    os.path.join(os.environ.get("MBRIDGE_EVAL_DIR", "/tmp/mbridge_eval"), "hf_qwen2")
)
b = AutoBridge.from_config(q, dtype=torch.float32)
for n in ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight"]:
    try:
        print("qwen2 map", n, "->", b._weight_name_mapping_mcore_to_hf(n))
    except Exception as e:
        print("qwen2 map", n, "->", type(e).__name__, e)
print(
    "qwen2 config: sequence_parallel(tp=1)",
    b.config.sequence_parallel,
    "masked_softmax_fusion",
    b.config.masked_softmax_fusion,
)

ds = transformers.DeepseekV3Config(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)
if not hasattr(ds, "rope_theta"):
    ds.rope_theta = 10000.0
print(
    "\nHF deepseek_v3: n_group",
    ds.n_group,
    "topk_group",
    ds.topk_group,
    "norm_topk_prob",
    ds.norm_topk_prob,
    "rope_scaling",
    getattr(ds, "rope_scaling", None),
    "num_nextn_predict_layers" in ds,
)
try:
    d = AutoBridge.from_config(ds, dtype=torch.bfloat16)
    c = d.config
    for k in [
        "moe_router_score_function",
        "moe_router_enable_expert_bias",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_router_topk_scaling_factor",
        "moe_router_pre_softmax",
        "moe_layer_freq",
        "moe_shared_expert_intermediate_size",
        "mtp_num_layers",
        "q_lora_rank",
        "kv_lora_rank",
        "attention_backend",
        "moe_router_load_balancing_type",
        "moe_router_bias_update_rate",
    ]:
        print("  mcore", k, "=", getattr(c, k, "<absent>"))
    try:
        print("  map mtp:", d._weight_name_mapping_mcore_to_hf("mtp.layers.0.enorm.weight"))
    except BaseException as e:
        print("  map mtp.layers.0.enorm.weight ->", type(e).__name__, e)
except Exception:
    import traceback

    traceback.print_exc(limit=-3)

g = transformers.Glm4MoeConfig(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=False,
    head_dim=16,
)
if not hasattr(g, "rope_theta"):
    g.rope_theta = 10000.0
print(
    "\nHF glm4_moe: n_group",
    g.n_group,
    "topk_group",
    g.topk_group,
    "partial_rotary_factor",
    getattr(g, "partial_rotary_factor", "<absent>"),
    "n_shared_experts",
    g.n_shared_experts,
    "num_nextn_predict_layers",
    getattr(g, "num_nextn_predict_layers", "<absent>"),
)
try:
    gb = AutoBridge.from_config(g, dtype=torch.bfloat16)
    c = gb.config
    for k in [
        "moe_router_score_function",
        "moe_router_enable_expert_bias",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_router_topk_scaling_factor",
        "moe_layer_freq",
        "moe_shared_expert_intermediate_size",
        "mtp_num_layers",
        "moe_router_load_balancing_type",
        "moe_router_bias_update_rate",
        "add_qkv_bias",
        "qk_layernorm",
    ]:
        print("  mcore", k, "=", getattr(c, k, "<absent>"))
    try:
        print("  gptmodel args:", gb._get_gptmodel_args())
    except Exception as e:
        print("  gptmodel args ->", type(e).__name__, e)
except Exception:
    import traceback

    traceback.print_exc(limit=-3)

print("\nregistered:", AutoBridge.list_supported_models())
print("gemma3_text registered:", "gemma3_text" in AutoBridge.list_supported_models())
dist.destroy_process_group()
