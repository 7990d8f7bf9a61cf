"""Pre-flight planner: per-GPU peak memory by phase and a step-time model for a run config on a cluster layout.

    RunConfig + --nodes/--gpus-per-node/--gpu-memory-gb --make_plan--> Plan
        model shape   config.json under actor.model_path, else KNOWN_MODELS by the path's last component
        memory        per pipeline stage and phase: engine start, generation, log-probs, update, sync (GiB)
        step time     generation (decode tokens/s), log-probs and update (FLOPs at an MFU), sync (bytes / GB/s)
    Plan.report() prints every term with its formula and every assumption; Plan.exit_code is 2 when a phase does
    not fit (the report names it), else 0.

Pure Python (no torch): the same arithmetic runs on a login node, in `megatron-dapo plan` and at the start of
`train`. The formulas, with two hand calculations, are in docs/planning.md; they follow the code paths of this
repository (actor/actor.py, actor/model.py, rollout/sglang_engine.py, actor/hf_weights.py) and of megatron-core
0.16.1 (distributed optimizer, 1F1B schedule) and SGLang 0.5.23 (KV pool sizing). Memory is in GiB (2**30 bytes),
bandwidth in GB/s (1e9 bytes/s), FLOPs in TFLOP/s (1e12).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from dataclasses import field
from dataclasses import fields
from pathlib import Path
from typing import Any

from megatron_dapo.actor.arch import MlaShape
from megatron_dapo.actor.arch import MoeShape
from megatron_dapo.actor.arch import has_qk_norm
from megatron_dapo.actor.arch import has_qkv_bias
from megatron_dapo.actor.arch import mla_shape
from megatron_dapo.actor.arch import moe_shape
from megatron_dapo.algorithms.loss_configs import uses_reference
from megatron_dapo.config import mini_batch_rows
from megatron_dapo.fp8_format import fp8_weight_bytes
from megatron_dapo.memory import PARTS
from megatron_dapo.memory import PHASES
from megatron_dapo.memory import parts_offloaded
from megatron_dapo.memory import resident_by_phase
from megatron_dapo.ops import tiling
from megatron_dapo.rollout.engines import engine_kind

GiB = float(1 << 30)


class PlanError(ValueError):
    """The layout or the model cannot be planned (the message names the field)."""


LAYOUT_LIMITS = {"nodes": (1, 1_000_000), "gpus_per_node": (1, 64), "gpu_memory_gb": (1.0, 4096.0)}
"""The layouts `make_plan` accepts ([low, high] per flag): beyond them a plan means nothing (and 0 divides by 0)."""


def check_layout(nodes: Any, gpus_per_node: Any, gpu_memory_gb: Any) -> None:
    """PlanError naming the first flag (`--nodes`, `--gpus-per-node`, `--gpu-memory-gb`) that is not a number within
    LAYOUT_LIMITS (NaN and infinities included)."""
    for name, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("gpu_memory_gb", gpu_memory_gb)):
        low, high = LAYOUT_LIMITS[name]
        whole = name != "gpu_memory_gb"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (whole and value != int(value)) or not low <= value <= high:
            kind = "a whole number" if whole else "a number"
            raise PlanError(f"--{name.replace('_', '-')} {value!r}: expected {kind} from {low:g} to {high:g}")


# ---------------------------------------------------------------------------------------------------------------
# model shapes
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelShape:
    """The fields of a supported HF config.json the planner needs (SwiGLU, RMSNorm, RoPE; dense or MoE)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    head_dim: int = 0
    """0 = hidden // heads."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm weight of head_dim for the queries and one for the keys in every layer."""
    experts: int = 0
    """Mixture of experts (Qwen3-MoE, Qwen2-MoE): routed experts per layer (0: dense; every layer is MoE)."""
    topk: int = 0
    """Experts each token is routed to."""
    moe_ffn: int = 0
    """One expert's SwiGLU width (moe_intermediate_size)."""
    shared_ffn: int = 0
    """The shared expert's width (Qwen2-MoE: gated; GLM-4.5: n_shared_experts x moe_ffn, ungated; 0: none)."""
    shared_gate: bool = True
    """Whether the shared expert has a gate [1, h] (Qwen2-MoE)."""
    dense_layers: int = 0
    """MoE models whose first layers are dense (GLM-4.5's first_k_dense_replace): their MLP is `ffn` wide."""
    kv_lora: int = 0
    """Multi-latent attention (DeepSeek-V3; 0: GQA): the compressed kv rank. head_dim is then the q/k head (no-rope +
    rope dims)."""
    q_lora: int = 0
    """Its q rank (0: a full q projection)."""
    qk_rope: int = 0
    """Its rotary key dims (one key shared by the heads)."""
    v_head: int = 0
    """Its value head size."""

    @property
    def attention_shapes(self) -> list[tuple[int, int]]:
        """One layer's attention projection weights [out, in] (all split over TP in the actor): q, k, v and o; with
        multi-latent attention its down projections (split by rows), up projections (by heads) and o."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        if not self.kv_lora:
            return [(q, h), (kv, h), (kv, h), (h, q)]
        nope = self.hd - self.qk_rope
        qs = [(self.q_lora, h), (q, self.q_lora)] if self.q_lora else [(q, h)]
        kvs = [(self.kv_lora + self.qk_rope, h), (self.heads * (nope + self.v_head), self.kv_lora)]
        return [*qs, *kvs, (h, self.heads * self.v_head)]

    @property
    def attention_norms(self) -> int:
        """One layer's attention norm weights (replicated): Qwen3's q / k norms, MLA's low-rank norms."""
        return (2 * self.hd if self.qk_norm else 0) + (self.q_lora + self.kv_lora if self.kv_lora else 0)

    @property
    def attention_params(self) -> int:
        """One layer's attention projection parameters, biases included."""
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return sum(r * c for r, c in self.attention_shapes) + bias

    @property
    def moe_layers(self) -> int:
        """Layers with the MoE block (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has the MoE block."""
        return bool(self.experts) and layer >= self.dense_layers

    def layer_params(self, layer: int) -> tuple[int, int, int]:
        """(tensor-parallel, routed-expert, replicated) parameters of layer `layer`: the layer_* properties for an MoE
        layer, the dense MLP and no router for a dense one."""
        if self.sparse(layer):
            return self.layer_sharded_params, self.layer_expert_params, self.layer_replicated_params
        return self.attention_params + 3 * self.hidden * self.ffn, 0, 2 * self.hidden + self.attention_norms

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.hd

    @property
    def layer_sharded_params(self) -> int:
        """Parameters of one layer that tensor parallelism splits: q, k, v (+ biases), o and the MLP's gate, up, down
        (MoE: the shared expert's; the routed experts are layer_expert_params). An MoE model's MoE layer
        (`layer_params` gives any layer's)."""
        return self.attention_params + 3 * self.hidden * (self.shared_ffn if self.experts else self.ffn)

    @property
    def layer_expert_params(self) -> int:
        """Parameters of one layer's routed experts (split over tensor x expert parallel ranks; 0 when dense)."""
        return self.experts * 3 * self.hidden * self.moe_ffn

    @property
    def layer_replicated_params(self) -> int:
        """Parameters of one layer on every TP rank: the two RMSNorm weights (and Qwen3's q / k norms; MoE: the
        router [E, h] and the shared expert's gate [1, h]; GLM-4.5's router bias is a buffer, not a parameter)."""
        gate = self.shared_ffn and self.experts and self.shared_gate
        router = self.experts * self.hidden + (self.hidden if gate else 0)
        return 2 * self.hidden + self.attention_norms + router

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (MoE: top-k of the routed experts; dense: num_params): FLOPs and decode
        speed scale with it."""
        return self.num_params - self.moe_layers * (self.experts - self.topk) * 3 * self.hidden * self.moe_ffn

    @property
    def layer_mlp_act(self) -> int:
        """Per token, the MLP's stored activations in elements (/ tp): gate|up and the SwiGLU output of the dense
        MLP (3 ffn), or of each of the top-k experts and the shared expert, plus the dispatched copies of the token
        (k in, k out: 2 k h); with dense first layers, the larger of the two (an upper bound for those layers)."""
        if not self.experts:
            return 3 * self.ffn
        moe = self.topk * 3 * self.moe_ffn + 3 * self.shared_ffn + 2 * self.topk * self.hidden
        return max(moe, 3 * self.ffn) if self.dense_layers else moe

    @property
    def num_params(self) -> int:
        """The HF parameter count (unpadded vocabulary; the LM head counted once when tied; every expert)."""
        layers = sum(sum(self.layer_params(i)) for i in range(self.layers))
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return layers + embeddings + self.hidden


# Known architectures (from the models' HF config.json; used when actor.model_path is not on this machine):
# name, hidden, layers, heads, kv_heads, ffn, vocab, tied, qkv_bias.
_KNOWN = [
    ("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, True),
    ("Qwen2.5-32B", 5120, 64, 40, 8, 27648, 152064, False, True),
    ("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True, False),
]
_V3_TAIL = (2048, False, 3, 512, 1536, 64, 128)  # DeepSeek-V3's shared expert .. value head (the fields in order)
_KNOWN_MOE = [
    # ... + head_dim, qk_norm, routed experts, top-k, expert width (moe_intermediate_size; Mixtral's intermediate_size)
    ("Qwen3-30B-A3B", 2048, 48, 32, 4, 6144, 151936, False, False, 128, True, 128, 8, 768),
    ("Qwen3-235B-A22B", 4096, 94, 64, 4, 12288, 151936, False, False, 128, True, 128, 8, 1536),
    ("Mixtral-8x7B-Instruct-v0.1", 4096, 32, 32, 8, 14336, 32000, False, False, 0, False, 8, 2, 14336),
    # ... + shared expert width, its gate, dense first layers (GLM-4.5-Air: zai-org/GLM-4.5-Air's config.json)
    ("GLM-4.5-Air", 4096, 46, 96, 8, 10944, 151552, False, True, 128, False, 128, 8, 1408, 1408, False, 1),
    # ... + multi-latent attention: kv rank, q rank, rotary key dims, value head (deepseek-ai/DeepSeek-V3's config.json;
    # head_dim is the q/k head, 128 no-rope + 64 rope)
    ("DeepSeek-V3", 7168, 61, 128, 128, 18432, 129280, False, False, 192, False, 256, 8, 2048, *_V3_TAIL),
]
KNOWN_MODELS: dict[str, ModelShape] = {row[0].lower(): ModelShape(*row) for row in [*_KNOWN, *_KNOWN_MOE]}


def _family(cfg: dict[str, Any]) -> tuple[bool, bool, MoeShape | None, MlaShape | None]:
    """(q/k/v biases, q/k norm, the MoE shape, the MLA shape) by the actor's own rules (actor/arch.py); an architecture
    the actor does not know is planned as a dense model without any."""
    import types

    hf = types.SimpleNamespace(**cfg)
    try:
        return has_qkv_bias(hf), has_qk_norm(hf), moe_shape(hf), mla_shape(hf)
    except (ValueError, AttributeError, TypeError):
        return False, False, None, None


def shape_from_hf_config(cfg: dict[str, Any], name: str) -> ModelShape:
    """ModelShape from a parsed HF config.json (the family's traits: `_family`)."""
    try:
        heads = int(cfg["num_attention_heads"])
        qkv_bias, qk_norm, moe, mla = _family(cfg)
        return ModelShape(
            name=name,
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            ffn=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            head_dim=mla.q_head if mla else int(cfg.get("head_dim") or 0),
            qk_norm=qk_norm,
            experts=moe.experts if moe else 0,
            topk=moe.topk if moe else int(cfg.get("num_experts_per_tok") or 0),
            moe_ffn=moe.ffn if moe else 0,
            shared_ffn=moe.shared_ffn if moe else 0,
            shared_gate=moe.shared_gate if moe else True,
            dense_layers=moe.dense_layers if moe else 0,
            kv_lora=mla.kv_lora if mla else 0,
            q_lora=(mla.q_lora or 0) if mla else 0,
            qk_rope=mla.rope if mla else 0,
            v_head=mla.v if mla else 0,
        )
    except KeyError as err:
        raise PlanError(f"{name}/config.json: missing field {err.args[0]!r}") from None


def resolve_model(model_path: str) -> tuple[ModelShape, str]:
    """(shape, source): `model_path`/config.json when it exists, else KNOWN_MODELS by the path's last component
    (case-insensitive, an "-Instruct" suffix ignored). Raises PlanError naming actor.model_path otherwise."""
    path = Path(model_path)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        return shape_from_hf_config(json.loads(cfg_file.read_text()), path.name), str(cfg_file)
    key = path.name.lower().removesuffix("-instruct")
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key], f"built-in table ({key}; {cfg_file} not found)"
    names = sorted(m.name for m in KNOWN_MODELS.values())
    raise PlanError(f"actor.model_path: {model_path!r} has no config.json here and is not one of {names}")


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the smallest multiple of divisible_by * tp holding `vocab` rows (the same rule
    as actor/model.py::padded_vocab_size)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


