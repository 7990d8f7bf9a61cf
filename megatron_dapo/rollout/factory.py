"""make_engine: RolloutConfig -> a RolloutEngine; sampling_params: RolloutConfig -> SamplingParams."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.config import RolloutConfig
from megatron_dapo.rollout.base import EngineLaunch
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.base import RoutedShape
from megatron_dapo.rollout.base import SamplingParams

TRANSFORMERS_MAX_RUNNING = 32
"""Rows the embedded engine decodes at once when rollout.max_running_requests is 0."""


def sampling_params(
    rollout: RolloutConfig,
    n: int,
    *,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    temperature: float | None = None,
    top_p: float | None = None,
    return_logprobs: bool | None = None,
    routed_experts: bool = False,
) -> SamplingParams:
    """The one SamplingParams builder (training, the trainer's evaluation, `megatron-dapo eval`): n responses per
    prompt, max_new_tokens = rollout.max_response_length, top_k = rollout.top_k; temperature, top_p and
    return_logprobs from the rollout section unless given (evaluation passes trainer.eval_temperature /
    eval_top_p and no log-probs). routed_experts: the engine returns every token's MoE routing (actor.routing_replay
    r3, training only)."""
    return SamplingParams(
        n=n,
        max_new_tokens=rollout.max_response_length,
        temperature=rollout.temperature if temperature is None else temperature,
        top_p=rollout.top_p if top_p is None else top_p,
        top_k=rollout.top_k,
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
        return_logprobs=rollout.compare_logprobs if return_logprobs is None else return_logprobs,
        return_routed_experts=routed_experts,
    )


def routing_shape(model_path: str) -> RoutedShape:
    """RoutedShape (num_hidden_layers, num_experts_per_tok, num_experts, dense first layers) of an MoE checkpoint's
    config.json: the shape of SGLang's per-token routing."""
    from megatron_dapo.plan import shape_from_hf_config

    path = Path(model_path) / "config.json"
    shape = shape_from_hf_config(json.loads(path.read_text()), str(path))
    if not shape.experts or not shape.topk:
        raise ValueError(f"{path}: not a mixture-of-experts config (no num_experts / num_experts_per_tok)")
    return RoutedShape(shape.layers, shape.topk, shape.experts, shape.dense_layers)


def server_stream(
    rollout: RolloutConfig, model_path: str, urls: list[str], *, routed_experts: bool = False, **group: Any
) -> RolloutEngine:
    """SGLang servers (rollout.mode server) over `urls`. group: SGLangServerEngine's weight-update-group arguments
    (master_address, master_port, backend) for the process that pushes weights (actor rank 0, or on the direct
    route the engine rank relaying to them: engine_rank.relay_group); without them, generation only (an engine rank
    of a split launch driving its share of the servers while actor rank 0 pushes: placement.ServerPush)."""
    from megatron_dapo.rollout.sglang_engine import SGLangServerEngine

    # Deltas reach the servers' own loader on every route: from actor rank 0, or from the engine ranks relaying them.
    server = SGLangServerEngine(
        urls, server_tp=rollout.tensor_parallel, max_running_requests=rollout.max_running_requests,
        delta_loader=rollout.weight_sync_delta, fp8=rollout.weight_dtype == "fp8", **group,
    )  # fmt: skip
    server.routed_shape = routing_shape(model_path) if routed_experts else None
    return server


def _pushing_server_stream(
    rollout: RolloutConfig, model_path: str, master_address: str | None, master_port: int | None, routed_experts: bool
) -> RolloutEngine:
    """The servers of rollout.server_urls, with this process as the pusher of their weight-update group (make_engine
    documents the address and port)."""
    from megatron_dapo.launch_env import num_nodes
    from megatron_dapo.launch_env import weight_sync_master_address

    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    address = master_address if master_address is not None else rollout.weight_sync_master_address
    return server_stream(
        rollout,
        model_path,
        rollout.server_urls,
        routed_experts=routed_experts,
        master_address=weight_sync_master_address(address, rollout.server_urls, num_nodes(world)),
        master_port=master_port if master_port is not None else rollout.weight_sync_master_port,
        backend="nccl" if torch.cuda.is_available() else "gloo",  # a trainer without a GPU broadcasts over gloo
    )


