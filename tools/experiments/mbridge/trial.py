# ruff: noqa: E402, E501  (an exploratory script: imports staged to show where each failure happens)
"""mbridge 0.15.1 trial on CPU, world size 1 over gloo (megatron-core 0.16.1, no TE).

usage: python trial.py FAMILY [--workarounds w1,w2,...]
FAMILY: qwen2 | llama | mixtral | qwen3 | qwen3_moe | qwen2_moe
workarounds (each one applied only when named, so the unpatched failure can be shown first):
  rope     transformers 5 configs have no .rope_theta attribute (rope_parameters instead): set it on the config
  headdim  configs whose head_dim attribute is None (Mixtral in transformers 5): set it to hidden/heads
  local    build with megatron's local layer spec instead of the hard-coded TE spec, and map the local spec's
           unfused norm names (input_layernorm / pre_mlp_layernorm) to HF names
  cuda     get_model() calls model.cuda(): skip it (use_torch_fsdp2=True + use_cpu_initialization=True path)
  router   Mixtral: set_extra_args(moe_router_pre_softmax=False) (the bridge sets True: no top-k renormalisation)
  sgate    Qwen2-MoE: set_extra_args(moe_shared_expert_gate=True) (the bridge omits it: gate silently dropped)
  nofuse   set_extra_args(...) to turn off the fusions the bridge switches on (masked_softmax, bias_activation...)
"""

import argparse
import json
import os
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
import logging

logging.disable(logging.WARNING)

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("family")
p.add_argument("--workarounds", default="")
args = p.parse_args()
W = set(x for x in args.workarounds.split(",") if x)
OUT = os.path.join(os.environ.get("MBRIDGE_EVAL_DIR", "/tmp/mbridge_eval"), f"hf_{args.family}")


def stage(name):
    print(f"\n=== {name}", flush=True)


# ---------------------------------------------------------------- 1. tiny HF model
stage("1. tiny HF model (transformers, fp32, save_pretrained)")
import transformers