# ---------------------------------------------------------------------------------------------------------------
# assumptions
# ---------------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Assumptions:
    """Every number the planner does not read from the config or the layout. All are printed with the plan."""

    trainer_overhead_gib: float = 2.5
    """Per GPU, the training process: CUDA context (~0.6), NCCL communicators and allocator fragmentation."""
    engine_overhead_gib: float = 1.0
    """Per GPU, the SGLang scheduler process: CUDA context and its NCCL group; kept while its memory is released."""
    cuda_graph_gib: float = 2.0
    """SGLang's decode CUDA graphs per GPU (its log prints the real figure: "Capture cuda graph end ... mem")."""
    engine_workspace_gib: float = 2.0
    """SGLang activations while generating (prefill chunk, sampling buffers), per GPU."""
    safety_gib: float = 2.0
    """A phase fits when its peak is at most gpu_memory_gb - safety_gib."""
    dtype_bytes: int = 2
    """Engine weights and KV cache dtype (bf16)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (H100 SXM: 989)."""
    mfu: float = 0.35
    """Model FLOPs utilisation of log-probs and update."""
    decode_tps_per_gpu: float = 0.0
    """Decode tokens/s per GPU at a full batch; 0 = 1500 * 32.8e9 / N (1500 assumed for Qwen2.5-32B on H100)."""
    decode_tps_per_seq: float = 0.0
    """Decode tokens/s of one sequence; 0 = 60 * 8.2e9 / (N / engine TP), at most 300 (a decode step reads the
    engine's weights: 60 tok/s assumed at 8.2e9 parameters per GPU, Qwen2.5-32B at TP 4)."""
    mean_prompt_tokens: int = 256
    """Mean prompt length in tokens."""
    mean_response_frac: float = 0.3
    """Mean response length as a share of rollout.max_response_length."""
    nvlink_gbps: float = 360.0
    """Intra-node all-gather / broadcast bandwidth per GPU (NVLink 4 bus bandwidth)."""
    internode_gbps: float = 40.0
    """Inter-node bandwidth per GPU (one 400 Gb/s NIC per GPU, ~80% efficiency)."""
    ipc_gbps: float = 400.0
    """SGLang workers reading a bucket through CUDA IPC (NVLink)."""
    bucket_overhead_s: float = 0.2
    """Fixed cost per weight-sync bucket: SGLang's update_weights_from_tensor round trip (IPC handles rebuilt on every
    TP worker, load_weights, the workers' barrier) and the actor's gather of the next bucket."""
    engine_memory_s: float = 3.0
    """Per step, SGLang's release of weights + KV + graphs and the two resumes (torch_memory_saver unmapping and
    remapping tens of GiB), and the flush of its cache."""
    offload_gbps: float = 25.0
    """Actor state to / from pinned host memory per GPU (PCIe Gen5 x16, ~40% of its 64 GB/s each way); also the
    delta sync's comparison of the export with the sender's host copy (rollout/delta.py)."""
    delta_bytes_fraction: float = 0.065
    """rollout.weight_sync_delta: the bytes a delta sync sends as a share of a full one. Measured on CPU at the main
    job's lr (5e-6, bf16 export, SmolLM2-135M and its MoE upcycle; docs/benchmarks.md "Delta weight sync":
    0.064-0.065)."""
    delta_bytes_fraction_fp8: float = 0.037
    """The same with rollout.weight_dtype "fp8" (a delta of the block-FP8 stream: e4m3 projections change about a
    tenth as often as bf16 ones; the same run: 0.021-0.037, the bf16 embeddings most of it)."""
    http_gbps: float = 0.38
    """rollout.weight_sync_delta into SGLang servers on the rank-0 route: the changed elements' bytes per second
    through one /update_weights_from_tensor body (pickled, base64 in JSON: 4/3 of their bytes; TP rank 0's payload
    only), encoded once by actor rank 0 for every server (sglang_loader.request_body + body_bytes: 0.38 GB/s measured
    on this 2-core CPU for 300 MB) and decoded by each server, taken at the same rate (SGLang's own decode path,
    pybase64, msgspec and the TP group's broadcast, is not measured)."""
    preempt_margin_s: float = 120.0
    """Added to the preemption lead time: start-up of the last save, file-system stalls, the signal's path."""
    checkpoint_gbps_per_node: float = 2.0
    """Checkpoint write bandwidth per node to the shared file system."""
    eval_prompts: int = 30
    """Evaluation prompts when trainer.eval_max_prompts is 0 (AIME 2024: 30)."""
    shard_imbalance: float = 0.5
    """Only the comparison with sequential rounds: how far the slowest of the static per-engine shards of a round
    ran behind the median (the rounds waited for it; the stream has no shards)."""
    tool_calls_per_trajectory: float = 1.0
    """Multi-turn environments (reward.environment python_tool): tool calls per trajectory."""
    tool_seconds_per_call: float = 0.5
    """Wall seconds of one tool call (a fresh sandboxed interpreter: ~0.1 s to start, the model's code after). The
    stream runs a rank's calls one at a time in its loop, while its engine waits (docs/environments.md)."""
    dedicated_mem_fraction: float = 0.85
    """The async schedule only: SGLang's mem_fraction_static on GPUs the engine has to itself (weights + KV cache as a
    share of the memory left after its process; SGLang picks ~0.8-0.9 by GPU size when unset)."""

    def tps_per_gpu(self, num_params: int) -> float:
        return self.decode_tps_per_gpu or min(50000.0, 1500.0 * 32.8e9 / num_params)

    def tps_per_seq(self, num_params: int, engine_tp: int) -> float:
        return self.decode_tps_per_seq or min(300.0, 60.0 * 8.2e9 / (num_params / engine_tp))


# ---------------------------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Term:
    """One memory term of a phase: its size in GiB and how it was computed."""

    name: str
    gib: float
    formula: str


@dataclass(slots=True)
class Phase:
    """Per-GPU memory of one phase on one pipeline stage."""

    name: str
    stage: int
    terms: list[Term]
    error: str = ""
    """Set when the phase fails for a reason other than its total (e.g. no room for one sequence's KV cache)."""

    @property
    def total_gib(self) -> float:
        return sum(t.gib for t in self.terms)

    def term(self, name: str) -> float:
        return next(t.gib for t in self.terms if t.name == name)


