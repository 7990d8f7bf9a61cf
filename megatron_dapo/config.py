"""Run configuration: one dataclass per component, one flat YAML file per run, `--section.field=value` overrides.

    examples/run.yaml --load_config--> RunConfig(algorithm=..., reward=..., rollout=..., actor=..., data=...,
                                                 trainer=..., checkpoint=..., logging=...)
    --actor.lr=2e-6   --apply_overrides-->  same, with types converted and every rule re-checked

Each section checks only its own fields in __post_init__; rules that tie sections together live in
RunConfig.__post_init__; the allowed range of every number field is one table, FIELD_RANGES. Every error is one line
naming the section and field. The file is read as UTF-8 by yaml.SafeLoader (no python/* tags) with one change: a
section or key written twice is an error naming both lines. Defaults are the paper's (DAPO, arXiv 2503.14476,
Qwen2.5-32B run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode
from yaml.nodes import Node
from yaml.nodes import ScalarNode

from megatron_dapo.net import is_loopback
from megatron_dapo.net import url_host
from megatron_dapo.rollout.engines import ENGINES
from megatron_dapo.rollout.engines import MODES
from megatron_dapo.rollout.engines import with_capability


class ConfigError(ValueError):
    """A configuration problem; the message names the file (if any), section and field."""


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {msg}")


@dataclass(frozen=True, slots=True)
class Range:
    """The values a number field may take: lo to hi, each end closed ("[", "]") or open ("(", ")")."""

    lo: int | float
    """Lowest allowed value (excluded when ends[0] is "(")."""
    hi: int | float
    """Highest allowed value (excluded when ends[1] is ")")."""
    ends: str = "[]"
    """Brackets of the two ends, as written in the error message: "[]", "(]", "[)" or "()"."""
    note: str = ""
    """What a special value means (e.g. "0: off"), shown in the error message."""

    def __contains__(self, value: int | float) -> bool:
        above = value > self.lo if self.ends[0] == "(" else value >= self.lo
        below = value < self.hi if self.ends[1] == ")" else value <= self.hi
        return above and below

    def __str__(self) -> str:
        return f"{self.ends[0]}{self.lo}, {self.hi}{self.ends[1]}" + (f" ({self.note})" if self.note else "")


_MAX_TOKENS = 2**20
"""Longest sequence a length field may name (1M tokens; the paper's responses are 20k)."""
_MAX_COUNT = 2**20
"""Largest batch size / request count."""
_MAX_STEPS = 10_000_000
"""Largest step count or interval."""
_MAX_PARALLEL = 1024
"""Largest tensor- or pipeline-parallel size."""
_MAX_SAMPLES = 4096
"""Most responses per prompt (group_size, eval_samples)."""
_SEED_END = 2**31
"""Seeds are below 2**31: numpy (SGLang, vLLM) takes seeds < 2**32, and derived seeds add offsets (seed + rank,
megatron's seed + 2718 + tp_rank, seed + 1024 + 100 * ep_rank), which keeps them below 2**32."""
_WEEK_MINUTES = 7 * 24 * 60
"""Longest timeout in minutes (one week; Python's thread and socket timeouts overflow far above it)."""

FIELD_RANGES: dict[str, Range] = {
    "algorithm.group_size": Range(2, _MAX_SAMPLES),
    "algorithm.adv_eps": Range(0, 1, "(]"),
    "algorithm.max_gen_batches": Range(0, 10_000, note="0: no cap, with max_gen_minutes > 0"),
    "algorithm.max_gen_minutes": Range(0, 10_080, note="0: none"),
    "algorithm.expected_keep_ratio": Range(0, 1, "(]"),
    "algorithm.overlong_buffer": Range(0, _MAX_TOKENS, "(]"),
    "algorithm.overlong_penalty_factor": Range(0, 100),
    "algorithm.rollout_is_threshold": Range(0, 1000, "(]"),
    "algorithm.rollout_mis_low": Range(0, 1, "(]"),
    "algorithm.rollout_mis_high": Range(1, 1000),
    "reward.verify_timeout_s": Range(0, 3600, "(]"),
    "logging.trajectory_samples": Range(0, _MAX_COUNT),
    "reward.max_turns": Range(1, 1024),
    "reward.max_tool_calls": Range(1, 1024),
    "reward.tool_timeout_s": Range(0, 3600, "(]"),
    "reward.tool_memory_mb": Range(16, 1 << 20),
    "rollout.tensor_parallel": Range(1, _MAX_PARALLEL),
    "rollout.max_response_length": Range(1, _MAX_TOKENS),
    # 0 (greedy) is not supported: the actor divides its logits by the temperature.
    "rollout.temperature": Range(0.001, 10),
    "rollout.top_p": Range(0, 1, "(]"),
    "rollout.top_k": Range(0, _MAX_TOKENS, note="0: off"),
    "rollout.mem_fraction": Range(0, 1, "()"),
    "rollout.weight_sync_bucket_mb": Range(1, 65536),
    "rollout.weight_sync_full_every": Range(0, _MAX_STEPS, note="0: only when needed"),
    "rollout.generation_timeout_minutes": Range(0, _WEEK_MINUTES, "(]"),
    "rollout.weight_sync_master_port": Range(1, 65535),
    "rollout.max_running_requests": Range(0, _MAX_COUNT, note="0: the engine's default"),
    "rollout.max_inflight_prompts": Range(0, _MAX_COUNT, note="0: trainer.gen_prompts_per_batch"),
    "rollout.over_sampling": Range(0, 100, note="0: off"),
    "rollout.engine_restarts": Range(0, _MAX_COUNT, note="0: an engine that dies ends the job"),
    "rollout.prompt_retries": Range(0, 100),
    "rollout.engine_stall_minutes": Range(0, _WEEK_MINUTES, note="0: off"),
    "rollout.engine_ranks": Range(0, _MAX_PARALLEL, note="0: colocated"),
    "actor.tensor_parallel": Range(1, _MAX_PARALLEL),
    "actor.pipeline_parallel": Range(1, _MAX_PARALLEL),
    "actor.expert_parallel": Range(1, _MAX_PARALLEL),
    "actor.moe_aux_loss_coeff": Range(0, 1_000, note="0: off"),
    # Adam moves each weight by about lr per step: lr > 1 destroys any model in one step.
    "actor.lr": Range(0, 1, "(]"),
    "actor.lr_warmup_steps": Range(0, _MAX_STEPS),
    "actor.weight_decay": Range(0, 1),
    "actor.adam_beta1": Range(0, 1, "[)"),
    "actor.adam_beta2": Range(0, 1, "[)"),
    "actor.grad_clip": Range(0, 1_000_000, note="0: off"),
    "actor.max_tokens_per_microbatch": Range(0, 16 * _MAX_TOKENS, note="0: trainer.micro_batch_size rows"),
    "data.seed": Range(0, _SEED_END, "[)"),
    "data.max_prompt_length": Range(1, _MAX_TOKENS),
    "trainer.total_steps": Range(1, _MAX_STEPS),
    "trainer.seed": Range(0, _SEED_END, "[)"),
    "trainer.prompts_per_step": Range(1, _MAX_COUNT),
    "trainer.gen_prompts_per_batch": Range(1, _MAX_COUNT),
    "trainer.mini_batch_prompts": Range(1, _MAX_COUNT),
    "trainer.micro_batch_size": Range(1, _MAX_COUNT),
    "trainer.ppo_epochs": Range(1, 100),
    "trainer.max_staleness": Range(-1, _MAX_STEPS, note="-1: no bound"),
    "trainer.eval_every": Range(0, _MAX_STEPS, note="0: never"),
    "trainer.eval_samples": Range(1, _MAX_SAMPLES),
    "trainer.eval_temperature": Range(0.001, 10),
    "trainer.eval_top_p": Range(0, 1, "(]"),
    "trainer.eval_max_prompts": Range(0, _SEED_END, "[)", "0: all"),
    "trainer.eval_timeout_minutes": Range(0, _WEEK_MINUTES, "(]"),
    "trainer.max_skipped_steps": Range(0, _MAX_STEPS, note="0: never stop"),
    "checkpoint.save_every": Range(0, _MAX_STEPS, note="0: only at the end"),
    "checkpoint.keep_last": Range(1, 10_000),
    "checkpoint.preempt_grace_s": Range(0, 24 * 3600, "(]"),
    "distributed.timeout_minutes": Range(0, _WEEK_MINUTES, "(]"),
    "distributed.max_restarts": Range(0, 1_000),
}
"""Allowed range of every int and float field, by "section.field" (a test checks that none is missing)."""


def _check_numbers(section: Any, name: str) -> None:
    """Every float field of a section is finite (.inf / .nan are accepted by YAML and float()), and every number
    field lies in its FIELD_RANGES entry; None (an optional field left off) is not checked."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        where = f"{name}.{f.name}"
        if isinstance(value, float):
            _check(math.isfinite(value), where, f"must be a finite number, got {value}")
        allowed = FIELD_RANGES.get(where)
        if allowed is None:
            raise KeyError(f"{where} is a number field with no entry in config.FIELD_RANGES")
        _check(value in allowed, where, f"must be in {allowed}, got {value}")


def _expand(path: str) -> str:
    """~ and $VARS in path fields (model and data locations differ per machine)."""
    return os.path.expanduser(os.path.expandvars(path)) if isinstance(path, str) else path


def _one_of(value: str, choices: tuple[str, ...], where: str) -> None:
    _check(value in choices, where, f"must be one of {list(choices)}, got {value!r}")


_CHOICES: dict[str, dict[str, Any]] = {}
"""The names a choice field accepts, "section.field" -> {name: payload}, registered by the component that owns them
(the losses, the log-prob implementations, the rollout corrections, the offload modes) when its module is imported;
this module imports no component. megatron_dapo/__init__.py imports the registering modules, so the names are
there whenever megatron_dapo.config is."""


def register_choices(where: str, *names: str, payload: Any = None) -> None:
    """Register `names` as values of the choice field `where` ("section.field"); `payload` travels with each (the
    policy losses register the factory of their config)."""
    table = _CHOICES.setdefault(where, {})
    for name in names:
        if name in table:
            raise ValueError(f"{where}: {name!r} is already registered")
        table[name] = payload


def choices(where: str) -> dict[str, Any]:
    """{name: payload} registered for the choice field `where` (KeyError for a field nobody registered)."""
    if where not in _CHOICES:
        raise KeyError(f"{where}: no component registered its choices (is megatron_dapo imported as a package?)")
    return _CHOICES[where]


def _one_of_registered(value: str, where: str) -> None:
    _one_of(value, tuple(sorted(choices(where))), where)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """DAPO's loss, advantage, sampling and reward-shaping switches (paper section 3)."""

    policy_loss: str = "dapo"
    """Registered policy loss (megatron_dapo/algorithms/losses/: dapo, grpo, dr_grpo, gspo, cispo); its own fields
    (clip ranges, aggregation) are the `loss` section."""
    group_size: int = 16
    """Responses sampled per prompt (G)."""
    adv_eps: float = 1e-6
    """Epsilon in A = (R - mean) / (std + eps)."""
    dynamic_sampling: bool = True
    """Keep only groups with 0 < accuracy < 1 and keep sampling until the batch is full."""
    max_gen_batches: int = 10
    """Cap on the prompts one step may sample, in units of trainer.gen_prompts_per_batch (the bound the DAPO recipe's
    generation rounds had): the stream hands out at most max_gen_batches x gen_prompts_per_batch queue positions per
    step. 0 = no cap in prompts, allowed only with a bound in time (max_gen_minutes): a dataset on which every group is
    all-correct or all-wrong would otherwise sample forever."""
    expected_keep_ratio: float = 0.5
    """Planning only (megatron-dapo plan): the share of prompt groups dynamic sampling is expected to keep, so a step
    samples prompts_per_step / expected_keep_ratio prompts. 0.5: the middle of the 0.33-0.6 keep ratios of the
    paper-scale run (verl's DAPO recipe over-samples 3x); the run's own sampling/prompts_per_useful is 1 / it."""
    max_gen_minutes: float = 0.0
    """Bound on one step's sampling time (0 = none): past it no new prompt is started, the prompts already started
    are decided, and the step ends as at the max_gen_batches cap (on_max_gen_batches). Which prompts are kept then
    depends on timing, so the prompt cap is the reproducible bound; this one bounds a step whatever the data."""
    on_max_gen_batches: str = "error"
    """What happens at that cap before prompts_per_step groups are kept: "error" (stop with the counts) or "partial"
    (train on what was kept)."""
    overlong_filtering: bool = False
    """Mask truncated responses (finish reason "length") out of the loss."""
    overlong_penalty: bool = True
    """Soft overlong punishment: linear penalty from 0 at max_response_length - overlong_buffer to -1 at the cap."""
    overlong_buffer: int = 4096
    """Length of the penalty ramp (L_cache), in tokens."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the cap (the paper's ramp ends at -1)."""
    rollout_correction: str = "none"
    """Train/inference mismatch correction from the engine's log-probs (docs/rollout_correction.md): "none", "tis"
    (truncated importance weights min(pi_old / pi_engine, rollout_is_threshold) on each token's loss) or "mis" (masked
    importance sampling: tokens / responses whose ratio leaves [rollout_mis_low, rollout_mis_high] leave the loss and
    its denominator, the others are weighted by the ratio). Needs rollout.compare_logprobs."""
    rollout_correction_level: str = "token"
    """Ratio the correction uses: "token" (per token) or "sequence" (product over the response's tokens, the same
    weight / decision for the whole response)."""
    rollout_is_threshold: float = 2.0
    """TIS truncation C > 0 of the importance weight."""
    rollout_mis_low: float = 0.5
    """MIS: lowest ratio kept, in (0, 1]."""
    rollout_mis_high: float = 2.0
    """MIS: highest ratio kept, >= 1."""
    old_logp_source: str = "actor"
    """pi_old of the clipped ratio (docs/rollout_correction.md, "Where pi_old comes from"): "actor" (the batch's
    log-probs recomputed by the actor before the update, the proximal policy; rollout correction weighs them against
    the engine's) or "engine" (the engine's sampling log-probs: no old-log-prob pass, one actor forward fewer per
    step, but the engine/actor mismatch (FP8 weights, kernels, MoE routing) then sits inside the clipped ratio and
    rollout correction has nothing left to correct). "engine" needs rollout.compare_logprobs."""

    def __post_init__(self) -> None:
        _check_numbers(self, "algorithm")
        _one_of_registered(self.policy_loss, "algorithm.policy_loss")
        _one_of(self.on_max_gen_batches, ("error", "partial"), "algorithm.on_max_gen_batches")
        _one_of(self.old_logp_source, ("actor", "engine"), "algorithm.old_logp_source")
        _check(
            self.old_logp_source == "actor" or self.rollout_correction == "none",
            "algorithm.old_logp_source",
            f"'engine' makes the engine's log-probs pi_old, so rollout_correction {self.rollout_correction!r} would "
            "weigh them against themselves (always 1): set algorithm.rollout_correction=none",
        )
        _check(
            self.max_gen_batches > 0 or self.max_gen_minutes > 0 or not self.dynamic_sampling,
            "algorithm.max_gen_batches",
            "0 (no cap) needs a bound in time, algorithm.max_gen_minutes > 0: dynamic sampling on a dataset where "
            "every group is all-correct or all-wrong would sample forever",
        )
        _one_of_registered(self.rollout_correction, "algorithm.rollout_correction")
        _one_of_registered(self.rollout_correction_level, "algorithm.rollout_correction_level")


MOVED_TO_LOSS = ("eps_low", "eps_high", "clip_higher", "clip_ratio_c", "loss_agg_mode")
"""Fields that were in [algorithm] before the policy losses owned their config: a config naming one there is
refused with one line saying where it lives now."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """The rule-based verifier (megatron_dapo.reward)."""

    answer_format: str = "answer_line"
    """"answer_line" (DAPO: the last "Answer:" line), "boxed" (last \\boxed{}) or "last_number"."""
    verify_timeout_s: float = 5.0
    """Time limit of one symbolic (math-verify) comparison, on any thread; past it the answer scores as wrong."""
    environment: str = "single_turn"
    """What a response is (megatron_dapo/envs/, docs/environments.md): "single_turn" (one model turn, verified) or
    "python_tool" (multi-turn: the model's Python tool calls run in a sandbox between its turns; the trajectory,
    model and observation tokens, is capped by rollout.max_response_length; with rollout.partial an unfinished one is
    carried mid-turn with its episode's state), or a name registered with envs.base.register_environment."""
    max_turns: int = 4
    """Multi-turn: model turns in one trajectory; the last one is verified as it stands."""
    max_tool_calls: int = 4
    """Multi-turn: tool calls in one trajectory; further calls are answered with an error observation."""
    tool_timeout_s: float = 10.0
    """Multi-turn: wall-clock seconds of one tool call (the sandbox's CPU limit is the same, rounded up)."""
    tool_memory_mb: int = 512
    """Multi-turn: address space of one tool call, in MiB."""
    sandbox_url: str = ""
    """Multi-turn: a sandbox service's run_code URL (SandboxFusion's request shape, envs/sandbox.RemoteSandbox); ""
    runs tool calls locally (envs/sandbox.LocalSandbox)."""

    def __post_init__(self) -> None:
        _check_numbers(self, "reward")
        _one_of(self.answer_format, ("answer_line", "boxed", "last_number"), "reward.answer_format")
        _one_of_registered(self.environment, "reward.environment")

    @property
    def multi_turn(self) -> bool:
        """The environment is driven turn by turn (its registration says so)."""
        return bool(choices("reward.environment")[self.environment])


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """The generation engine and sampling parameters."""

    engine: str = "sglang"
    """"transformers" (embedded; CPU and small GPU runs), "sglang" or "vllm"."""
    mode: str = "colocated"
    """"colocated" (engine in the training processes, memory released during training) or "server" (HTTP)."""
    server_urls: list[str] = field(default_factory=list)
    """SGLang server base URLs for mode "server", e.g. ["http://node7:30000"]."""
    tensor_parallel: int = 1
    """Tensor-parallel size of each rollout engine (independent of the actor's)."""
    max_response_length: int = 20480
    """Generation cap in tokens (L_max); responses cut there finish with reason "length"."""
    temperature: float = 1.0
    """Sampling temperature; also applied to the actor's log-probs."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Top-k sampling (0 disables it)."""
    mem_fraction: float = 0.7
    """Share of GPU memory the engine may take (SGLang mem_fraction_static / vLLM gpu_memory_utilization)."""
    weight_sync_bucket_mb: int = 512
    """Size bound of one weight-sync bucket, in MiB."""
    weight_sync_delta: bool = False
    """Changed-weights sync: each step sends only the weight elements whose value (in the dtype sent) changed since
    the engine's last update, a tensor in full where that is no smaller (rollout/delta.py; exact). The trainer keeps
    a host copy of the sent weights (on a split launch each actor rank keeps its own share and each engine rank of
    embedded engines a copy of the last push). Transformers engine, colocated or on a split launch's engine ranks
    (weight_dtype "fp8" there only); SGLang servers apply the changes themselves, sent by actor rank 0 or
    (weight_sync_route "direct" on a split launch, not with weight_dtype "fp8") forwarded by the engine ranks, which
    keep no copy (each server started with --custom-weight-loader megatron_dapo.rollout.sglang_loader.load_weights,
    megatron_dapo importable there: rollout/sglang_loader.py)."""
    weight_sync_full_every: int = 0
    """With weight_sync_delta, every N-th sync sends every tensor in full (0: only the first one and those after an
    engine restart or a failed sync)."""
    weight_sync_route: str = "auto"
    """How a split launch's (rollout.engine_ranks > 0) weights reach its engines: "direct" (every actor rank sends
    the shards it holds straight to the engine ranks, which rebuild the HF tensors; no gather, no rank carries the
    whole model: actor/reshard.py, placement.DirectChannel; with SGLang servers each engine rank then relays the
    rebuilt tensors to the servers it drives over their weight-update group) or "rank0" (the actor gathers the full
    HF tensors and rank 0 broadcasts them to the engine ranks, placement.WeightChannel, or to the servers,
    placement.ServerPush), the engine's weights the same bit for bit; "auto": "direct" to the embedded engines of
    engine ranks, "rank0" to SGLang servers (the relay pays off when each engine rank runs on its servers' node, or
    with weight_sync_delta: docs/rollout.md, "Weight sync routes")."""
    compare_logprobs: bool = True
    """Ask the engine for its sampling log-probs and log the actor-vs-engine mismatch."""
    generation_timeout_minutes: float = 60.0
    """Longest the rollout stream goes without deciding a group, and a rank waits at the rollout exchange (a gloo
    group, so the wait holds no GPU); past it the job stops with one line naming this field."""
    deterministic_inference: bool = False
    """SGLang colocated: start the engine with enable_deterministic_inference, the only mode in which SGLang honours
    the per-request sampling_seed we send (reproducible rollouts; batch-invariant kernels cost throughput). Server
    mode: launch the servers with --enable-deterministic-inference instead."""
    weight_sync_master_address: str = ""
    """Mode "server": the address SGLang servers dial to join the weight-update group hosted by the trainer's rank 0
    ("" = detect: the local address that routes to the first server, else the host's name as resolved). A
    loopback address is refused when a server URL is not local or the job spans nodes. On weight_sync_route
    "direct" the engine ranks host the servers' groups and detect their own addresses."""
    weight_sync_master_port: int = 29600
    """Mode "server": the TCP port of that group's store on the trainer's rank-0 host (must be free there); on
    weight_sync_route "direct" engine rank r hosts its servers' group at this port + r."""
    max_running_requests: int = 0
    """Responses one engine decodes at once (SGLang's server argument of this name; the transformers engine's KV
    slots, rounded up to 4). 0: the engine's default (transformers: 32; SGLang: what its KV pool holds)."""
    max_inflight_prompts: int = 0
    """How far the prompt queue runs ahead of dynamic sampling's decisions: a prompt at queue position p is handed to
    an engine only when p < (positions decided so far) + max_inflight_prompts, so at most this many prompts are being
    generated or wait to be decided (over-sampling, as slime's over_sampling_batch_size / AReaL's
    max_concurrent_rollouts bound it). 0: trainer.gen_prompts_per_batch."""
    engine_restarts: int = 3
    """In-place restarts of one rank's engine in a run. An engine that dies while generating (its process exited, or
    it returned nothing for engine_stall_minutes) is shut down and built again on its rank, every rank meets to load
    it with the actor's weights, and its lost requests are re-queued (docs/rollout.md, "Engine failures"). Past this
    many the job ends and restarts from its last checkpoint (distributed.max_restarts). Colocated engines only: an
    SGLang server (mode "server") is its launcher's to restart, and its failure ends the job."""
    prompt_retries: int = 2
    """Engine failures a prompt may be in flight for: past it its group is given up (logged, counted in
    sampling/prompts_given_up, never trained on) rather than re-queued again (a prompt that kills engines)."""
    engine_stall_minutes: float = 30.0
    """An engine with requests in flight that returns no response for this long is declared dead and restarted
    (a health check; longer than the slowest single response: 20480 tokens at 12 tokens/s take 28 min). 0: off."""
    over_sampling: float = 1.5
    """How far past what dynamic sampling still needs the queue runs: positions past the decided ones start only while
    fewer than over_sampling x (groups still missing) / (keep ratio: the step's so far, else the last step's) are in
    flight, and never more than max_inflight_prompts. Less in flight is less work the cut aborts; too little waits
    for decisions. 0: only max_inflight_prompts bounds it."""
    partial: bool = False
    """Partial rollouts. When the step's target of kept groups is reached, work still in flight is aborted (false:
    its tokens are counted as wasted and its prompts return to the queue) or carried into the next step (true: the
    unfinished responses keep their tokens, engine log-probs and weight versions and are continued after the weight
    sync; finished groups beyond the cut are decided first in the next step). docs/rollout.md, "The stream"."""
    engine_ranks: int = 0
    """Disaggregated placement (asynchronous training): the last engine_ranks ranks of the launch only generate, the
    others only train (e.g. --nproc-per-node 2 with engine_ranks 1); generation of step s may start once the
    weights are at most trainer.max_staleness versions behind s - 1, so it overlaps the actor's update of the steps
    before (megatron_dapo/placement.py, docs/rollout.md "Asynchronous training"). Engine "transformers" (the engine
    ranks hold the embedded engines), or "sglang" with mode "server" (the engine ranks drive rollout.server_urls,
    round-robin; actor rank 0, or on weight_sync_route "direct" each engine rank, updates them while they generate).
    0: colocated, every rank both generates and trains, in turn (the default)."""
    weight_dtype: str = "auto"
    """Dtype of the weights sent to the engine each step: "auto" (as the actor exports them) or "fp8" (q/k/v/o and
    gate/up/down projections quantized to float8_e4m3fn with one fp32 scale per 128 x 128 block, the block-FP8 layout
    SGLang loads; embeddings, norms and lm_head stay as they are). Engines "transformers" and "sglang" (colocated, or
    servers started to serve that layout: rollout/fp8.SGLANG_FP8_QUANTIZATION_CONFIG, checked at the first update)."""

    @property
    def weight_sync_bucket_bytes(self) -> int:
        return self.weight_sync_bucket_mb * 2**20

    @property
    def direct_weight_sync(self) -> bool:
        """A split launch's weights go by direct resharding (weight_sync_route, "auto" resolved)."""
        route = self.weight_sync_route
        return self.engine_ranks > 0 and (route == "direct" or route == "auto" and self.mode != "server")

    def __post_init__(self) -> None:
        _check_numbers(self, "rollout")
        _one_of(self.engine, tuple(ENGINES), "rollout.engine")
        _one_of(self.mode, MODES, "rollout.mode")
        kind = ENGINES[self.engine]
        _check(self.mode in kind.modes, "rollout.mode", f'"{self.mode}" is not implemented for engine "{self.engine}"')
        if self.mode == "server":
            _check(bool(self.server_urls), "rollout.server_urls", 'must list at least one URL when mode is "server"')
            remote = [u for u in self.server_urls if not is_loopback(url_host(u))]
            address = self.weight_sync_master_address
            _check(
                not (address and is_loopback(address) and remote),
                "rollout.weight_sync_master_address",
                f"{address!r} is a loopback address but server {remote[0] if remote else ''} is not local; "
                "set an address of the trainer's rank-0 host that the servers can reach",
            )
        _one_of(self.weight_dtype, ("auto", "fp8"), "rollout.weight_dtype")
        _one_of(self.weight_sync_route, ("auto", "direct", "rank0"), "rollout.weight_sync_route")
        _check(
            self.weight_dtype == "auto" or self.mode in kind.fp8_modes,
            "rollout.weight_dtype",
            f'"fp8" is implemented for engines {with_capability("fp8")}, not {self.engine} {self.mode}',
        )
        if self.weight_sync_delta:
            # FP8 payloads: the embedded engine holds dequantized weights, so the FP8 base a delta applies to exists
            # only on a split launch's engine rank (its DeltaDecoder keeps the last push and hands the engine full
            # tensors). SGLang servers hold the FP8 weights and apply deltas with their loader, from actor rank 0; an
            # engine rank relaying to them keeps no base, so it cannot quantize a change (placement.DirectChannel).
            relay = self.mode == "server" and self.direct_weight_sync
            fp8_ok = self.weight_dtype == "auto" or (self.engine_ranks > 0 or self.mode == "server") and not relay
            where = "weight_sync_route direct" if relay else "rollout.engine_ranks 0"
            _check(
                self.mode in kind.delta_modes and fp8_ok,
                "rollout.weight_sync_delta",
                f'implemented for engines {with_capability("delta")} (also split; weight_dtype "fp8" split or into '
                f"SGLang servers from actor rank 0), not {self.engine} {self.mode} with weight_dtype "
                f'"{self.weight_dtype}"' + ("" if fp8_ok else f" and {where}"),
            )


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    """The Megatron-Core policy: model, parallelism, precision and optimizer."""

    model_path: str = ""
    """Hugging Face checkpoint directory (config.json + safetensors) to start from."""
    tensor_parallel: int = 1
    """Tensor-parallel size of the actor."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size of the actor; data parallel is world_size / (tensor_parallel * pipeline_parallel)."""
    expert_parallel: int = 1
    """Expert-parallel size of a mixture-of-experts actor (Qwen3-MoE, Qwen2-MoE): each MoE layer's experts are split
    over this many data-parallel ranks (world_size a multiple of tensor_parallel x expert_parallel x
    pipeline_parallel; the number of experts a multiple of it). Must be 1 for dense models."""
    moe_dispatcher: str = "alltoall"
    """Megatron's MoE token dispatcher: "alltoall" (tokens sent to the ranks of their experts) or "allgather"
    (every EP rank sees every token; pipeline_parallel 1 only, megatron's rule)."""
    routing_replay: str = "none"
    """MoE routing replay (actor/routing.py): "none"; "r2" (the old-log-prob pass records each token's experts, the
    update routes through the same ones); "r3" (the rollout engine's experts, replayed in both passes). Not with
    actor.shared_prefix."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing (auxiliary) loss coefficient of MoE routers: 0 (off) for RL, as the policy's routing is what
    the rollout sampled; > 0 adds megatron's per-layer aux loss to the update. The router z-loss is always off."""
    dtype: str = "bf16"
    """Parameter and compute dtype: "bf16" on GPU, "fp32" on CPU."""
    lr: float = 1e-6
    """Adam learning rate (constant after warm-up)."""
    lr_warmup_steps: int = 20
    """Linear warm-up, in optimizer steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables it)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""
    recompute_activations: bool = False
    """Full activation recompute per layer (saves memory on long responses)."""
    logprob_impl: str = "fused_linear"
    """How the log-probs run (registry in megatron_dapo/actor/loss.py; the policy loss follows it unless
    actor.loss_kernel says otherwise): "fused_linear" (default; LM head fused in: the last stage returns hidden
    states, no [T, V] logits), "fused" (megatron_dapo.ops on full logits, Triton), "fused_cuda" (the same on the CUDA
    C++ twins of csrc/, GPU only) or "reference" (chunked plain torch on the logits, for debugging). docs/kernels.md."""
    loss_kernel: str = "auto"
    """The policy loss's implementation: "auto" (the backend of actor.logprob_impl: the pure-torch reference for
    "reference", the Triton kernel for "fused" / "fused_linear", the CUDA twin for "fused_cuda"), or "reference",
    "triton" or "cuda" whatever the log-probs run on (actor/loss.py: LOSS_KERNELS, loss_kernel)."""
    packing: bool = True
    """Pack each micro-batch's responses into one row (THD, cu_seqlens; attention and RoPE restart per sequence):
    no padding is computed. False: rows padded to the micro-batch's longest."""
    shared_prefix: bool = False
    """Compute each prompt once per micro-batch for the rows that share it (the G responses of a group): a
    micro-batch is one row holding each prompt group as prefix + one branch per response, with a prefix/branch
    attention mask and per-token RoPE positions (actor/packing.py SharedPrefixLayout); micro-batches keep groups
    together (their budget counts the tokens computed). Exact (same log-probs and gradients as without it). Needs
    actor.packing and the local layer spec (CPU, or actor.allow_local_spec_on_gpu): Transformer Engine's attention
    takes no such mask."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism when tensor_parallel > 1 on GPU (activation memory / tp outside attention and
    MLP); always off on CPU (gloo has no reduce-scatter)."""
    max_tokens_per_microbatch: int = 0
    """Token budget of a micro-batch (packed: sum of lengths; padded: rows x longest); rows are binned by length
    under it. 0: trainer.micro_batch_size rows per micro-batch. Rows are balanced over data-parallel ranks by tokens
    either way."""

    offload: str = "none"
    """What of the actor leaves the GPU while the colocated engine generates, to pinned host memory
    (megatron_dapo/memory.py): "none"; "optimizer" (fp32 main params and Adam moments, after each update);
    "all" (also gradients, and the parameters after the weight sync). Reloaded before the next log-probs. On CPU
    the same code path runs (the bytes are copied and restored; nothing is freed)."""

    allow_local_spec_on_gpu: bool = False
    """Debugging only: on GPU without Transformer Engine, build the local layer spec instead of stopping (it holds
    full attention scores per layer and has no fused kernels: long responses run out of memory)."""

    def __post_init__(self) -> None:
        self.model_path = _expand(self.model_path)
        _check_numbers(self, "actor")
        _one_of(self.dtype, ("bf16", "fp16", "fp32"), "actor.dtype")
        _one_of(self.moe_dispatcher, ("alltoall", "allgather"), "actor.moe_dispatcher")
        _one_of(self.routing_replay, ("none", "r2", "r3"), "actor.routing_replay")
        _check(
            self.routing_replay == "none" or not self.shared_prefix,
            "actor.routing_replay",
            "not supported with actor.shared_prefix (a prompt computed once has one routing for all its rows)",
        )
        _check(
            self.moe_dispatcher != "allgather" or self.pipeline_parallel == 1,
            "actor.moe_dispatcher",
            "allgather needs actor.pipeline_parallel=1 (megatron rejects it with variable sequence lengths)",
        )
        _check(
            self.packing or not self.shared_prefix,
            "actor.shared_prefix",
            "needs actor.packing=true (the shared micro-batch is one packed row)",
        )
        _one_of_registered(self.offload, "actor.offload")
        _one_of_registered(self.logprob_impl, "actor.logprob_impl")
        _one_of_registered(self.loss_kernel, "actor.loss_kernel")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Prompt data: DAPO-Math-17k style parquet/jsonl files (see megatron_dapo.data)."""

    train_files: list[str] = field(default_factory=list)
    """Training files (.parquet or .jsonl)."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out evaluation files."""
    shuffle: bool = True
    """Shuffle prompts each epoch (by seed)."""
    seed: int = 0
    """Shuffle seed."""
    max_prompt_length: int = 2048
    """Prompts longer than this many tokens (chat template applied) are found when the data loads: an error naming
    the file and row, or dropped with filter_overlong_prompts."""
    filter_overlong_prompts: bool = False
    """Drop over-long prompts at load (logged with their count) instead of stopping (verl's option of this name)."""
    drop_duplicates: bool = True
    """Drop rows whose prompt and ground truth repeat an earlier row's, logged with their count (DAPO-Math-17k as
    published repeats each prompt ~100 times; an evaluation file with one row per sample repeats each k times)."""
    cache_dir: str = "~/.cache/megatron_dapo/prompts"
    """The prompt cache (megatron_dapo/data/cache.py): the data parsed, de-duplicated and tokenised once per dataset
    version, tokenizer and template, memory-mapped by every rank and every later start. A folder every rank of a node
    can write (node-local or shared); "" reads and tokenises the files on every rank at every start."""

    def __post_init__(self) -> None:
        self.train_files = [_expand(p) for p in self.train_files]
        self.eval_files = [_expand(p) for p in self.eval_files]
        self.cache_dir = _expand(self.cache_dir)
        _check_numbers(self, "data")
        for key in ("train_files", "eval_files"):
            value = getattr(self, key)
            _check(all(isinstance(v, str) and v for v in value), f"data.{key}", "must be a list of paths")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The loop: batch sizes, steps, evaluation."""

    total_steps: int = 1000
    """Training steps (one step = one rollout batch and its updates)."""
    run_dir: str = "runs/dapo"
    """Directory for metrics, checkpoints and plots."""
    seed: int = 1
    """Seed for sampling and initialisation."""
    prompts_per_step: int = 512
    """Prompts per training batch (after dynamic sampling), each with group_size responses."""
    gen_prompts_per_batch: int = 512
    """The unit of algorithm.max_gen_batches, and the default of rollout.max_inflight_prompts (how far the prompt
    queue runs ahead of dynamic sampling's decisions)."""
    mini_batch_prompts: int = 32
    """Prompts per optimizer step (paper: 512 responses = 32 prompts x 16), so 16 updates per step."""
    micro_batch_size: int = 4
    """Responses per micro-batch on one data-parallel rank (forward/backward unit)."""
    ppo_epochs: int = 1
    """Passes over each training batch."""
    max_staleness: int = -1
    """Bound on how many weight versions a trained token may lag the policy the update starts from (docs/rollout.md,
    "Staleness"): a response carried across steps (rollout.partial) that would exceed it is restarted from nothing
    at the cut or its group dropped (trainer.on_stale; logged: stream/stale_*). -1: no bound (a response may be
    carried over several steps); 0: every trained token comes from the current weights. Above 0 the run needs
    algorithm.rollout_correction."""
    on_stale: str = "regenerate"
    """What happens to a carried group with a response past trainer.max_staleness: "regenerate" (that response
    starts again from nothing in the next step; the group's others are kept) or "drop" (the group is not carried:
    its prompt counts as consumed and is not trained on)."""
    eval_every: int = 0
    """Evaluate on data.eval_files every this many steps (0 = never during training)."""
    eval_samples: int = 32
    """Samples per eval prompt (avg@k / pass@k / cons@k with k = eval_samples)."""
    eval_temperature: float = 1.0
    """Eval sampling temperature (paper: 1.0)."""
    eval_top_p: float = 0.7
    """Eval nucleus threshold (paper: 0.7)."""
    eval_max_prompts: int = 0
    """Evaluate at most this many prompts (0 = all)."""
    eval_timeout_minutes: float = 60.0
    """How long a rank waits for the slowest rank's evaluation (its own gloo group, apart from
    rollout.generation_timeout_minutes): one evaluation is eval prompts x eval_samples generations, which the planner
    estimates (`megatron-dapo plan`; the pre-flight refuses an estimate above this)."""
    max_skipped_steps: int = 10
    """Stop with an error after this many optimizer steps in a row were skipped for a non-finite loss or gradient
    (0 = never stop)."""
    preflight: bool = True
    """On CUDA, `train` first runs the planner (megatron_dapo/plan.py) on the job's layout and exits with code 2 when
    a phase does not fit in GPU memory; false skips the check."""

    def __post_init__(self) -> None:
        _check_numbers(self, "trainer")
        _check(
            self.prompts_per_step % self.mini_batch_prompts == 0,
            "trainer.mini_batch_prompts",
            f"{self.mini_batch_prompts} must divide trainer.prompts_per_step {self.prompts_per_step}",
        )
        _check(self.run_dir != "", "trainer.run_dir", "must not be empty")
        _one_of(self.on_stale, ("regenerate", "drop"), "trainer.on_stale")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpointing and resume."""

    save_every: int = 10
    """Save every this many steps (0 = only at the end and on SIGTERM/SIGUSR1)."""
    keep_last: int = 3
    """Keep the newest K checkpoints."""
    resume: str = "auto"
    """"auto" (newest checkpoint in run_dir if any), "never", or a checkpoint directory."""
    load_hf_on_start: bool = True
    """Initialise from actor.model_path when no checkpoint is resumed."""
    preempt_grace_s: float = 300.0
    """Seconds a worker has after SIGTERM/SIGUSR1 to finish its step and save (the trainer saves at the step
    boundary). `megatron-dapo launch` gives torchrun this --shutdown-timeout (torchrun's own default SIGKILLs after
    30 s); under Slurm pair it with --signal=B:USR1@<at least this> (docs/reliability.md). It also bounds how long a
    worker outlives a dead torchrun."""
    async_save: bool = False
    """Write periodic checkpoints in the background: the actor's tensors are copied to host memory at the step
    boundary and written by a thread while the next step runs; the checkpoint is hashed and marked complete at the
    next step boundary (until then the previous one is the one to resume from). Saves on a preemption signal and at
    the last step stay synchronous. Costs one host copy of each rank's checkpoint share (docs/cluster.md)."""
    allow_unverified: bool = False
    """Resume from a checkpoint that has no MANIFEST.json (copied without it, or written before manifests existed).
    Off: such a checkpoint is refused with one line. On: it loads unverified, with a warning; its pickled metadata is
    still read through the restricted unpickler (docs/reliability.md, Checkpoint integrity)."""

    def __post_init__(self) -> None:
        _check_numbers(self, "checkpoint")
        _check(self.resume != "", "checkpoint.resume", 'must be "auto", "never" or a path')

    def periodic(self, step: int) -> bool:
        """Whether step `step` saves by save_every (the last step and a preemption save regardless)."""
        return bool(self.save_every) and step % self.save_every == 0


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """torch.distributed settings."""

    timeout_minutes: float = 30.0
    """Collective timeout (init_process_group and megatron's groups; Megatron-LM --distributed-timeout-minutes): a
    rank that stops answering fails the job after this long instead of stalling it."""
    max_restarts: int = 2
    """After a failure (a rank's exception, an out-of-memory kill, a dead engine or peer), restart the whole job from
    its last verified checkpoint at most this many times (`megatron-dapo launch`: torchrun --max-restarts; the sbatch
    files: srun again). Errors a restart would repeat (a bad config or input) are not restarted
    (megatron_dapo/restarts.py)."""

    def __post_init__(self) -> None:
        _check_numbers(self, "distributed")

    @property
    def timeout_s(self) -> float:
        return self.timeout_minutes * 60.0


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Metric sinks."""

    console: str = "rich"
    """"rich" (progress bar and table), "plain" (one line per step) or "none"."""
    jsonl: bool = True
    """Write run_dir/metrics.jsonl (one JSON object per step)."""
    tensorboard: bool = False
    """Write TensorBoard event files to run_dir/tb."""
    plots: bool = True
    """Draw PNG curves into run_dir/plots at the end of the run."""
    tracker: str = "none"
    """An experiment tracker beside metrics.jsonl and TensorBoard: "none", "wandb" (offline without WANDB_API_KEY)
    or "mlflow" (SQLite at run_dir/mlflow.db without MLFLOW_TRACKING_URI); megatron_dapo/trackers.py."""
    tracker_project: str = "megatron_dapo"
    """The W&B project / MLflow experiment of the run (the run is named after run_dir)."""
    trajectory_samples: int = 0
    """Responses of each step written readably to run_dir/trajectories/ (a jsonl per step and index.html; model turns
    and observations apart, megatron_dapo/trajectories.py), sampled from the kept groups over the ranks that generated
    them (on a split launch the engine ranks' groups are not gathered yet: the files stay empty); 0: none."""

    def __post_init__(self) -> None:
        _check_numbers(self, "logging")
        _one_of(self.console, ("rich", "plain", "none"), "logging.console")
        _one_of_registered(self.tracker, "logging.tracker")
        _check(bool(self.tracker_project.strip()), "logging.tracker_project", "must not be empty")


SECTIONS: dict[str, type] = {
    "algorithm": AlgorithmConfig,
    "reward": RewardConfig,
    "rollout": RolloutConfig,
    "actor": ActorConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
    "logging": LoggingConfig,
}


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A whole run: one section per component."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Loss choice, advantages, dynamic sampling, overlong shaping."""
    loss: Any = None
    """The config of the policy loss algorithm.policy_loss names (a PolicyLossConfig subclass from
    megatron_dapo/algorithms/losses/); None: that loss's defaults. Dr. GRPO's norm_length 0 resolves to
    rollout.max_response_length here."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Verifier."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Megatron-Core policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop and batch sizes."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Process-group settings."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""

    def __post_init__(self) -> None:
        a, r, t = self.algorithm, self.rollout, self.trainer
        self.loss = _resolve_loss(a.policy_loss, self.loss, r.max_response_length)
        if a.overlong_penalty:
            _check(
                a.overlong_buffer < r.max_response_length,
                "algorithm.overlong_buffer",
                f"must satisfy 0 < overlong_buffer < rollout.max_response_length ({r.max_response_length}), "
                f"got {a.overlong_buffer}",
            )
        _check(
            self.mini_batch_rows % t.micro_batch_size == 0,
            "trainer.micro_batch_size",
            f"{t.micro_batch_size} must divide the responses per mini-batch "
            f"(mini_batch_prompts {t.mini_batch_prompts} x group_size {a.group_size})",
        )
        if a.rollout_correction != "none":
            _check(
                r.compare_logprobs,
                "algorithm.rollout_correction",
                f"{a.rollout_correction!r} needs the engine's log-probs: set rollout.compare_logprobs=true",
            )
        _check(
            t.max_staleness <= 0 or a.rollout_correction != "none",
            "trainer.max_staleness",
            f"{t.max_staleness} lets tokens come from weights up to {t.max_staleness} updates old, an off-policy batch "
            "that needs algorithm.rollout_correction (tis or mis) to weigh it",
        )
        if r.engine_ranks:
            servers = r.mode == "server"
            _check(
                r.mode in ENGINES[r.engine].split_modes,
                "rollout.engine_ranks",
                f"splits the launch into actor and engine ranks for the engines {with_capability('split')}; not "
                f"rollout.engine {r.engine!r} with mode {r.mode!r}",
            )
            _check(
                not servers or r.engine_ranks <= len(r.server_urls),
                "rollout.engine_ranks",
                f"{r.engine_ranks} engine ranks for {len(r.server_urls)} rollout.server_urls: each engine rank drives "
                "at least one server",
            )
            _check(
                not servers or not t.eval_every,
                "trainer.eval_every",
                "evaluation on a split launch over SGLang servers is not wired yet (the servers move on to newer "
                "weights while it would run): set trainer.eval_every=0 and evaluate checkpoints with "
                "megatron-dapo eval",
            )
            _check(
                t.max_staleness >= 0,
                "trainer.max_staleness",
                "must bound how far the engine ranks run ahead when rollout.engine_ranks > 0: 0 generates each step "
                "from the weights its previous step made (on-policy, no overlap), k >= 1 from weights up to k updates "
                "older (generation overlaps the update)",
            )
        if a.old_logp_source == "engine":
            _check(
                r.compare_logprobs,
                "algorithm.old_logp_source",
                "'engine' trains against the engine's log-probs: set rollout.compare_logprobs=true",
            )
            _check(
                self.actor.routing_replay != "r2",
                "algorithm.old_logp_source",
                "'engine' skips the old-log-prob pass that actor.routing_replay r2 records its experts in; use r3",
            )
        _check(
            self.actor.routing_replay != "r3" or ENGINES[r.engine].routing,
            "actor.routing_replay",
            f"r3 needs every token's experts from the rollout engine; rollout.engine {r.engine!r} does not return "
            f"them ({with_capability('routing')} do); use r2",
        )
        cap = a.max_gen_batches * t.gen_prompts_per_batch
        _check(
            a.dynamic_sampling or cap == 0 or cap >= t.prompts_per_step,
            "algorithm.max_gen_batches",
            f"with dynamic sampling off, max_gen_batches x trainer.gen_prompts_per_batch ({cap} prompts) must be >= "
            f"trainer.prompts_per_step ({t.prompts_per_step})",
        )

    @property
    def mini_batch_rows(self) -> int:
        """Responses per optimizer step (`mini_batch_rows`)."""
        return mini_batch_rows(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["loss"] = dataclasses.asdict(self.loss)
        return out


def _resolve_loss(name: str, loss: Any, max_response_length: int) -> Any:
    """The `loss` section as the selected loss's config: its defaults when None, refused when it belongs to another
    loss; then the loss's own `resolve` fills what depends on other sections (Dr. GRPO's norm_length 0: the cap)."""
    make = choices("algorithm.policy_loss")[name]
    default = make({})
    if loss is None:
        loss = default
    _check(
        type(loss) is type(default),
        "loss",
        f"is a {type(loss).__name__}, but algorithm.policy_loss {name!r} takes a {type(default).__name__}",
    )
    return loss.resolve(max_response_length=max_response_length)


def _build_loss(name: str, values: dict[str, Any], source: str) -> Any:
    """The `loss` section of a file / overrides: each key converted to the selected loss's field type, then checked
    by the loss's own config class (megatron_dapo/algorithms/losses/<name>.py)."""
    registered = choices("algorithm.policy_loss")
    _check(name in registered, f"{source}: algorithm.policy_loss", f"must be one of {sorted(registered)}, got {name!r}")
    make = registered[name]
    cls = type(make({}))
    hints = typing.get_type_hints(cls)
    known = sorted(f.name for f in dataclasses.fields(cls))
    converted = {}
    for key, val in values.items():
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key {key!r} in section [loss] of policy loss {name!r}; known keys: {known}"
            )
        converted[key] = coerce_field(val, hints[key], f"{source}: loss.{key}")
        if isinstance(converted[key], float):
            _check(math.isfinite(converted[key]), f"{source}: loss.{key}", f"must be a finite number, got {val}")
    try:
        return make(converted)
    except ValueError as err:
        raise ConfigError(f"{source}: loss.{err} (policy loss {name!r})") from None


def mini_batch_rows(config: Any) -> int:
    """Responses per optimizer step: trainer.mini_batch_prompts x algorithm.group_size, the RowPlan's mini-batch
    (read by the trainer, the actor and the planner; config: a RunConfig or any object with those sections)."""
    return config.trainer.mini_batch_prompts * config.algorithm.group_size


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce_field(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML / command-line value to the declared field type (int, float, bool, str, lists and X | None of
    them), or raise ConfigError naming `where`. The one field coercion (config files, --section.field overrides,
    the integration API's --dapo-* flags)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [t for t in args if t is not type(None)]
        return coerce_field(value, inner[0], where)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        _check(isinstance(value, list), where, f"expected a list, got {value!r}")
        return [coerce_field(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{where}: expected a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
            # float() would raise OverflowError (not a ValueError: a traceback)
            raise ConfigError(f"{where}: must be a finite number, got {value}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        _check(
            isinstance(value, (str, int, float)) and not isinstance(value, bool),
            where,
            f"expected a string, got {value!r}",
        )
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def _build_section(name: str, values: dict[str, Any], source: str) -> Any:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if name == "algorithm" and key in MOVED_TO_LOSS:
            raise ConfigError(
                f"{source}: algorithm.{key} moved to the policy loss's own section: write it as loss.{key} (fields of "
                f"each loss: megatron_dapo/algorithms/losses/)"
            )
        if key not in known:
            raise ConfigError(f"{source}: unknown key {key!r} in section [{name}]; known keys: {sorted(known)}")
    kwargs = {key: coerce_field(val, hints[key], f"{source}: {name}.{key}") for key, val in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Build and validate a RunConfig from {section: {field: value}}."""
    if raw is None:
        raw = {}
    _check(isinstance(raw, dict), source, "the top level must be a mapping of sections")
    for name, values in raw.items():
        if name not in SECTIONS and name != "loss":
            raise ConfigError(f"{source}: unknown section {name!r}; known sections: {[*SECTIONS, 'loss']}")
        _check(isinstance(values, dict) or values is None, f"{source}: {name}", "a section must be a mapping")
    sections = {name: _build_section(name, raw.get(name) or {}, source) for name in SECTIONS}
    loss = _build_loss(sections["algorithm"].policy_loss, raw.get("loss") or {}, source)
    try:
        return RunConfig(**sections, loss=loss)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `--section.field=value` arguments into {section: {field: raw value}} (values YAML-parsed)."""
    out: dict[str, dict[str, Any]] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"override {arg!r}: expected --section.field=value")
        key, text = arg[2:].split("=", 1)
        section, name = key.split(".", 1)
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except (yaml.YAMLError, ValueError):  # ValueError: an integer past Python's 4300-digit limit
            value = text
        out.setdefault(section, {})[name] = value
    return out


class _DuplicateKeyError(yaml.YAMLError):
    """A key written twice in one mapping: `line` is where the second one is, the message names both."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader (no python/* tags) that refuses a key written twice in one mapping; plain PyYAML keeps the
    last one silently (a second `actor:` section drops the first's settings).

    The check runs as each mapping node is composed, before anything is constructed: an alias is the node it names,
    composed once, so aliases are never expanded (billion-laughs input stays cheap). Merge keys (<<) are YAML's
    override mechanism, not duplicates, and are left to the constructor.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._keys_above: list[Node | int | None] = []

    def compose_node(self, parent: Node | None, index: Node | int | None) -> Node:
        # index: the key node of a mapping value, the position of a sequence item, None for a key or the root.
        self._keys_above.append(index)
        try:
            return super().compose_node(parent, index)
        finally:
            self._keys_above.pop()

    def compose_mapping_node(self, anchor: str | None) -> MappingNode:
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], int] = {}  # (resolved tag, text) -> line: `lr` and 'lr' are the same key
        for key, _ in node.value:
            if not isinstance(key, ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if (key.tag, key.value) in first:
                seen = first[(key.tag, key.value)]
                raise _DuplicateKeyError(line, f"duplicate {self._what(key.value)} (first at line {seen})")
            first[(key.tag, key.value)] = line
        return node

    def _what(self, key: str) -> str:
        """`section 'actor'` at the top level, `key 'lr' in section [actor]` one level down."""
        above = self._keys_above
        if len(above) == 1:
            return f"section {key!r}"
        if len(above) == 2 and isinstance(above[1], ScalarNode):
            return f"key {key!r} in section [{above[1].value}]"
        return f"key {key!r}"


def _read_yaml(path: str | Path, source: str) -> Any:
    """The YAML document of a run file, or ConfigError naming the file (and line) when it cannot be read as one."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{source}: cannot read config file ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source}: not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start})") from None
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    except _DuplicateKeyError as err:
        raise ConfigError(f"{source} line {err.line}: {err}") from None
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an integer past Python's 4300-digit limit
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{line}: invalid YAML") from None
    finally:
        loader.dispose()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a flat YAML run file (sections of fields), apply `--section.field=value` overrides, validate.

    Raises ConfigError with a one-line message naming the file, section and key on any problem.
    """
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        raw = _read_yaml(path, source) or {}
        _check(isinstance(raw, dict), source, "the top level must be a mapping of sections")
        raw = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in raw.items()}
    for section, values in parse_overrides(overrides or []).items():
        if section not in SECTIONS and section != "loss":
            raise ConfigError(
                f"override --{section}.*: unknown section {section!r}; known sections: {[*SECTIONS, 'loss']}"
            )
        raw.setdefault(section, {}).update(values)
        source = f"{source} + overrides" if "overrides" not in source else source
    return config_from_dict(raw, source)


def save_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
