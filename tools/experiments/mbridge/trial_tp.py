# ruff: noqa: E402, E501  (an exploratory script: imports staged to show where each failure happens)
"""mbridge TP=2 (or PP=2) trial, 2 gloo processes on CPU: torchrun --nproc-per-node 2 trial_tp.py FAMILY TP PP
Uses the HF checkpoint written by trial.py (hf_FAMILY) and the same workarounds (local spec, rope_theta, no .cuda(),
fusions off) plus sequence_parallel=False (the bridge turns it on whenever tp > 1)."""

import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
import logging

logging.disable(logging.WARNING)

import torch
import torch.distributed as dist
import transformers

fam, TP, PP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
OUT = os.path.join(os.environ.get("MBRIDGE_EVAL_DIR", "/tmp/mbridge_eval"), f"hf_{fam}")
from megatron_dapo.actor.cpu_compat import apply_cpu_compat
from megatron_dapo.actor.cpu_compat import import_megatron_core

import_megatron_core()
dist.init_process_group("gloo")
rank = dist.get_rank()
apply_cpu_compat()
from megatron.core import parallel_state as ps

ps.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

model_parallel_cuda_manual_seed(1234)
from mbridge import AutoBridge
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

hf_cfg = transformers.AutoConfig.from_pretrained(OUT)
hf_cfg.rope_theta = hf_cfg.rope_parameters["rope_theta"]
if getattr(hf_cfg, "head_dim", 0) is None:
    hf_cfg.head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads
bridge = AutoBridge.from_config(hf_cfg, dtype=torch.float32)
extra = dict(
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
)
if "--keep-sp" not in sys.argv:
    extra["sequence_parallel"] = False
bridge.set_extra_args(**extra)


def local_spec(vp_stage=None, _b=bridge):
    _b.has_vp_stage = True
    return get_gpt_layer_local_spec(
        num_experts=_b.config.num_moe_experts, qk_layernorm=_b.config.qk_layernorm, normalization="RMSNorm"
    )


bridge._get_transformer_layer_spec = local_spec
orig_map = bridge._weight_name_mapping_mcore_to_hf


def mapping(name, _orig=orig_map):
    parts = name.split(".")
    if name.endswith("input_layernorm.weight"):
        return [f"model.layers.{parts[2]}.input_layernorm.weight"]
    if name.endswith("pre_mlp_layernorm.weight"):
        return [f"model.layers.{parts[2]}.post_attention_layernorm.weight"]
    return _orig(name)


bridge._weight_name_mapping_mcore_to_hf = mapping
model = bridge.get_model(wrap_with_ddp=False, bf16=False, use_torch_fsdp2=True, use_cpu_initialization=True)
t0 = time.time()
bridge.load_weights(model, OUT)
t_load = time.time() - t0
from safetensors.torch import load_file

orig = load_file(os.path.join(OUT, "model.safetensors"))
t0 = time.time()
exported = {k: v.clone() for k, v in bridge.export_weights(model)}
t_exp = time.time() - t0
bad = [k for k in orig if k not in exported or not torch.equal(orig[k], exported[k])]
# forward through megatron's pipeline schedule (works for PP=1 and PP=2)
from megatron.core.pipeline_parallel import get_forward_backward_func

tokens = torch.tensor([[3, 17, 42, 99, 5, 64, 127, 0, 11, 23, 77, 8]])
pos = torch.arange(12).unsqueeze(0)
got = {}


def step(it, m):
    out = m(input_ids=tokens, position_ids=pos, attention_mask=None)

    def post(o):
        got["logits"] = o
        return o.sum() * 0, {}

    return out, post


for m in model:
    m.eval()
with torch.no_grad():
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([None]),
        model=model,
        num_microbatches=1,
        seq_length=12,
        micro_batch_size=1,
        forward_only=True,
    )
msg = ""
if "logits" in got:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    lg = gather_from_tensor_model_parallel_region(got["logits"])[..., :128]
    hf = getattr(transformers, hf_cfg.architectures[0]).from_pretrained(OUT).float().eval()
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
    msg = f" max|diff|={(lg - ref).abs().max().item():.3g}"
print(
    f"rank {rank} tp_rank {ps.get_tensor_model_parallel_rank()} pp_rank {ps.get_pipeline_model_parallel_rank()}: load {t_load:.3f}s export {t_exp:.3f}s "
    f"exported {len(exported)}/{len(orig)} not-bit-identical-or-missing {len(bad)}{msg}",
    flush=True,
)
dist.destroy_process_group()