@dataclass(slots=True)
class Plan:
    """The result of make_plan: layout, per-stage phases, step times, assumptions and notes."""

    model: ModelShape
    model_source: str
    layout: dict[str, Any]
    usable_gib: float
    phases: list[Phase]
    times_s: dict[str, float]
    time_formulas: dict[str, str]
    assumptions: Assumptions
    notes: list[str] = field(default_factory=list)
    preempt_lead_s: float = 0.0
    """Seconds between the time-limit signal and the end of the job that a save needs (`preemption_lead`)."""
    preempt_lead_formula: str = ""
    over_timeouts: list[str] = field(default_factory=list)
    """Waits planned longer than their config timeouts (`over_timeouts`): the run would end at the first one."""
    async_plan: AsyncSchedule | None = None
    """The same config on the fastest disaggregated split, asynchronous (`async_schedule`); time only."""

    def peak(self, phase: str) -> Phase:
        """The stage of `phase` that fails (an error first, then the highest total) or else has the highest total."""
        stages = [p for p in self.phases if p.name == phase]
        return max(stages, key=lambda p: (bool(p.error), p.total_gib))

    @property
    def failing(self) -> list[Phase]:
        """Worst stage of every phase that does not fit, in phase order."""
        names = list(dict.fromkeys(p.name for p in self.phases))
        return [ph for ph in map(self.peak, names) if ph.error or ph.total_gib > self.usable_gib]

    @property
    def exit_code(self) -> int:
        return 2 if self.failing or self.over_timeouts else 0

    def report(self) -> str:
        return format_plan(self)


def _gib(num_bytes: float) -> float:
    return num_bytes / GiB


@dataclass(frozen=True, slots=True)
class _Stage:
    """Parameters on one GPU of pipeline stage `index` of the actor."""

    index: int
    layers: int
    params: int
    has_lm_head: bool
    expert_params: int = 0
    """Of `params`, the routed experts' (their optimizer state is sharded over the expert data-parallel group)."""