torch.manual_seed(0)
common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)  # fmt: skip
moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
FAMILIES = {  # family -> (transformers class prefix, its fields beyond `common`)
    "qwen2": ("Qwen2", {}),
    "llama": ("Llama", {}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3": ("Qwen3", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3Moe", {"head_dim": 16, **moe, "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2Moe", {**moe, "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
}
prefix, extra = FAMILIES[args.family]
cfg = getattr(transformers, f"{prefix}Config")(**common, **extra)
cls = getattr(transformers, f"{prefix}ForCausalLM")
cfg.torch_dtype = torch.float32
hf = cls(cfg).float().eval()
with torch.no_grad():  # make the norms and biases non-trivial so a swapped/missing tensor shows up in the logits
    for n, t in hf.named_parameters():
        if "norm" in n or n.endswith(".bias"):
            t.copy_(torch.randn_like(t) * 0.1 + (1.0 if "norm" in n else 0.0))
hf.save_pretrained(OUT)
from safetensors import safe_open

orig = {}
for f in sorted(os.listdir(OUT)):
    if f.endswith(".safetensors"):
        with safe_open(os.path.join(OUT, f), "pt") as fh:
            for k in fh.keys():
                orig[k] = fh.get_tensor(k)
print("saved", OUT, "tensors:", len(orig))
print(
    "  e.g.",
    sorted(orig)[:3],
    "...",
    [k for k in sorted(orig) if "layers.0" in k and ("expert" in k or "moe" in k or "gate" in k)][:4],
)

# ---------------------------------------------------------------- 2. process group + megatron parallel state
stage("2. gloo world size 1 + megatron parallel_state (as megatron_dapo.actor.distributed.init_distributed)")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29731")
from megatron_dapo.actor.cpu_compat import apply_cpu_compat
from megatron_dapo.actor.cpu_compat import import_megatron_core

import_megatron_core()
dist.init_process_group("gloo", rank=0, world_size=1)
apply_cpu_compat()
from megatron.core import parallel_state as ps

ps.initialize_model_parallel(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=1,
)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

model_parallel_cuda_manual_seed(1234)
print(
    "ok: tp/pp/ep =",
    ps.get_tensor_model_parallel_world_size(),
    ps.get_pipeline_model_parallel_world_size(),
    ps.get_expert_model_parallel_world_size(),
)

# ---------------------------------------------------------------- 3. bridge
stage("3. AutoBridge.from_config")
from mbridge import AutoBridge

hf_cfg = transformers.AutoConfig.from_pretrained(OUT)
if "rope" in W and not hasattr(hf_cfg, "rope_theta"):
    hf_cfg.rope_theta = (getattr(hf_cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    print("workaround rope: hf_config.rope_theta =", hf_cfg.rope_theta)
if "headdim" in W and getattr(hf_cfg, "head_dim", 0) is None:
    hf_cfg.head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads
    print("workaround headdim: hf_config.head_dim =", hf_cfg.head_dim)


def fail(where):
    print(f"FAILED at {where}:")
    traceback.print_exc(limit=-6)
    sys.exit(1)


try:
    bridge = AutoBridge.from_config(hf_cfg, dtype=torch.float32)
    print("bridge:", type(bridge).__name__)
except Exception:
    fail("AutoBridge.from_config")

if "nofuse" in W:
    fusions = ("masked_softmax", "bias_activation", "bias_dropout", "gradient_accumulation", "apply_rope")  # *_fusion
    bridge.set_extra_args(persist_layer_norm=False, **{f"{f}_fusion": False for f in fusions})
    print("workaround nofuse: fusions off via set_extra_args")

if "router" in W:
    # HF Mixtral renormalises its top-k softmax probabilities; megatron does that only with pre_softmax=False
    bridge.set_extra_args(moe_router_pre_softmax=False)
    print("workaround router: moe_router_pre_softmax=False")

if "sgate" in W:
    # Qwen2-MoE's sigmoid shared-expert gate: megatron builds it only with moe_shared_expert_gate=True
    bridge.set_extra_args(moe_shared_expert_gate=True)
    print("workaround sgate: moe_shared_expert_gate=True")

if "local" in W:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg_m = bridge.config

    def local_spec(vp_stage=None, _b=bridge):
        _b.has_vp_stage = True
        c = _b.config
        return get_gpt_layer_local_spec(
            num_experts=c.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=c.qk_layernorm, normalization="RMSNorm"
        )

    bridge._get_transformer_layer_spec = local_spec
    if bridge.config.moe_grouped_gemm:
        bridge.set_extra_args(moe_grouped_gemm=False)
    # local spec names: decoder.layers.i.input_layernorm.weight / pre_mlp_layernorm.weight,
    # MoE experts: mlp.experts.local_experts.k.linear_fc{1,2}.weight (SequentialMLP)
    orig_map = bridge._weight_name_mapping_mcore_to_hf

    def mapping(name, _orig=orig_map):
        parts = name.split(".")
        if name.endswith("input_layernorm.weight"):
            return [f"model.layers.{parts[2]}.input_layernorm.weight"]
        if name.endswith("pre_mlp_layernorm.weight"):
            return [f"model.layers.{parts[2]}.post_attention_layernorm.weight"]
        if ".mlp.experts.local_experts." in name:  # -> the grouped-gemm name the bridge knows
            k = parts[parts.index("local_experts") + 1]
            fc = parts[parts.index("local_experts") + 2]
            name = ".".join(parts[: parts.index("local_experts")]) + f".{fc}.weight{k}"
        return _orig(name)

    bridge._weight_name_mapping_mcore_to_hf = mapping
    print("workaround local: local spec + name map for input_layernorm / pre_mlp_layernorm / local_experts")

# ---------------------------------------------------------------- 4. build
stage("4. bridge.get_model (build the megatron model)")
t0 = time.time()
try:
    kw = dict(wrap_with_ddp=False, bf16=False, fp16=False)
    if "cuda" in W:
        kw.update(use_torch_fsdp2=True, use_cpu_initialization=True)
    model = bridge.get_model(**kw)
except Exception:
    fail("get_model")
print(
    f"built in {time.time() - t0:.2f}s:",
    type(model[0]).__name__,
    "params:",
    sum(p.numel() for p in model[0].parameters()),
)
names = [k for k in model[0].state_dict() if "_extra_state" not in k]
print("  mcore names (layer 0):", [n for n in names if "layers.0." in n])

# ---------------------------------------------------------------- 5. load
stage("5. bridge.load_weights (HF safetensors -> megatron)")
t0 = time.time()
try:
    bridge.load_weights(model, OUT)
except Exception:
    fail("load_weights")
t_load = time.time() - t0
print(f"loaded in {t_load:.3f}s")

# ---------------------------------------------------------------- 6. forward
stage("6. forward, compare logits with transformers")
tokens = torch.tensor([[3, 17, 42, 99, 5, 64, 127, 0, 11, 23, 77, 8]])
pos = torch.arange(tokens.shape[1]).unsqueeze(0)
m = model[0]
m.eval()
try:
    with torch.no_grad():
        out = m(input_ids=tokens, position_ids=pos, attention_mask=None)
except Exception:
    fail("megatron forward")
with torch.no_grad():
    ref = hf(input_ids=tokens).logits
out = out[..., : ref.shape[-1]]
print(
    "logits shapes",
    tuple(out.shape),
    tuple(ref.shape),
    "max|diff| =",
    (out.float() - ref.float()).abs().max().item(),
    " argmax agree:",
    bool((out.argmax(-1) == ref.argmax(-1)).all()),
)

# ---------------------------------------------------------------- 7. export
stage("7. bridge.export_weights (megatron -> HF names), compare bit for bit")
t0 = time.time()
try:
    gen = bridge.export_weights(model)
    print("export_weights returns:", type(gen).__name__)
    exported = {}
    for k, v in gen:
        exported[k] = v.detach().clone()
except Exception:
    fail("export_weights")
t_exp = time.time() - t0
print(f"exported {len(exported)} tensors in {t_exp:.3f}s")
missing = sorted(set(orig) - set(exported))
extra = sorted(set(exported) - set(orig))
bad = [
    k
    for k in sorted(set(orig) & set(exported))
    if orig[k].dtype != exported[k].dtype or orig[k].shape != exported[k].shape or not torch.equal(orig[k], exported[k])
]
print("missing from export:", missing[:8], f"({len(missing)})")
print("extra in export   :", extra[:8], f"({len(extra)})")
print("not bit-identical :", bad[:8], f"({len(bad)})")
print(
    "RESULT",
    json.dumps(
        dict(
            family=args.family,
            workarounds=sorted(W),
            load_s=round(t_load, 3),
            export_s=round(t_exp, 3),
            max_abs_diff=(out.float() - ref.float()).abs().max().item(),
            n_orig=len(orig),
            n_exported=len(exported),
            missing=len(missing),
            extra=len(extra),
            not_identical=len(bad),
        )
    ),
)
dist.destroy_process_group()