def make_engine(
    rollout: RolloutConfig,
    model_path: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    base_gpu_id: int = 0,
    max_context: int | None = None,
    master_address: str | None = None,
    master_port: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    routed_experts: bool = False,
) -> RolloutEngine:
    """Build the engine named by rollout.engine / rollout.mode.

    model_path: HF checkpoint directory (the actor's starting point; later weights arrive through WeightSync).
    device / dtype: defaults "cuda" + "bfloat16" when a GPU is visible, else "cpu" + "float32".
    base_gpu_id: first GPU of a colocated SGLang engine (the local rank that holds it).
    max_context: the transformers engine's KV capacity per row (prompt + response tokens; None: sized on first use).
    master_address / master_port: this rank's endpoint for SGLang server mode's NCCL weight-update group; None takes
        rollout.weight_sync_master_address (detected when empty) / rollout.weight_sync_master_port. A loopback
        address is refused when a server is remote or the job spans nodes (launch_env.weight_sync_master_address).
    engine_kwargs: extra arguments for sglang.Engine / vllm.LLM.
    routed_experts: the engine will be asked for every token's MoE routing (actor.routing_replay r3): SGLang starts
        with enable_return_routed_experts (a server must have been started with --enable-return-routed-experts)
        and decodes them with the model's shape; the transformers engine needs nothing.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if rollout.engine == "transformers":
        from megatron_dapo.rollout.transformers_engine import TransformersEngine

        return TransformersEngine(
            model_path,
            dtype=getattr(torch, dtype),
            device=device,
            max_running=rollout.max_running_requests or TRANSFORMERS_MAX_RUNNING,
            max_context=max_context,
        )
    if rollout.mode == "server":  # SGLang servers, the one engine with a server mode (rollout/engines.py)
        return _pushing_server_stream(rollout, model_path, master_address, master_port, routed_experts)
    launch = EngineLaunch(
        model_path, rollout, dtype, seed, base_gpu_id, dict(engine_kwargs or {}),
        routing_shape(model_path) if routed_experts else None,
    )  # fmt: skip
    if rollout.engine == "sglang":
        from megatron_dapo.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(launch)
    if rollout.engine == "vllm":  # colocated only (rollout/engines.py; the config refuses its server mode)
        from megatron_dapo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(launch)
    raise ValueError(f"rollout.engine: unknown engine {rollout.engine!r}")


def engine_ranks(rollout: RolloutConfig, world_size: int) -> list[int]:
    """Global ranks that host a rollout engine in a colocated launch (prompts are sharded over them in this order).

    transformers: every rank (CPU rollout is data-parallel); sglang colocated: one engine per rollout.tensor_parallel
    GPUs (ranks per node must be a multiple of it); sglang server / vllm: rank 0 drives the engine.
    """
    if rollout.engine == "transformers":
        return list(range(world_size))
    if rollout.engine == "sglang" and rollout.mode == "colocated":
        return [r for r in range(world_size) if r % rollout.tensor_parallel == 0]
    return [0]


def sizes_kv_pool_at_start(rollout: RolloutConfig) -> bool:
    """True for engines in the training processes' GPUs that size their KV pool once, from the memory free when they
    start (colocated SGLang and vLLM): the trainer builds them with the actor offloaded (MemoryChoreographer
    .build_engine). The transformers engine allocates its KV slots per use; server mode lives on other GPUs."""
    return rollout.mode == "colocated" and rollout.engine in ("sglang", "vllm")


def _per_gpu_updates(rollout: RolloutConfig) -> bool:
    """Colocated SGLang with rollout.tensor_parallel > 1: every rank of an engine's group takes part in its updates."""
    return rollout.engine == "sglang" and rollout.mode == "colocated" and rollout.tensor_parallel > 1


def update_group_size(rollout: RolloutConfig) -> int:
    """Ranks that take part in one engine's weight updates (consecutive global ranks; the first holds the engine)."""
    return rollout.tensor_parallel if _per_gpu_updates(rollout) else 1


def restarts_in_place(rollout: RolloutConfig) -> bool:
    """Engines the stream restarts in place when they die (rollout.engine_restarts): those in the training processes
    (colocated). An SGLang server belongs to whoever launched it; its failure ends the job."""
    return rollout.mode == "colocated"


def retarget(target: Any, engine: RolloutEngine | None) -> Any:
    """The weight-update target after this rank's engine was rebuilt: a ColocatedWeightUpdate keeps its group and
    takes the new engine (on its leader); otherwise the target is the engine itself."""
    from megatron_dapo.rollout.sglang_engine import ColocatedWeightUpdate

    if isinstance(target, ColocatedWeightUpdate):
        target.engine = engine
        return target
    return engine


def weight_update_target(rollout: RolloutConfig, engine: RolloutEngine | None, rank: int, world_size: int) -> Any:
    """What WeightSync drives on this rank: the engine itself (None on ranks without one), or, for colocated SGLang
    with rollout.tensor_parallel > 1, a ColocatedWeightUpdate on EVERY rank of the engine's group, so SGLang TP
    worker i reads its bucket from the GPU it shares with actor rank r + i. Collective in that case (it creates one
    gloo group per engine): call it on every rank, after the engines are built."""
    if _per_gpu_updates(rollout):
        from megatron_dapo.rollout.sglang_engine import colocated_weight_update

        return colocated_weight_update(engine, rank, world_size, rollout.tensor_parallel)
    return engine