def actor_stages(m: ModelShape, tp: int, pp: int, ep: int = 1) -> list[_Stage]:
    """Per-GPU parameter count of each pipeline stage: layers/pp layers split over tp (norms replicated; MoE: the
    routed experts over tp x ep), the vocab-parallel embedding [V_pad/tp, h] on stage 0, the LM head [V_pad/tp, h] and
    the final norm on the last stage (tied and pp > 1: megatron keeps a copy of the embedding there; tied and
    pp == 1: one tensor)."""
    if m.layers % pp:
        raise PlanError(f"actor.pipeline_parallel: {pp} must divide num_hidden_layers {m.layers}")
    if m.kv_heads % tp:
        raise PlanError(f"actor.tensor_parallel: {tp} must divide num_key_value_heads {m.kv_heads}")
    if ep > 1 and (not m.experts or m.experts % ep):
        raise PlanError(f"actor.expert_parallel: {ep} must divide the model's experts ({m.experts})")
    vocab_rows = padded_vocab(m.vocab, tp) // tp * m.hidden
    stages, per_stage = [], m.layers // pp
    for s in range(pp):
        mine = [m.layer_params(i) for i in range(s * per_stage, (s + 1) * per_stage)]
        experts = sum(e // (tp * ep) for _, e, _ in mine)
        n = sum(sharded // tp + replicated for sharded, _, replicated in mine) + experts
        first, last = s == 0, s == pp - 1
        if first:
            n += vocab_rows
        if last:
            n += m.hidden + (0 if (m.tied and first) else vocab_rows)
        stages.append(_Stage(s, per_stage, n, last, expert_params=experts))
    return stages


def _has_reference(config: Any) -> bool:
    """Whether the run builds the frozen reference model (a loss with a KL term; actor/reference.py)."""
    loss = getattr(config, "loss", None)
    return loss is not None and uses_reference(loss)


def actor_state_bytes_per_param(dtype: str, dp: int, distributed: bool) -> tuple[float, float, float]:
    """(param, grad, optimizer) bytes per parameter with megatron-core 0.16.1's DDP and optimizer as actor.py builds
    them: params in the param buffer (2 bytes bf16/fp16, 4 fp32), grads in the fp32 main-grad buffer
    (grad_reduce_in_fp32=True: 4), optimizer = fp32 master copy (16-bit params only: 4) + Adam exp_avg and exp_avg_sq
    (8), divided by dp under the distributed optimizer (each DP rank owns 1/dp of the buffer)."""
    p = 4.0 if dtype == "fp32" else 2.0
    opt = (0.0 if dtype == "fp32" else 4.0) + 8.0
    return p, 4.0, opt / dp if distributed else opt


def layer_activation_bytes(m: ModelShape, tp: int, recompute: str, b: int = 2, sp: bool = False) -> float:
    """Bytes one layer keeps per token for its backward (flash attention, no dropout):
    none: two RMSNorms keep input and output (4*h*b) and fp32 rms factors (8), split tp ways only under sequence
          parallelism (sp); q/k/v and the attention output (2*q_dim + 2*kv_dim)*b/tp; the MLP keeps gate|up (2f) and
          the SwiGLU output (f): 3f*b/tp (MoE: `ModelShape.layer_mlp_act`, k experts' 3 f_e, the shared expert's
          3 f_s and the token's 2 k dispatched copies, plus fp32 router logits and probabilities 8 E); fp32 softmax
          stats 4*heads/tp.
    selective: as none without the softmax stats (megatron recomputes core attention only).
    full: the layer input h*b (/tp under sp); the rest is recomputed one layer at a time."""
    h = m.hidden
    seq_split = tp if sp else 1
    if recompute == "full":
        return h * b / seq_split
    base = (4 * h * b + 8) / seq_split + (2 * m.q_dim + 2 * m.kv_dim + m.layer_mlp_act) * b / tp
    router = 8 * m.experts  # fp32 router logits and probabilities [E] per token (MoE)
    return (base if recompute == "selective" else base + 4 * m.heads / tp) + router


def recompute_mode(actor: Any) -> str:
    """Recompute mode "full", "selective" or "none": actor.recompute if the config has it, else from
    actor.recompute_activations."""
    mode = getattr(actor, "recompute", None)
    if mode is not None:
        return str(mode)
    return "full" if actor.recompute_activations else "none"


def microbatch_tokens(config: Any) -> tuple[int, str]:
    """(tokens, source): the most tokens one actor micro-batch can hold. With actor.max_tokens_per_microbatch = B > 0
    the budget, or one row of max_prompt_length + max_response_length when that is longer (a longer row is a
    micro-batch alone, actor/packing.py); else trainer.micro_batch_size rows of that length."""
    seq = config.data.max_prompt_length + config.rollout.max_response_length
    budget = getattr(config.actor, "max_tokens_per_microbatch", 0) or 0
    if budget > 0:
        return max(budget, seq), f"actor.max_tokens_per_microbatch {budget}, a row at most {seq}"
    mbs = config.trainer.micro_batch_size
    return mbs * seq, f"micro_batch_size {mbs} x (max_prompt_length + max_response_length) {seq}"


def microbatches_per_rank(config: Any, dp: int, mean_seq: float) -> int:
    """Micro-batches one DP rank runs per mini-batch: its rows / micro_batch_size, or with a token budget its
    tokens (rows x mean_seq) / budget (rows are balanced over DP ranks by tokens)."""
    rows = -(-mini_batch_rows(config) // dp)
    budget = getattr(config.actor, "max_tokens_per_microbatch", 0) or 0
    if budget > 0:
        return max(1, math.ceil(rows * mean_seq / budget))
    return -(-rows // config.trainer.micro_batch_size)


def lm_head_bytes(m: ModelShape, tp: int, tokens: int, impl: str, train: bool, b: int = 2) -> tuple[float, str]:
    """Extra bytes of the last stage's LM head + log-prob op for one micro-batch of `tokens`.

    fused_linear: the final hidden [T, h], fp32 stats [3, T] and the op's tile scratch (ops/tiling.py: one fp32 logits
    tile, in backward also one tile of d logits and the fp32 d_hidden accumulator); backward adds d_hidden [T, h] and
    the LM-head weight gradient [V_pad/tp, h] (b bytes each). Other impls: the logits [T, V_pad/tp] in the compute
    dtype (the model runs with fp32_output=False) and, in backward, their gradient of the same size, plus the stats."""
    v_local = padded_vocab(m.vocab, tp) // tp
    if impl == "fused_linear":
        tiles = tiling.scratch_bytes(tokens, v_local, m.hidden, b, train)
        if train:
            total = 2 * tokens * m.hidden * b + 12 * tokens + v_local * m.hidden * b + tiles
            return total, "2*T*h*b + 12*T + V/tp*h*b + tiles (ops/tiling.py)"
        return tokens * m.hidden * b + 12 * tokens + tiles, "T*h*b + 12*T + tile (ops/tiling.py)"
    if train:
        return 2 * tokens * v_local * b + 12 * tokens, "2*T*(V/tp)*b + 12*T (logits + grad)"
    return tokens * v_local * b + 12 * tokens, "T*(V/tp)*b + 12*T (logits)"


def engine_weight_bytes(m: ModelShape, etp: int, b: int, fp8: bool = False) -> float:
    """Per-GPU weights of an SGLang engine at tensor parallel etp: linear layers and the vocab-parallel embedding and
    LM head split etp ways, norms replicated (MoE: every expert on every engine GPU, each split etp ways, SGLang's
    default without expert parallel; the router replicated). fp8 (rollout.weight_dtype "fp8"): the q/k/v/o and
    gate/up/down weights (experts' too) at 1 byte per element plus an fp32 scale per 128 x 128 block
    (fp8_format.py); biases, norms, routers, embeddings and the LM head stay at b. etp=1 gives the whole model: the
    bytes one weight sync sends."""
    linear = sum(linear_weight_bytes(m, fp8, b, sparse=m.sparse(i)) for i in range(m.layers))
    biases = m.layers * (m.q_dim + 2 * m.kv_dim if m.qkv_bias else 0) * b
    embeddings = m.vocab * m.hidden * (1 if m.tied else 2) * b
    replicated = (sum(m.layer_params(i)[2] for i in range(m.layers)) + m.hidden) * b
    return (linear + biases + embeddings) / etp + replicated


def linear_weight_bytes(m: ModelShape, fp8: bool, b: int, *, sparse: bool) -> float:
    """Bytes of one layer's projection weights ([out, in]: q, k, v, o, then gate, up, down of the MLP, or of every
    expert and the shared expert) in bf16 or block FP8 (the MoE router is in layer_replicated_params). sparse: an MoE
    layer (`ModelShape.sparse`)."""
    h, f = m.hidden, m.ffn
    mlp = [(f, h), (f, h), (h, f)]
    if sparse:
        fe, fs = m.moe_ffn, m.shared_ffn
        mlp = [(fe, h), (fe, h), (h, fe)] * m.experts + ([(fs, h), (fs, h), (h, fs)] if fs else [])
    shapes = [*m.attention_shapes, *mlp]
    if fp8:
        return float(sum(fp8_weight_bytes(r, c) for r, c in shapes))
    return float(sum(r * c for r, c in shapes) * b)


def kv_bytes_per_token(m: ModelShape, etp: int, b: int) -> float:
    """KV cache bytes per token on one GPU of the engine: 2 (K and V) * layers * kv_heads/etp * head_dim * b (SGLang
    replicates KV heads when etp > kv_heads: at least one head per GPU); multi-latent attention caches the compressed
    kv and the rotary key, layers * (kv_lora + qk_rope) * b, the same on every GPU of the engine (not split over TP)."""
    if m.kv_lora:
        return m.layers * (m.kv_lora + m.qk_rope) * b
    return 2 * m.layers * max(1.0, m.kv_heads / etp) * m.hd * b


@dataclass(frozen=True, slots=True)
class _Setup:
    """What make_plan derives once from the config and the layout."""

    config: Any
    a: Assumptions
    m: ModelShape
    dp: int
    offload: str
    recompute: str
    tokens: int
    num_micro: int
    bytes_per_param: tuple[float, float, float]
    gpu_memory_gb: float
    sp: bool
    """Sequence parallelism on (actor.sequence_parallel and TP > 1)."""
    ep: int = 1
    """Expert parallel (MoE): the expert data-parallel size is dp / ep."""

    @property
    def b(self) -> int:
        return 4 if self.config.actor.dtype == "fp32" else 2


def make_plan(
    config: Any, *, nodes: int, gpus_per_node: int, gpu_memory_gb: float, assumptions: Assumptions | None = None
) -> Plan:
    """Plan `config` (a RunConfig, or any object with its sections and fields) on nodes x gpus_per_node GPUs of
    gpu_memory_gb GiB each. Raises PlanError (naming the field) when the layout cannot run at all."""
    check_layout(nodes, gpus_per_node, gpu_memory_gb)
    a = assumptions or Assumptions()
    act, ro = config.actor, config.rollout
    m, source = resolve_model(act.model_path)
    world = nodes * gpus_per_node
    tp, pp, ep = act.tensor_parallel, act.pipeline_parallel, getattr(act, "expert_parallel", 1)
    if world % (tp * pp):
        raise PlanError(f"actor.tensor_parallel x pipeline_parallel = {tp * pp} must divide {world} GPUs")
    if world % (tp * ep * pp):
        raise PlanError(f"actor.tensor_parallel x expert_parallel x pipeline_parallel = {tp * ep * pp} must divide "
                        f"{world} GPUs")  # fmt: skip
    dp = world // (tp * pp)
    notes: list[str] = []
    offload = getattr(act, "offload", None)
    if offload is None:
        notes.append("config has no actor.offload: planned as offload=none (actor state stays on the GPU)")
        offload = "none"
    tokens, tokens_src = microbatch_tokens(config)
    bpp = actor_state_bytes_per_param(act.dtype, dp, act.use_distributed_optimizer)
    mean_seq = a.mean_prompt_tokens + a.mean_response_frac * ro.max_response_length
    num_micro = microbatches_per_rank(config, dp, mean_seq)
    sp = bool(getattr(act, "sequence_parallel", False)) and tp > 1
    setup = _Setup(config, a, m, dp, offload, recompute_mode(act), tokens, num_micro, bpp, gpu_memory_gb, sp, ep)
    ep_note = f" (EP {ep} of it: expert DP {dp // ep})" if m.experts else ""
    layout = {
        "gpus": f"{nodes} nodes x {gpus_per_node} = {world}",
        "actor": f"TP {tp} x PP {pp} x DP {dp}{ep_note} ({act.dtype}, distributed optimizer "
        f"{'on' if act.use_distributed_optimizer else 'off'}, recompute {setup.recompute}, sequence parallel "
        f"{'on' if sp else 'off'}, logprob_impl {act.logprob_impl}, offload {offload})",
        "engine": f"{ro.engine} {ro.mode}, TP {ro.tensor_parallel}, mem_fraction {ro.mem_fraction}",
        "micro-batch": f"at most {tokens} tokens ({tokens_src}); ~{num_micro} micro-batches per mini-batch per DP rank",
        "model": f"{m.name}: {m.num_params / 1e9:.3f} B params (h {m.hidden}, L {m.layers}, heads {m.heads}, kv "
        f"{m.kv_heads}, ffn {m.ffn}, V {m.vocab}, tied {m.tied})"
        + (
            f"; MoE {m.experts} experts of ffn {m.moe_ffn}, top-{m.topk}, {m.active_params / 1e9:.2f} B active"
            if m.experts
            else ""
        ),  # fmt: skip
    }
    phases = [ph for st in actor_stages(m, tp, pp, ep) for ph in _stage_phases(setup, st)]
    order = ["engine start", *PHASES]  # the choreography's phases in its order (megatron_dapo/memory.py)
    phases.sort(key=lambda p: (order.index(p.name), p.stage))
    kv_tok = kv_bytes_per_token(m, ro.tensor_parallel, a.dtype_bytes)
    kv_tokens = min([int(p.term("engine KV cache") * GiB // kv_tok) for p in phases if p.name == "engine start"] or [0])
    times, formulas = step_times(config, m, nodes, gpus_per_node, dp, a, setup.recompute, num_micro, kv_tokens)
    if ro.mode != "colocated":
        notes.append("server mode: the SGLang servers' GPUs are not planned here (only the actor's)")
    planned_as = engine_kind(engine_kind(ro.engine).planned_as)
    if planned_as.name != ro.engine:
        notes.append(f"rollout.engine {ro.engine}: engine memory is planned with {planned_as.label}'s rules")
    lead, lead_formula = preemption_lead(config, m, nodes, a, times)
    plan = Plan(m, source, layout, gpu_memory_gb - a.safety_gib, phases, times, formulas, a, notes, lead, lead_formula)
    plan.over_timeouts = over_timeouts(config, times)
    plan.async_plan = async_schedule(config, m, nodes, gpus_per_node, gpu_memory_gb, a)
    return plan


def over_timeouts(config: Any, times: dict[str, float]) -> list[str]:
    """The waits the plan says outlast their config timeouts, in words: one evaluation (eval prompts x eval_samples,
    then one exchange that waits for the slowest rank) against trainer.eval_timeout_minutes, which would end the job
    with an exchange timeout. (Generation's rollout.generation_timeout_minutes bounds a wait without progress, not
    the step's generation, so it is not compared here.)"""
    every = config.trainer.eval_every
    once, minutes = times.get("eval", 0.0) * every, config.trainer.eval_timeout_minutes
    if every and once > minutes * 60:
        return [f"one evaluation is planned at {once / 60:,.1f} min, more than trainer.eval_timeout_minutes={minutes:g}"
                " (lower trainer.eval_max_prompts or trainer.eval_samples, or raise the timeout)"]  # fmt: skip
    return []


def _stage_phases(s: _Setup, st: _Stage) -> list[Phase]:
    """The phases of one pipeline stage (see docs/planning.md for what coexists in each)."""
    a, m, act, ro = s.a, s.m, s.config.actor, s.config.rollout
    tp, n, dp = act.tensor_parallel, st.params, s.dp
    p_b, g_b, o_b = s.bytes_per_param
    # The distributed optimizer shards the dense part over DP, the routed experts over the expert DP group (dp / ep).
    o_e = actor_state_bytes_per_param(act.dtype, dp // s.ep, act.use_distributed_optimizer)[2]
    params, grads, opt = _gib(n * p_b), _gib(n * g_b), _gib((n - st.expert_params) * o_b + st.expert_params * o_e)
    trainer = Term("trainer runtime", a.trainer_overhead_gib, "assumption trainer_overhead_gib")
    colocated = ro.mode == "colocated"
    engine_rt = Term("engine runtime", a.engine_overhead_gib if colocated else 0.0, "assumption (colocated only)")
    state = [
        Term("actor params", params, f"{n:,} params x {p_b:g} B"),
        Term("actor grads", grads, f"{n:,} x {g_b:g} B (fp32 main grads)"),
        Term(
            "actor optimizer",
            opt,
            f"{n:,} x {o_b:.4g} B (fp32 master + Adam m, v / dp {dp})"
            if not st.expert_params
            else f"{n - st.expert_params:,} x {o_b:.4g} B (/ dp {dp}) + experts {st.expert_params:,} x {o_e:.4g} B "
            f"(/ expert dp {dp // s.ep})",
        ),  # fmt: skip
    ]
    parts = list(PARTS)
    if _has_reference(s.config):  # the frozen reference (actor/reference.py): parameters only, moved with the actor's
        state.append(Term("reference params", params, f"{n:,} params x {p_b:g} B (frozen, loss.kl_coef > 0)"))
        parts.append("params")
    # What of the actor is on the device in each phase: the choreography's own sequence, run with probes.
    resident = resident_by_phase(s.offload)

    def actor_terms(phase: str) -> list[Term]:
        on = resident[phase]["actor"]
        return [t if part in on else Term(t.name, 0.0, "offloaded") for part, t in zip(parts, state, strict=True)]

    # -- actor phases (engine memory released: only its process runtime stays)
    per_layer = layer_activation_bytes(m, tp, s.recompute, s.b, s.sp)
    one_layer = layer_activation_bytes(m, tp, "none", s.b, s.sp) * s.tokens
    in_flight = min(act.pipeline_parallel - st.index, s.num_micro) if act.pipeline_parallel > 1 else 1
    update = [
        Term(
            "activations (stored)",
            _gib(in_flight * st.layers * per_layer * s.tokens),
            f"{in_flight} micro-batch(es) in flight x {st.layers} layers x {per_layer:,.0f} B/token ({s.recompute})"
            f" x {s.tokens} tokens",
        )
    ]
    if s.recompute == "full":
        update.append(Term("activations (recomputed layer)", _gib(one_layer), "1 layer x none-size x T"))
    logprobs = [Term("forward working set", _gib(one_layer), "1 layer x none-size x T (forward only)")]
    if st.has_lm_head:
        for terms, train in ((update, True), (logprobs, False)):
            lm, formula = lm_head_bytes(m, tp, s.tokens, act.logprob_impl, train, s.b)
            terms.append(Term(f"LM head ({act.logprob_impl})", _gib(lm), formula))
    buckets = Term(
        "sync buffers",
        _gib(2 * ro.weight_sync_bucket_bytes),
        f"2 x bucket {ro.weight_sync_bucket_mb} MiB (gathered + flattened)",
    )
    out = [
        Phase("log-probs", st.index, [trainer, engine_rt, *actor_terms("log-probs"), *logprobs]),
        Phase("update", st.index, [trainer, engine_rt, *actor_terms("update"), *update]),
    ]
    if not colocated:
        return [*out, Phase("sync", st.index, [trainer, *actor_terms("sync"), buckets])]
    # -- engine phases: SGLang sizes weights + KV to mem_fraction of the memory free when it starts, once. The trainer
    # starts it in the generation phase's memory state (MemoryChoreographer.build_engine): what actor.offload keeps
    # off the GPU while generating is in host memory; what stays is as built (Adam's moments do not exist yet, the
    # fp32 master copy does).
    etp = ro.tensor_parallel
    shards = (dp, dp // s.ep) if act.use_distributed_optimizer else (1, 1)
    master_b = 0.0 if act.dtype == "fp32" else 4.0
    master = _gib(master_b * ((n - st.expert_params) / shards[0] + st.expert_params / shards[1]))
    generating = resident["generation"]["actor"]
    at_start = [
        t if part in generating else Term(t.name, 0.0, "in host memory while the engine starts (actor.offload)")
        for part, t in zip(parts, state, strict=True)
    ]
    at_start[2] = Term("actor master params", master, "fp32 master / dp") if "optimizer" in generating else at_start[2]
    pre_free = s.gpu_memory_gb - a.trainer_overhead_gib - engine_rt.gib - sum(t.gib for t in at_start)
    fp8 = getattr(ro, "weight_dtype", "auto") == "fp8"
    weights = _gib(engine_weight_bytes(m, etp, a.dtype_bytes, fp8))
    kv = ro.mem_fraction * pre_free - weights
    kv_tok = kv_bytes_per_token(m, etp, a.dtype_bytes)
    at = "block FP8 (linear layers)" if fp8 else f"{a.dtype_bytes} B"
    w_term = Term("engine weights", weights, f"{m.num_params / 1e9:.2f} B params at {at} / TP {etp}")
    kv_term = Term(
        "engine KV cache",
        max(kv, 0.0),
        f"mem_fraction {ro.mem_fraction} x free at start {pre_free:.2f} GiB - weights; "
        f"{kv_tok:,.0f} B/token -> {max(kv, 0.0) * GiB / kv_tok:,.0f} tokens",
    )
    start = Phase("engine start", st.index, [trainer, engine_rt, *at_start, w_term, kv_term])
    max_seq = s.config.data.max_prompt_length + ro.max_response_length
    if kv * GiB < kv_tok * max_seq:
        start.error = f"KV cache holds < 1 sequence of {max_seq} tokens"
    graphs = Term("engine CUDA graphs", a.cuda_graph_gib, "assumption cuda_graph_gib")
    work = Term("engine workspace", a.engine_workspace_gib, "assumption engine_workspace_gib")
    return [
        *out,
        start,
        Phase("generation", st.index, [trainer, engine_rt, *actor_terms("generation"), w_term, kv_term, graphs, work]),
        Phase("sync", st.index, [trainer, engine_rt, *actor_terms("sync"), w_term, buckets]),
    ]


def step_times(
    config: Any,
    m: ModelShape,
    nodes: int,
    gpus_per_node: int,
    dp: int,
    a: Assumptions,
    recompute: str,
    num_micro: int,
    kv_tokens: int,
    split: tuple[int, int] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds per training step by phase, and the formula of each (see docs/planning.md). kv_tokens: tokens one
    engine's KV cache holds (0: not known, e.g. server mode; no concurrency bound then). split: (engine GPUs, actor
    GPUs) of a disaggregated placement (`async_schedule`); None: the config's own placement (colocated: engines and
    actor share every GPU)."""
    act, ro, tr, alg = config.actor, config.rollout, config.trainer, config.algorithm
    world = nodes * gpus_per_node
    engine_gpus, actor_gpus = split or (world, world)
    colocated = split is None and ro.mode == "colocated"
    n = m.active_params  # FLOPs and decode speed (MoE: the top-k experts a token goes through; dense: every param)
    keep = getattr(alg, "expected_keep_ratio", 0.5) if alg.dynamic_sampling else 1.0
    mean_resp = a.mean_response_frac * ro.max_response_length
    etp = ro.tensor_parallel
    engines = engine_gpus // etp if split or colocated else len(ro.server_urls)
    tps_seq = a.tps_per_seq(n, etp)
    engine_tps = a.tps_per_gpu(n) * etp
    bound = f"{a.tps_per_gpu(n):.0f} tok/s/GPU x TP {etp}"
    if kv_tokens:
        # The KV cache bounds the batch: kv_tokens / (mean prompt + mean response) sequences at tps_seq each.
        concurrent = kv_tokens / (a.mean_prompt_tokens + mean_resp)
        if concurrent * tps_seq < engine_tps:
            engine_tps = concurrent * tps_seq
            bound = f"KV-bound {concurrent:.0f} seqs x {tps_seq:.0f} tok/s"
    rate = engines * engine_tps
    # The stream (rollout/stream.py): one pass over the prompts the step samples, engines kept full by the queue, then
    # the tail: the last decided group's longest response, started as the pass ends, at one sequence's speed. With
    # rollout.partial the step does not wait for it (it is carried), so there is no tail.
    sampled = tr.prompts_per_step / keep
    tail = 0.0 if getattr(ro, "partial", False) else ro.max_response_length / tps_seq
    times = {"generation": sampled * alg.group_size * mean_resp / rate + tail}
    tools = 0.0
    if getattr(getattr(config, "reward", None), "multi_turn", False):
        # Each engine's rank runs its trajectories' tool calls one at a time in its stream loop; its engine waits.
        tools = sampled * alg.group_size * a.tool_calls_per_trajectory * a.tool_seconds_per_call / max(engines, 1)
        times["generation"] += tools
    # For comparison, the sequential rounds the stream replaced: every round waits for its slowest static shard and
    # for its own tail before the next one starts.
    rounds = max(1, math.ceil(sampled / tr.gen_prompts_per_batch))
    round_pass = tr.gen_prompts_per_batch * alg.group_size * mean_resp / rate * (1 + a.shard_imbalance)
    rounds_s = rounds * (round_pass + ro.max_response_length / tps_seq)
    formulas = {
        "generation": f"stream: {sampled:.0f} sampled prompts ({tr.prompts_per_step} / keep {keep:g}) x "
        f"{alg.group_size} x {mean_resp:.0f} decode tokens / ({engines} engines x {engine_tps:.0f} tok/s [{bound}])"
        + (" (rollout.partial: no tail)" if not tail else f" + tail {ro.max_response_length} / {tps_seq:.0f} tok/s")
        + f"; as sequential rounds it was {rounds_s:,.0f} s ({rounds} x (round x (1 + shard_imbalance "
        f"{a.shard_imbalance:g}) + tail))"
    }
    if tools:
        formulas["generation"] += (
            f"; + tools {tools:,.0f} s ({sampled:.0f} x {alg.group_size} trajectories x "
            f"{a.tool_calls_per_trajectory:g} calls x {a.tool_seconds_per_call:g} s / {engines} engines, one call at a "
            "time per engine's rank)"
        )
    # Tokens the actor computes per row: its real length when micro-batches are packed or cut to their longest row
    # after sorting by length (actor/packing.py); a config without actor.packing pads every row to the batch's
    # longest (assumed at the generation cap).
    if hasattr(act, "packing"):
        seq = a.mean_prompt_tokens + mean_resp
    else:
        seq = a.mean_prompt_tokens + ro.max_response_length
    rows = tr.prompts_per_step * alg.group_size
    fwd_per_token = 2 * n + 2 * m.layers * m.q_dim * seq  # 2N + attention (QK^T and AV, causal: ctx S/2 each)
    flops_s = actor_gpus * a.peak_tflops * 1e12 * a.mfu
    bubble = 1 + (act.pipeline_parallel - 1) / num_micro
    passes = 2 if _has_reference(config) else 1  # the frozen reference's forward (loss.kl_coef > 0)
    # MoE all-to-all (alltoall dispatcher): per MoE layer a token's hidden state goes to its k experts and comes back
    # (2 k h b bytes), the share (ep-1)/ep of it to other ranks; the backward moves as much again. Not overlapped.
    ep = getattr(act, "expert_parallel", 1)
    tokens_per_gpu = rows * seq / (actor_gpus / act.tensor_parallel)  # every TP rank of a DP rank holds the tokens
    a2a_link = a.internode_gbps if ep * act.tensor_parallel > gpus_per_node else a.nvlink_gbps
    a2a_fwd = m.moe_layers / act.pipeline_parallel * tokens_per_gpu * 2 * m.topk * m.hidden * a.dtype_bytes
    a2a_fwd = a2a_fwd * (ep - 1) / ep / (a2a_link * 1e9) if m.experts and ep > 1 else 0.0
    times["log-probs"] = passes * (rows * seq * fwd_per_token * bubble / flops_s + a2a_fwd)
    update_mult = 4 if recompute == "full" else 3  # fwd + 2x bwd (+ fwd again under full recompute)
    times["update"] = tr.ppo_epochs * update_mult * (rows * seq * fwd_per_token * bubble / flops_s + a2a_fwd)
    active = "2N" if not m.experts else f"2N_active ({n / 1e9:.2f} B)"
    base = (
        f"{rows} rows x {seq:.0f} tokens x ({active} + 2*L*q_dim*S = {fwd_per_token / 1e9:.1f} GFLOP) x bubble "
        f"{bubble:.3f}"
    )
    formulas["log-probs"] = f"{base} / ({actor_gpus} GPUs x {a.peak_tflops:g} TFLOP/s x MFU {a.mfu})"
    if a2a_fwd:
        formulas["log-probs"] += (
            f" + all-to-all L/pp x {tokens_per_gpu:,.0f} tokens/GPU x 2k*h*b x (ep-1)/ep / {a2a_link:g} GB/s "
            f"= {a2a_fwd:,.1f} s"
        )
    if passes == 2:
        formulas["log-probs"] = f"2 passes (actor, frozen reference) x {formulas['log-probs']}"
    formulas["update"] = f"{tr.ppo_epochs} epoch(s) x {update_mult} x {base} / (same)"
    if a2a_fwd:
        formulas["update"] = (
            f"{tr.ppo_epochs} epoch(s) x {update_mult} x ({base} / (same) + all-to-all {a2a_fwd:,.1f} s)"
        )
    layout = SyncLayout(
        act.tensor_parallel, act.pipeline_parallel, ep, dp, nodes, gpus_per_node,
        "colocated" if colocated else "split" if split else "server", engine_gpus=engine_gpus, engine_tp=etp,
        fp8=getattr(ro, "weight_dtype", "auto") == "fp8", delta=bool(getattr(ro, "weight_sync_delta", False)),
        bucket_mb=ro.weight_sync_bucket_mb,
    )  # fmt: skip
    times["sync"], formulas["sync"], _ = sync_estimate(m, layout, a)
    times["offload"], formulas["offload"] = offload_time(config, m, dp, a)
    if split:
        times["offload"], formulas["offload"] = 0.0, "disaggregated: no engine shares the actor's GPUs, nothing moves"
    times["eval"], formulas["eval"] = eval_time(config, a, rate, tps_seq)
    times["checkpoint"], formulas["checkpoint"] = checkpoint_time(config, m, nodes, a)
    return times, formulas


@dataclass(frozen=True, slots=True)
class SyncLayout:
    """One weight sync to plan: the actor's layout (tp, pp, ep, dp over nodes x gpus_per_node), where its engines
    run and how the weights travel.

    placement: "colocated" (the engines share the actor's GPUs and read buckets through CUDA IPC), "split" (engines
    on GPUs of their own: NVLink within one node, the network between nodes) or "server" (SGLang servers elsewhere).
    transport: "rank0" (the export is gathered over TP and broadcast over PP and EP to the stage's first rank, which
    sends every bucket), "direct" (every actor rank sends its own slices to the engine GPUs that hold them, no
    gather; built for a split launch's embedded engine ranks, rollout.weight_sync_route; into SGLang it would need a
    server that takes shards) or "relay" (what rollout.weight_sync_route "direct" runs into SGLang servers: the
    direct route to one engine rank per server node, which streams the HF tensors it rebuilds to its node's servers
    over NVLink as they complete, or with delta forwards the changed elements to their delta loader over HTTP;
    split placements only).
    delta: rollout.weight_sync_delta's changed elements only (the sender compares the export with its host copy);
    fp8: rollout.weight_dtype fp8.
    """

    tp: int
    pp: int
    ep: int
    dp: int
    nodes: int
    gpus_per_node: int
    placement: str
    engine_gpus: int = 0
    engine_tp: int = 1
    transport: str = "rank0"
    delta: bool = False
    fp8: bool = False
    bucket_mb: int = 1024


def sync_estimate(m: ModelShape, s: SyncLayout, a: Assumptions) -> tuple[float, str, dict[str, float]]:
    """Seconds of one weight sync, its formula and its terms (seconds by name). S is the HF-layout export in the
    engine's dtype; a delta sends S x delta_bytes_fraction (delta_bytes_fraction_fp8 with FP8 weights) after
    comparing all of S with the sender's host copy (at offload_gbps: device to host); direct resharding replaces the
    gather and the one sender by every actor GPU sending its share, bounded by what each engine GPU receives and each
    actor GPU sends."""
    size = engine_weight_bytes(m, 1, a.dtype_bytes, s.fp8)  # what one sync sends (the whole model, HF layout)
    colocated = s.placement == "colocated"
    fraction = a.delta_bytes_fraction_fp8 if s.fp8 else a.delta_bytes_fraction
    sent = size * fraction if s.delta else size
    # Colocated: the engine reads the buckets through CUDA IPC. Otherwise a broadcast to GPUs the actor does not own:
    # NVLink when a disaggregated split stays inside one node, the network between nodes.
    load_gbps = a.ipc_gbps if colocated else a.nvlink_gbps if s.placement == "split" and s.nodes == 1 else (
        a.internode_gbps
    )  # fmt: skip
    terms: dict[str, float] = {}
    dtype = " (FP8)" if s.fp8 else ""
    expert_bytes = size * m.moe_layers * m.layer_expert_params / max(m.num_params, 1)  # the experts' share of S
    # what one actor rank holds, and compares on the direct routes: the dense part over TP x PP, experts over x EP
    own_slices = (size - expert_bytes) / (s.tp * s.pp) + expert_bytes / (s.tp * s.pp * s.ep)
    if s.transport == "direct":
        actor_gpus = s.tp * s.pp * s.dp
        replicas = max(s.engine_gpus // s.engine_tp, 1)
        per_engine_gpu, per_actor_gpu = sent / s.engine_tp, sent * replicas / actor_gpus
        terms["transfer"] = max(per_engine_gpu, per_actor_gpu) / (load_gbps * 1e9)
        buckets = math.ceil(per_engine_gpu / (s.bucket_mb * 2**20))
        formula = (
            f"S {size / 1e9:.1f} GB{dtype}, direct: max(S'/etp {per_engine_gpu / 1e9:.1f} GB per engine GPU, "
            f"S' x {replicas} engines / {actor_gpus} actor GPUs {per_actor_gpu / 1e9:.1f} GB) / {load_gbps:g}"
        )
        compare = own_slices if s.delta else 0.0
    elif s.transport == "relay":
        if colocated:
            raise ValueError('SyncLayout.transport: "relay" is for engines on GPUs of their own (split, server)')
        actor_gpus, relays = s.tp * s.pp * s.dp, max(s.engine_gpus // s.gpus_per_node, 1)
        per_relay, per_actor_gpu = sent, sent * relays / actor_gpus
        transfer = max(per_relay, per_actor_gpu) / (a.internode_gbps * 1e9)
        if s.delta:  # forwarded to the servers' delta loader over HTTP on the node: encoded once, decoded by each
            terms["load"] = 2 * sent / (a.http_gbps * 1e9)
            load = f"HTTP 2 x S'/{a.http_gbps:g}"
        else:  # the rebuilt tensors to the GPU bucket by bucket and broadcast to the node's servers
            terms["host to gpu"] = size / (a.offload_gbps * 1e9)
            terms["load"] = size / (a.nvlink_gbps * 1e9)
            load = f"host to GPU S/{a.offload_gbps:g} + broadcast S/{a.nvlink_gbps:g}"
        buckets = math.ceil(sent / (s.bucket_mb * 2**20))
        # Streamed (placement.RelayReceiver): the transfer overlaps the relay's own serial chain (its load, the
        # servers' per-bucket cost); only what it takes beyond that chain, and its first bucket, add.
        chain = terms.get("host to gpu", 0.0) + terms["load"] + buckets * a.bucket_overhead_s
        terms["transfer"] = max(transfer - chain, 0.0) + transfer / max(buckets, 1)
        formula = (
            f"S {size / 1e9:.1f} GB{dtype}, relay, streamed: max(transfer T = max(S' {per_relay / 1e9:.1f} GB per "
            f"relay rank, S' x {relays} relays / {actor_gpus} actor GPUs {per_actor_gpu / 1e9:.1f} GB) / "
            f"{a.internode_gbps:g}, chain = {load} + buckets) + T / buckets (the first)"
        )
        compare = own_slices if s.delta else 0.0
    else:
        pp_link = a.internode_gbps if s.nodes > 1 and s.tp * s.dp >= s.gpus_per_node else a.nvlink_gbps
        terms["tp gather"] = size * (s.tp - 1) / s.tp / (a.nvlink_gbps * 1e9)
        terms["pp broadcast"] = size * (s.pp - 1) / s.pp / (pp_link * 1e9)
        ep_link = a.internode_gbps if s.ep * s.tp > s.gpus_per_node else a.nvlink_gbps
        if m.experts:
            terms["pp broadcast"] += expert_bytes * (s.ep - 1) / s.ep / (ep_link * 1e9)
        buckets = math.ceil(sent / (s.bucket_mb * 2**20))
        if s.delta and not colocated:  # SGLang servers: the changed elements go by HTTP to their delta loader
            servers = max(s.engine_gpus // s.engine_tp, 1)
            # encoded once, sent to every server from actor rank 0's link, decoded by each server
            terms["load"] = 2 * sent / (a.http_gbps * 1e9) + sent * 4 / 3 * servers / (a.internode_gbps * 1e9)
            load = f"HTTP 2 x S'/{a.http_gbps:g} + S' x 4/3 x {servers} servers/{a.internode_gbps:g}"
        else:
            terms["load"] = sent / (load_gbps * 1e9)
            load = f"load S{chr(39) if s.delta else ''}/{load_gbps:g}"
        formula = (
            f"S {size / 1e9:.1f} GB{dtype}: TP gather S*(tp-1)/tp/{a.nvlink_gbps:g} + PP broadcast S*(pp-1)/pp/"
            f"{pp_link:g}"
            + (f" + EP broadcast S_experts {expert_bytes / 1e9:.1f} GB*(ep-1)/ep/{ep_link:g}" if m.experts else "")
            + f" + {load}"
        )
        compare = size if s.delta else 0.0  # the sending rank compares the whole export
    if s.delta:
        terms["delta compare"] = compare / (a.offload_gbps * 1e9)
        formula += (
            f" + delta compare {compare / 1e9:.1f} GB/{a.offload_gbps:g} (S' = S x {fraction:g} = "
            f"{sent / 1e9:.1f} GB sent)"
        )
    terms["buckets"] = buckets * a.bucket_overhead_s
    formula += f" + {buckets} buckets x {a.bucket_overhead_s} s"
    if colocated:
        terms["engine release/resume"] = a.engine_memory_s
        formula += f" + engine release/resume {a.engine_memory_s:g} s"
    return sum(terms.values()), formula, terms


SYNC_TARGETS: list[tuple[str, str, SyncLayout, float, str]] = [
    # (case, KNOWN_MODELS key, layout (transport and delta varied), target s, the peers' published number)
    ("Qwen2.5-32B colocated, 16 x 8 H100 (actor TP 8 x PP 2 x DP 8, SGLang TP 4)", "qwen2.5-32b",
     SyncLayout(8, 2, 1, 8, 16, 8, "colocated", engine_gpus=128, engine_tp=4, bucket_mb=2048), 2.0,
     "verl delta sync, trainer and rollout on separate nodes: 6.2 s (full 14.2 s)"),
    ("Qwen3-30B-A3B split, 2 x 8 H100 (actor node TP 1 x EP 8 x DP 8; engine node 2 x SGLang TP 4)", "qwen3-30b-a3b",
     SyncLayout(1, 1, 8, 8, 2, 8, "split", engine_gpus=8, engine_tp=4, bucket_mb=1024), 1.5,
     "NeMo-RL direct reshard on H100: 0.74-1.0 s"),
    ("Qwen3-235B-A22B split, 12 x 8 H100 (actor 8 nodes TP 4 x PP 8 x DP 2, EP 8; 4 FP8 SGLang engines at TP 8)",
     "qwen3-235b-a22b", SyncLayout(4, 8, 8, 2, 12, 8, "split", engine_gpus=32, engine_tp=8, fp8=True, bucket_mb=1024),
     5.0, "Miles point-to-point RDMA: 3.16 s (10.75 s over NCCL)"),
]  # fmt: skip
"""Issue 39 item 5: the weight-sync targets at scale, planned with sync_estimate (format_sync_targets)."""


def format_sync_targets(a: Assumptions | None = None) -> str:
    """docs/planning.md's "Weight sync at scale" table: every SYNC_TARGETS case with each transport (rank0 and, on
    split placements, relay: what runs into SGLang; direct: modelled there) full and delta, its seconds against the
    target and its largest terms."""
    from dataclasses import replace

    a = a or Assumptions()
    lines = ["| case | transport | delta | sync s | target s | largest terms (s) |", "|---|---|---|---|---|---|"]
    for case, key, layout, target, _ in SYNC_TARGETS:
        for transport in ("rank0", "direct") + (() if layout.placement == "colocated" else ("relay",)):
            for delta in (False, True):
                total, _, terms = sync_estimate(KNOWN_MODELS[key], replace(layout, transport=transport, delta=delta), a)
                top = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
                parts = ", ".join(f"{name} {value:.2f}" for name, value in top if value > 0)
                mark = "meets" if total <= target else "misses"
                lines.append(f"| {case} | {transport} | {'yes' if delta else 'no'} | {total:.2f} | {target:g} "
                             f"({mark}) | {parts} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def colocated_step_seconds(times: dict[str, float]) -> float:
    """The synchronous colocated step: every phase one after another."""
    return sum(times.values())


def async_step_seconds(times: dict[str, float]) -> float:
    """The asynchronous step (trainer.max_staleness >= 1, engines and actor on disjoint GPUs): the engines generate the
    next step's groups while the actor computes log-probs and updates on this step's, so the slower of the two sets
    the pace; the weight sync, the evaluation and the checkpoint share still stop both."""
    train = times["log-probs"] + times["update"]
    return max(times["generation"], train) + times["sync"] + times["eval"] + times["checkpoint"]


@dataclass(slots=True)
class AsyncSchedule:
    """`async_schedule`'s answer: the fastest disaggregated split of the GPUs and its step times."""

    engine_gpus: int
    actor_gpus: int
    times_s: dict[str, float]
    formulas: dict[str, str]
    step_s: float
    candidates: list[tuple[int, float]]
    """(engine GPUs, step seconds) of every split that can run, fastest first."""


def async_schedule(
    config: Any, m: ModelShape, nodes: int, gpus_per_node: int, gpu_memory_gb: float, a: Assumptions
) -> AsyncSchedule | None:
    """The config's step on a disaggregated placement (issue 24): E GPUs run engines (rollout.tensor_parallel each),
    the other world - E the actor (its TP x EP x PP dividing them), for every such E; the fastest by
    `async_step_seconds`. An engine on its own GPUs holds dedicated_mem_fraction of their memory for weights and KV
    cache. None when no split can run (the world is one actor replica, or no engine fits). Server mode: the engines
    run apart already, so the schedule keeps them (engine_gpus 0: not the planner's) with the synchronous phases."""
    act, ro = config.actor, config.rollout
    world = nodes * gpus_per_node
    if ro.mode != "colocated":
        recompute = recompute_mode(act)
        dp = world // (act.tensor_parallel * act.pipeline_parallel)
        mean_seq = a.mean_prompt_tokens + a.mean_response_frac * ro.max_response_length
        num_micro = microbatches_per_rank(config, dp, mean_seq)
        times, formulas = step_times(config, m, nodes, gpus_per_node, dp, a, recompute, num_micro, 0)
        return AsyncSchedule(0, world, times, formulas, async_step_seconds(times), [])
    tp, pp, ep, etp = act.tensor_parallel, act.pipeline_parallel, getattr(act, "expert_parallel", 1), ro.tensor_parallel
    fp8 = getattr(ro, "weight_dtype", "auto") == "fp8"
    kv = a.dedicated_mem_fraction * (gpu_memory_gb - a.engine_overhead_gib) * GiB
    kv -= engine_weight_bytes(m, etp, a.dtype_bytes, fp8)
    kv_tokens = int(max(kv, 0.0) // kv_bytes_per_token(m, etp, a.dtype_bytes))  # per engine (every GPU holds 1/etp)
    if kv_tokens < config.data.max_prompt_length + ro.max_response_length:
        return None
    mean_seq = a.mean_prompt_tokens + a.mean_response_frac * ro.max_response_length
    recompute = recompute_mode(act)
    splits = _engine_splits(world, etp, tp * pp * ep)
    best, candidates, tried = None, [], set()

    def consider(engine_gpus: int) -> None:
        nonlocal best
        if engine_gpus in tried:
            return
        tried.add(engine_gpus)
        actor_gpus = world - engine_gpus
        dp = actor_gpus // (tp * pp)
        num_micro = microbatches_per_rank(config, dp, mean_seq)
        split = (engine_gpus, actor_gpus)
        times, formulas = step_times(config, m, nodes, gpus_per_node, dp, a, recompute, num_micro, kv_tokens, split)
        step = async_step_seconds(times)
        candidates.append((engine_gpus, step))
        if best is None or step < best.step_s:
            best = AsyncSchedule(engine_gpus, actor_gpus, times, formulas, step, candidates)

    # Every split up to MAX_SPLITS of them; past that (a world of thousands of GPUs) an even sample of MAX_SPLITS,
    # then samples ever closer around the best so far between its sampled neighbours, down to every split there:
    # the step time falls, then rises, with the split.
    lo, hi, per_pass = 0, len(splits) - 1, MAX_SPLITS
    while hi >= lo:
        stride = max(1, -(-(hi - lo + 1) // per_pass))
        for i in range(lo, hi + 1, stride):
            consider(splits[i])
        if stride == 1 or best is None:
            break
        at = splits.index(best.engine_gpus)
        lo, hi, per_pass = max(lo, at - stride), min(hi, at + stride), 64
    if best is not None:
        candidates.sort(key=lambda c: c[1])
    return best


MAX_SPLITS = 1024
"""async_schedule evaluates every engine / actor split of a world up to this many; beyond, a sample and a refinement
(bounded time for any world: the planner answers in under a second)."""


def _engine_splits(world: int, engine_tp: int, actor_unit: int) -> range:
    """The engine GPU counts E of a disaggregated placement, increasing: E a multiple of engine_tp, 0 < E < world,
    world - E a multiple of actor_unit (the actor's TP x EP x PP). An arithmetic progression (step lcm of the two)."""
    first = next((e for e in range(engine_tp, min(world, engine_tp * actor_unit + 1), engine_tp)
                  if (world - e) % actor_unit == 0), None)  # fmt: skip
    if first is None:
        return range(0)
    return range(first, world, math.lcm(engine_tp, actor_unit))


def offload_time(config: Any, m: ModelShape, dp: int, a: Assumptions) -> tuple[float, str]:
    """Seconds per step moving actor state to pinned host memory and back (actor.offload), per GPU in parallel."""
    offload = getattr(config.actor, "offload", "none") or "none"
    after_update, after_sync = parts_offloaded(offload)
    parts = (*after_update, *after_sync)
    if not parts:
        return 0.0, "actor.offload none: nothing moves"
    act = config.actor
    ep = getattr(act, "expert_parallel", 1)
    stage = max(actor_stages(m, act.tensor_parallel, act.pipeline_parallel, ep), key=lambda s: s.params)
    per = dict(zip(PARTS, actor_state_bytes_per_param(act.dtype, dp, act.use_distributed_optimizer), strict=True))
    expert_opt = actor_state_bytes_per_param(act.dtype, dp // ep, act.use_distributed_optimizer)[2]
    moved = stage.params * sum(per[p] for p in parts)
    if "optimizer" in parts:  # the experts' optimizer state is sharded over the expert data-parallel group only
        moved += stage.expert_params * (expert_opt - per["optimizer"])
    return 2 * moved / (a.offload_gbps * 1e9), (
        f"2 (out and back) x {moved / 1e9:.1f} GB ({', '.join(parts)} of the largest stage) / {a.offload_gbps:g} GB/s"
    )


def eval_time(config: Any, a: Assumptions, rate: float, tps_seq: float) -> tuple[float, str]:
    """Evaluation's share of a step: one pass over the eval prompts x eval_samples, every eval_every steps."""
    tr, ro = config.trainer, config.rollout
    if not tr.eval_every or not config.data.eval_files:
        return 0.0, "no evaluation during training"
    prompts = tr.eval_max_prompts or a.eval_prompts
    decode = prompts * tr.eval_samples * a.mean_response_frac * ro.max_response_length
    once = decode / rate + ro.max_response_length / tps_seq
    return once / tr.eval_every, (
        f"({prompts} prompts x {tr.eval_samples} samples x {a.mean_response_frac * ro.max_response_length:.0f} tokens "
        f"/ {rate:.0f} tok/s + tail {ro.max_response_length} / {tps_seq:.0f}) / eval_every {tr.eval_every}"
    )


def checkpoint_time(config: Any, m: ModelShape, nodes: int, a: Assumptions) -> tuple[float, str]:
    """A checkpoint's share of a step: bf16 params + fp32 master + Adam moments (14 B/param; gradients are not
    saved), written by every node in parallel, every save_every steps."""
    every = config.checkpoint.save_every
    if not every:
        return 0.0, "checkpoint.save_every 0: only at the end"
    size = 14 * m.num_params
    once = size / (nodes * a.checkpoint_gbps_per_node * 1e9)
    return once / every, (
        f"{size / 1e9:.0f} GB (14 B/param) / ({nodes} nodes x {a.checkpoint_gbps_per_node:g} GB/s) / save_every {every}"
    )


def preemption_lead(
    config: Any, m: ModelShape, nodes: int, a: Assumptions, times: dict[str, float]
) -> tuple[float, str]:
    """How long before the time limit the signal must come so that the save completes. A signal before the step's
    first optimizer step drops the step (in generation at once, in the log-probs pass at its end) and saves the last
    one; a signal in the update lets the step run to its end (update + sync + offload, then the step boundary's
    evaluation when that step evaluates). The worst case is the larger of the two, then one whole checkpoint and a
    margin (assumption preempt_margin_s). The sbatch files send USR1 this long before the job's end
    (examples/slurm/job.sh)."""
    every = config.trainer.eval_every
    eval_once = times.get("eval", 0.0) * every if every else 0.0
    save_once = 14 * m.num_params / (nodes * a.checkpoint_gbps_per_node * 1e9)
    logprobs = times.get("log-probs", 0.0)
    finish = sum(times.get(k, 0.0) for k in ("update", "sync", "offload")) + eval_once
    total = max(logprobs, finish) + save_once + a.preempt_margin_s
    return total, (
        f"max(log-probs {logprobs:,.0f} s, update + sync + offload + one evaluation {finish:,.0f} s) + one save "
        f"{save_once:,.0f} s + margin {a.preempt_margin_s:g} s"
    )


def format_plan(plan: Plan) -> str:
    """The human-readable report: layout, per-phase peak (worst stage) with every term, step time, assumptions."""
    lines = [f"model: {plan.layout['model']}", f"  shape from {plan.model_source}"]
    lines += [f"{k}: {v}" for k, v in plan.layout.items() if k != "model"]
    lines.append(f"usable per GPU: {plan.usable_gib:.2f} GiB (gpu memory - safety {plan.assumptions.safety_gib:g})")
    lines.append("")
    lines.append("per-GPU peak memory by phase (GiB; the worst pipeline stage of each phase):")
    for name in dict.fromkeys(p.name for p in plan.phases):
        ph = plan.peak(name)
        verdict = "fits" if ph.total_gib <= plan.usable_gib and not ph.error else "DOES NOT FIT"
        lines.append(
            f"  {name:<13} stage {ph.stage}: {ph.total_gib:7.2f}  {verdict}{'  ' + ph.error if ph.error else ''}"
        )
        for t in ph.terms:
            lines.append(f"      {t.gib:7.2f}  {t.name:<30} {t.formula}")
    lines.append("")
    total = colocated_step_seconds(plan.times_s)
    lines.append(f"step time model: {total:,.0f} s per step (synchronous, every phase in turn)")
    for name, secs in plan.times_s.items():
        lines.append(f"  {name:<11} {secs:9.1f} s   {plan.time_formulas[name]}")
    lines += format_async(plan.async_plan, total)
    lines.append(f"preemption lead time: {plan.preempt_lead_s:,.0f} s ({plan.preempt_lead_formula})")
    lines.append("")
    lines.append("assumptions (override with --assume NAME=VALUE):")
    for f in fields(plan.assumptions):
        value = getattr(plan.assumptions, f.name)
        derived = "  (0: derived from the model size; the value used is in the generation line)"
        lines.append(f"  {f.name} = {value}{derived if f.name.startswith('decode_tps') and not value else ''}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    failing = plan.failing
    if failing:
        names = ", ".join(f"{p.name} (stage {p.stage}: {p.total_gib:.2f} GiB)" for p in failing)
        lines.append(f"DOES NOT FIT: {names} > {plan.usable_gib:.2f} GiB usable")
    else:
        lines.append("fits: every phase is within the usable memory")
    for line in plan.over_timeouts:
        lines.append(f"OUTLASTS ITS TIMEOUT: {line}")
    return "\n".join(lines)


ASYNC_RUNS = "runs as rollout.engine_ranks: embedded engines, or SGLang servers updated while they generate"
"""What of the async schedule runs today (the report's last async line)."""


def format_async(sched: AsyncSchedule | None, sync_step_s: float) -> list[str]:
    """The async schedule's lines of the report (time only). It runs as a split launch (rollout.engine_ranks) with the
    embedded engines or over SGLang servers (docs/rollout.md, "Asynchronous training")."""
    if sched is None:
        return ["async schedule: no disaggregated split can run (one actor replica fills the GPUs, or no engine fits)"]
    t = sched.times_s
    train = t["log-probs"] + t["update"]
    where = (
        f"on {sched.engine_gpus} engine GPUs + {sched.actor_gpus} actor GPUs"
        if sched.engine_gpus
        else f"on the same servers + {sched.actor_gpus} actor GPUs"
    )
    lines = [
        f"async schedule (split launch, trainer.max_staleness >= 1): {sched.step_s:,.0f} s per step, "
        f"x{sync_step_s / sched.step_s:.2f} the synchronous step, {where}",
        f"  step = max(generation {t['generation']:,.1f} s, log-probs + update {train:,.1f} s) + sync "
        f"{t['sync']:,.1f} s + eval {t['eval']:,.1f} s + checkpoint {t['checkpoint']:,.1f} s",
    ]
    for name in ("generation", "log-probs", "update", "sync"):
        lines.append(f"  {name:<11} {t[name]:9.1f} s   {sched.formulas[name]}")
    others = ", ".join(f"{e} engine GPUs {s:,.0f} s" for e, s in sched.candidates[1:4])
    if others:
        lines.append(f"  other splits: {others}")
    lines.append("  memory of the split is not planned here: the actor's GPUs hold no engine, the engines' no actor")
    lines.append(f"  {ASYNC_RUNS}")
    return lines


def parse_assumptions(items: list[str]) -> Assumptions:
    """Assumptions with `NAME=VALUE` overrides (e.g. ["mfu=0.4", "cuda_graph_gib=3"]); PlanError names a bad one."""
    a = Assumptions()
    known = {f.name: f for f in fields(Assumptions)}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in known:
            raise PlanError(f"--assume {item!r}: expected NAME=VALUE with NAME one of {sorted(known)}")
        kind = int if isinstance(getattr(a, name), int) else float
        try:
            value = kind(text)
        except ValueError:
            raise PlanError(f"--assume {name}: expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (name in ("mfu", "mean_response_frac") and not 0 < value <= 1):
            raise PlanError(f"--assume {name}: {value} is out of range")
        setattr(a, name, value)
    return a
