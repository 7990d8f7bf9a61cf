"""SGLang rollout engines: colocated (offline sglang.Engine in the training processes) and server mode (HTTP).

    colocated:  WeightSync --bucket--> ColocatedWeightUpdate on each rank r+i of the engine's group: the bucket
                    flattened per dtype on GPU i (uint8 tensor + metadata) -> CUDA IPC payload --gather (gloo)-->
                    Engine.update_weights_from_tensor([payload_0 .. payload_t-1], "flattened_bucket") on rank r;
                    SGLang TP worker i reads payload i: the GPU it shares with actor rank r+i
                release_memory(tags) / resume_memory(tags): release_memory_occupation / resume_memory_occupation
                (tags "weights", "kv_cache", "cuda_graph"; order: megatron_dapo/memory.py)
    server:     generate --HTTP POST /generate (input_ids, sampling_params, return_logprob)--> servers
                WeightSync --bucket--> POST /update_weights_from_distributed (names, dtypes, shapes)
                                       + NCCL broadcast from the trainer (rank 0 of the update group)
                with rollout.weight_sync_delta (rank-0 route): a bucket's changed elements instead go by
                POST /update_weights_from_tensor to the servers' delta loader (rollout/sglang_loader.py)

Every SGLang name this module uses is listed once in sglang_api.SGLANG_API and every call goes through
sglang_api.checked (checked against SGLang's source by tests/rollout/test_sglang_adapter.py). sglang is imported
lazily: it has no CPU build. Supported versions: sglang_api.SGLANG_VERSIONS (docs/rollout.md).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from megatron_dapo import wire
from megatron_dapo.launch_env import rendezvous_store
from megatron_dapo.launch_env import scrubbed_environ
from megatron_dapo.memory import ENGINE_TAGS
from megatron_dapo.rollout.base import EngineLaunch
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.base import generate_blocking
from megatron_dapo.rollout.delta import WeightDelta
from megatron_dapo.rollout.sglang_api import ROUTE_BODY
from megatron_dapo.rollout.sglang_api import checked
from megatron_dapo.rollout.sglang_api import effective_max_running
from megatron_dapo.rollout.sglang_stream import EngineStream
from megatron_dapo.rollout.sglang_stream import ServerStream
from megatron_dapo.rollout.types import Rollout


def flatten_bucket(bucket: Sequence[tuple[str, Tensor]], align: int = 16) -> tuple[Tensor, list[dict]]:
    """Pack tensors into one uint8 tensor: each tensor's bytes start at a multiple of align.

    bucket: (name, tensor) pairs, any dtypes, one device. Returns (flat [nbytes] uint8, metadata) where
    metadata[j] = {name, shape, dtype, start_idx, end_idx, numel} with byte offsets (SGLang's
    FlattenedTensorMetadata fields; numel counts bytes, as SGLang's own bucket does).
    """
    if not bucket:
        raise ValueError("flatten_bucket: empty bucket")
    device = bucket[0][1].device
    metadata, offset = [], 0
    for name, t in bucket:
        start = (offset + align - 1) // align * align
        nbytes = t.numel() * t.element_size()
        metadata.append(
            {"name": name, "shape": t.shape, "dtype": t.dtype, "start_idx": start, "end_idx": start + nbytes}
        )
        metadata[-1]["numel"] = nbytes
        offset = start + nbytes
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), meta in zip(bucket, metadata):
        flat[meta["start_idx"] : meta["end_idx"]].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, metadata


def split_by_dtype(bucket: Sequence[tuple[str, Tensor]]) -> list[list[tuple[str, Tensor]]]:
    """The bucket's (name, tensor) pairs grouped by dtype (groups in order of first appearance, pairs in order)."""
    groups: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    for name, t in bucket:
        groups.setdefault(t.dtype, []).append((name, t))
    return list(groups.values())


def flattened_bucket_payloads(
    bucket: Sequence[tuple[str, Tensor]],
    tp_size: int,
    metadata_cls: Callable[..., Any],
    serialize: Callable[[Any], bytes],
) -> list[bytes]:
    """The named_tensors argument of Engine.update_weights_from_tensor(load_format="flattened_bucket") when one
    process holds every tensor (all TP workers read this process's GPU).

    One serialized {"flattened_tensor": uint8 tensor, "metadata": [metadata_cls]} per SGLang TP rank (each rank
    deserializes its own copy). metadata_cls is sglang's FlattenedTensorMetadata; serialize is
    MultiprocessingSerializer.serialize (CUDA tensors travel as IPC handles, not copies).
    """
    flat, metadata = flatten_bucket(bucket)
    payload = {"flattened_tensor": flat, "metadata": [metadata_cls(**m) for m in metadata]}
    return [serialize(payload) for _ in range(tp_size)]


def local_ipc_payloads(
    bucket: Sequence[tuple[str, Tensor]], metadata_cls: Callable[..., Any], serialize: Callable[[Any], bytes]
) -> tuple[list[bytes], list[Tensor]]:
    """This rank's share of a colocated update: its copy of the bucket flattened per dtype, on its own GPU.

    Returns (payloads, flats): payloads[k] = serialize({"flattened_tensor": flats[k], "metadata": [...]}) for the
    k-th dtype group of `split_by_dtype(bucket)` (flats[k] uint8 [bytes of the group], on the tensors' device).
    The caller keeps `flats` alive until SGLang has loaded them (a CUDA IPC handle does not own the memory).
    """
    payloads, flats = [], []
    for group in split_by_dtype(bucket):
        flat, metadata = flatten_bucket(group)
        payloads.append(serialize({"flattened_tensor": flat, "metadata": [metadata_cls(**m) for m in metadata]}))
        flats.append(flat)
    return payloads, flats


class ColocatedWeightUpdate:
    """Weight updates of one colocated SGLang engine with tensor_parallel = t, on EVERY rank of its rollout group.

        actor ranks r .. r+t-1 (GPU i = SGLang TP worker i's GPU), each holding the full exported bucket:
            flatten per dtype on its GPU -> serialize (CUDA IPC handle, no copy) --all-gather (gloo, wire)--> rank r
        rank r: Engine.update_weights_from_tensor(named_tensors=[payload of r, of r+1, ...], "flattened_bucket")
            SGLang TP worker i deserializes entry i (tp_worker.deserialize_own_rank) and reads GPU i only
        barrier (gloo): every worker has loaded; each rank frees its flattened copy

    Without it every TP worker reads the engine rank's GPU (one GPU serves t readers over NVLink). Use it as the
    `engine` of WeightSync on every rank of the group: engine is the SGLangEngine on rank r, None on the others.

    Args:
        engine: SGLangEngine on the group's first rank, else None.
        group: gloo group of the t ranks (None when t == 1); the payloads cross it in wire.py's encoding (the bytes
            inside are SGLang's own serialization, which its TP worker unpickles: SGLang's trust, not ours).
        metadata_cls, serialize, patch_reductions: SGLang's FlattenedTensorMetadata, MultiprocessingSerializer.
            serialize and monkey_patch_torch_reductions (IPC handles name the GPU by UUID), or test doubles.
    """

    def __init__(
        self,
        engine: Any,
        group: Any,
        *,
        metadata_cls: Callable[..., Any],
        serialize: Callable[[Any], bytes],
        patch_reductions: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.group = group
        self._metadata_cls = metadata_cls
        self._serialize = serialize
        self._patch_reductions = patch_reductions

    def begin_weight_update(self) -> None:
        self._patch_reductions()  # before any serialize on this rank
        if self.engine is not None:
            self.engine.begin_weight_update()

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Hand this rank's copy of `bucket` to the TP worker on its GPU (collective over the group)."""
        import torch.distributed as dist

        payloads, flats = local_ipc_payloads(bucket, self._metadata_cls, self._serialize)
        if self.group is None:
            per_rank = [payloads]
        else:  # bytes in wire's encoding (gather_object would pickle the list); SGLang's payloads are its own
            per_rank = wire.all_gather_values(payloads, self.group, dist.get_world_size(self.group))
        if self.engine is not None:
            for k in range(len(payloads)):  # one call per dtype group; entry i is TP worker i's own GPU
                self.engine.update_weights_from_payloads([p[k] for p in per_rank])
        if self.group is not None:
            dist.barrier(group=self.group)  # every TP worker has copied from every GPU
        del flats

    def end_weight_update(self, *, full: bool = True) -> None:
        if self.engine is not None:
            self.engine.end_weight_update(full=full)


def colocated_weight_update(engine: Any, rank: int, world_size: int, tensor_parallel: int) -> ColocatedWeightUpdate:
    """The ColocatedWeightUpdate of this rank: builds one gloo group per engine (ranks r .. r+t-1 for every
    r % t == 0; collective: every rank must call it, in the same order) and returns this rank's."""
    import torch.distributed as dist
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    t = tensor_parallel
    mine = None
    if t > 1:
        for start in range(0, world_size, t):
            group = dist.new_group(list(range(start, start + t)), backend="gloo")
            if start <= rank < start + t:
                mine = group
    return ColocatedWeightUpdate(
        engine,
        mine,
        metadata_cls=FlattenedTensorMetadata,
        serialize=MultiprocessingSerializer.serialize,
        patch_reductions=monkey_patch_torch_reductions,
    )


def _ok(result: Any, what: str) -> None:
    """Raise WeightUpdateError when an SGLang call reports (False, message)."""
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise WeightUpdateError(f"sglang {what} failed: {result[1]}")
    if isinstance(result, dict) and result.get("success") is False:
        raise WeightUpdateError(f"sglang {what} failed: {result.get('message')}")


def mark_dead_on_sigquit(tokenizer_manager: Any, on_death: Callable[..., None]) -> None:
    """Make SGLang's running-phase SIGQUIT handler call on_death(signum, frame) instead of killing the process tree:
    TokenizerManager builds its handler from `signal_handler_class` when its event loop starts (SGLang 0.5.23)."""
    base = tokenizer_manager.signal_handler_class

    class MarkDead(base):  # type: ignore[misc, valid-type]
        def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
            on_death(signum, frame)

    tokenizer_manager.signal_handler_class = MarkDead


class SGLangEngine(EngineStream):
    """Colocated SGLang: an offline sglang.Engine on this process's GPUs (base_gpu_id .. + rollout.tensor_parallel).

    Create it on the first rank of each rollout group; that rank receives the full HF tensors from the actor
    export and hands them to SGLang through CUDA IPC (no copy). SGLang's load_weights shards them for its TP.
    From the launch's RolloutConfig it reads tensor_parallel, mem_fraction (mem_fraction_static),
    max_running_requests, deterministic_inference (SGLang's enable_deterministic_inference: batch-invariant kernels,
    pytorch sampler; only with it does SGLang 0.5.23 honour each request's sampling_seed, SamplingBatchInfo ignores
    it otherwise) and weight_dtype ("fp8" serves block-FP8 linear layers, see rollout/fp8.py).
    """

    def __init__(self, launch: EngineLaunch) -> None:
        import sglang
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        rollout = launch.config
        args = {
            "model_path": launch.model_path,
            "tp_size": rollout.tensor_parallel,
            "mem_fraction_static": rollout.mem_fraction,
            "enable_memory_saver": True,
            "skip_tokenizer_init": True,
            "dtype": launch.dtype,
            "base_gpu_id": launch.base_gpu_id,
            "random_seed": launch.seed,
        }
        if rollout.deterministic_inference:  # per-request sampling_seed is ignored without it (docs/rollout.md)
            args["enable_deterministic_inference"] = True
        if rollout.max_running_requests > 0:
            args["max_running_requests"] = rollout.max_running_requests
        self.routed_shape = launch.routed_shape
        if launch.routed_shape is not None:  # actor.routing_replay r3: results carry meta_info.routed_experts
            args["enable_return_routed_experts"] = True
        # A child process of SGLang that fails (or that SGLang's SubprocessWatchdog finds dead) sends this process
        # SIGQUIT, and SGLang's handlers answer by killing the whole process tree: this trainer with it. Ours mark the
        # engine dead instead, and the stream restarts it in place (EngineDied; docs/rollout.md, "Engine failures"):
        # the launch phase's handler is a ServerArgs field, the running phase's the TokenizerManager's
        # signal_handler_class (its running_phase_sigquit_handler), set below before the first request installs it.
        self._dead: str | None = None
        args["custom_sigquit_handler"] = self._child_died
        if rollout.weight_dtype == "fp8":
            # Block-FP8 linear layers (weight float8_e4m3fn + weight_scale_inv per 128x128 block) need the served
            # config to carry this quantization_config; the bf16 checkpoint cannot fill FP8 parameters, so the engine
            # starts from dummy weights and the trainer syncs before the first rollout (rollout/fp8.py).
            import json

            from megatron_dapo.rollout.fp8 import SGLANG_FP8_QUANTIZATION_CONFIG

            args["json_model_override_args"] = json.dumps({"quantization_config": SGLANG_FP8_QUANTIZATION_CONFIG})
            args["load_format"] = "dummy"
        # SGLang spawns its scheduler processes with this process's environment; under torchrun they would inherit
        # TORCHELASTIC_USE_AGENT_STORE and hang in their tcp:// rendezvous (launch_env.py).
        with scrubbed_environ():
            self._engine = sglang.Engine(**checked("ServerArgs", args), **launch.extra)
        mark_dead_on_sigquit(self._engine.tokenizer_manager, self._child_died)
        self.tp_size = rollout.tensor_parallel
        self._metadata_cls = FlattenedTensorMetadata
        self._serialize = MultiprocessingSerializer.serialize
        self._patch_reductions = monkey_patch_torch_reductions
        self._released: set[str] = set()
        self._session = False
        # Rows SGLang runs at once: what the stream hands this engine before its other requests would only queue.
        self._init_stream(rollout.max_running_requests)

    def _query_max_running(self) -> int:
        """SGLang's effective max_running_requests (asked when the stream first needs it)."""
        return effective_max_running(self._call("get_server_info"))

    def _child_died(self, signum: Any = None, frame: Any = None) -> None:
        """SIGQUIT from a child of SGLang (a scheduler or detokenizer failed): the engine is dead (EngineStream raises
        EngineDied at its next call)."""
        self._dead = "a child process of SGLang failed (SIGQUIT from SGLang's scheduler, detokenizer or watchdog)"

    def _call(self, method: str, **kwargs: Any) -> Any:
        return getattr(self._engine, method)(**checked(f"Engine.{method}", kwargs))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """len(prompts) * params.n Rollouts, grouped by prompt (the stream's calls, blocking)."""
        return generate_blocking(self, prompts, params)

    def begin_weight_update(self) -> None:
        """Restore weight memory if released, then open SGLang's update session where it exists (>= 0.5.23)."""
        self.resume_memory(["weights"])  # a no-op under the choreography (it resumes them before the sync)
        self._patch_reductions()  # SGLang's own fix so IPC handles name the GPU by UUID, not by index
        if hasattr(self._engine, "begin_weight_update"):
            _ok(self._call("begin_weight_update"), "begin_weight_update")
        self._session = True

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Send one bucket, flattened per dtype, as CUDA-IPC payloads of this process's GPU (every TP worker reads
        it); SGLang copies it into its sharded weights. With tensor_parallel > 1 prefer ColocatedWeightUpdate, where
        each TP worker reads the GPU it shares with its actor rank."""
        for group in split_by_dtype(bucket):
            self.update_weights_from_payloads(
                flattened_bucket_payloads(group, self.tp_size, self._metadata_cls, self._serialize)
            )

    def update_weights_from_payloads(self, payloads: Sequence[bytes]) -> None:
        """One Engine.update_weights_from_tensor(load_format="flattened_bucket") call: payloads[i] (a serialized
        {"flattened_tensor", "metadata"} dict) is what SGLang TP worker i deserializes (tp_worker.deserialize_own_rank
        indexes the list by its tp_rank)."""
        if len(payloads) != self.tp_size:
            raise ValueError(f"SGLangEngine: {len(payloads)} payloads for rollout.tensor_parallel={self.tp_size}")
        result = self._call(
            "update_weights_from_tensor",
            named_tensors=list(payloads),
            load_format="flattened_bucket",
            flush_cache=False,
        )
        _ok(result, "update_weights_from_tensor")

    def end_weight_update(self, *, full: bool = True) -> None:
        """Close the session and flush the radix cache (the KV cache stays released until resume_memory).

        SGLang cannot list which parameters a bucket covered, so `full` is not checked here; the actor's export
        covers every parameter by construction (tested with the transformers engine).
        """
        if self._session and hasattr(self._engine, "end_weight_update"):
            _ok(self._call("end_weight_update"), "end_weight_update")
        self._session = False
        self._call("flush_cache")

    def release_memory(self, tags: Sequence[str]) -> None:
        """Engine.release_memory_occupation(tags) for the regions not released yet.

        SGLang 0.5.23 (scheduler_components/weight_updater.py) pauses each tag's torch_memory_saver region: the
        physical memory is freed, the weights' contents are lost (no CPU backup: the next sync rewrites them), the
        KV cache is flushed. It asserts the engine is idle, so call it between generations only.
        """
        todo = [t for t in ENGINE_TAGS if t in tags and t not in self._released]
        if todo:
            self._call("release_memory_occupation", tags=todo)
            self._released |= set(todo)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Engine.resume_memory_occupation(tags) for the released ones (SGLang raises KeyError on a tag that was
        not released, so only those are sent)."""
        todo = [t for t in ENGINE_TAGS if t in tags and t in self._released]
        if todo:
            self._call("resume_memory_occupation", tags=todo)
            self._released -= set(todo)

    def shutdown(self) -> None:
        """Stop SGLang's scheduler processes."""
        self._call("shutdown")


# ---------------------------------------------------------------------------------------------- server mode


def init_weight_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    *,
    rank: int = 0,
    backend: str = "nccl",
    timeout: timedelta = timedelta(minutes=10),
) -> Any:
    """The trainer's side of SGLang's weight-update group (rank 0; servers join at rank_offset >= 1).

    It must meet SGLang's receiver in the same TCP rendezvous and store prefixes: the store of a tcp:// rendezvous
    on master_address:master_port (rank 0 hosts it), a PrefixStore named group_name, and torch's process-group
    constructor under that group name. Returns a ProcessGroup for torch.distributed.broadcast.
    The store is built by launch_env.rendezvous_store, not dist.rendezvous: under torchrun the latter reads
    TORCHELASTIC_USE_AGENT_STORE=True and makes rank 0 a client of a store nobody hosts.
    Works with backend "gloo" on CPU (tested, also under torchrun); "nccl" needs GPUs.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = rendezvous_store(master_address, master_port, rank, world_size, timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(  # same constructor SGLang's receiver uses
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


GROUP_PREFIX = "megatron_dapo_weights_"
"""The start of every weight-update group name this package creates on SGLang servers (a unique suffix follows)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SGLangServerEngine(ServerStream):
    """Disaggregated SGLang: HTTP servers on other nodes; weights by NCCL broadcast from this trainer rank.

    server_urls: base URLs; server_tp: tensor-parallel size of each server (for the update group's world size).
    master_address / master_port: this rank's address reachable from the servers (make_engine resolves it with
    launch_env.weight_sync_master_address: loopback is refused for remote servers), and a free port.
    timeout_s: HTTP request timeout; group_timeout_s: rendezvous and collective timeout of the update group;
    backend: its torch backend ("nccl"; "gloo" for CPU tests). group_name: None (the default) names the group
    uniquely per instance: servers outlive a job, and a server keeps the groups it joined, so a restarted job (a
    requeue, distributed.max_restarts) joining under a name the server already holds would be refused by torch
    ("The specified group name has already been created"); `shutdown` asks the servers to destroy the group.
    gpu: the CUDA device NCCL sends from (None: the calling thread's current one; an engine rank's relay thread
    sends from its local GPU, engine_rank.relay_group). delta_loader: the updates may carry changed elements
    (WeightDelta entries, rollout.weight_sync_delta), loaded by rollout/sglang_loader.py inside the servers, which
    must be started with `--custom-weight-loader` naming it (checked at the first update, one line). fp8: the
    updates are rollout.weight_dtype "fp8"'s stream (float8_e4m3fn weights and their fp32 block scales), which the
    servers must serve as block FP8 (`--json-model-override-args` carrying rollout/fp8.SGLANG_FP8_QUANTIZATION_CONFIG:
    checked at the first update, one line; a server holding bf16 projections would load the FP8 values without
    their scales).
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        server_tp: int = 1,
        master_address: str = "127.0.0.1",
        master_port: int = 29600,
        group_name: str | None = None,
        timeout_s: float = 3600.0,
        group_timeout_s: float = 600.0,
        backend: str = "nccl",
        max_running_requests: int = 0,
        delta_loader: bool = False,
        fp8: bool = False,
        gpu: int | None = None,
    ) -> None:
        if not server_urls:
            raise ValueError("SGLangServerEngine: server_urls is empty")
        self.urls = [u.rstrip("/") for u in server_urls]
        self.server_tp = server_tp
        self.master_address, self.master_port = master_address, master_port
        self.group_name = group_name or f"{GROUP_PREFIX}{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.group_timeout = timedelta(seconds=group_timeout_s)
        self.backend = backend
        self.gpu = gpu
        self._group = None
        self._session_routes = True
        self._update_version: str | None = None
        self.delta_loader, self.fp8 = delta_loader, fp8
        self._servers_checked = False
        self._delta_version: int | None = None  # the delta-mode version this update writes (None: plain tensors)
        self._init_stream(max_running_requests)

    def _query_max_running(self) -> int:
        """The smallest server's effective max_running_requests (the stream balances rows over the servers)."""
        return min(effective_max_running(self._get(u, "/get_server_info")) for u in self.urls)

    def _get(self, url: str, route: str) -> Any:
        if ROUTE_BODY.get(route, "") is not None:
            raise KeyError(f"sglang_engine: GET route {route} is not listed in SGLANG_API")
        try:
            with urllib.request.urlopen(url + route, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"sglang server {url}{route}: HTTP {err.code} {err.read()[:300]!r}") from None

    def _post(self, url: str, route: str, body: dict | None = None, data: bytes | None = None) -> Any:
        """POST `body` (its JSON: `data` when given, already encoded) to a server's route; its JSON answer."""
        body_cls = ROUTE_BODY.get(route, "")
        if body_cls == "":
            raise KeyError(f"sglang_engine: route {route} is not listed in SGLANG_API")
        if body_cls is not None and body:
            checked(body_cls, body)
        data = data if data is not None else json.dumps(body or {}).encode()
        req = urllib.request.Request(url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"sglang server {url}{route}: HTTP {err.code} {err.read()[:300]!r}") from None
        try:
            return json.loads(raw or b"null")
        except ValueError:  # /flush_cache answers with plain text
            return raw.decode(errors="replace")

    def _post_all(self, route: str, body: dict | None = None, data: bytes | None = None) -> list[Any]:
        with ThreadPoolExecutor(len(self.urls)) as pool:
            return list(pool.map(lambda u: self._post(u, route, body, data), self.urls))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """len(prompts) * params.n Rollouts, grouped by prompt (the stream's calls, blocking)."""
        return generate_blocking(self, prompts, params)

    def begin_weight_update(self) -> None:
        """Create the NCCL update group on first use (servers join concurrently), then open server sessions."""
        if not self._servers_checked:
            self._check_servers()
        if self._group is None:
            self._group = self._join_group()
        self._delta_version = None
        if self._session_routes:
            try:
                self._post_all("/begin_weight_update", {})
            except RuntimeError as err:  # servers older than 0.5.23 have no session routes
                if "HTTP 404" not in str(err):
                    raise
                self._session_routes = False

    def _join_group(self) -> Any:
        """This process as rank 0 of the servers' weight-update group, the servers' TP ranks after it. Each server
        answers its /init_weights_update_group once the group stands, or at once with its refusal: a refusal is one
        line naming the server and its message, not a wait for the rendezvous to time out (this side's rendezvous,
        on a daemon thread, is left to its timeout; the job ends)."""
        world = 1 + self.server_tp * len(self.urls)
        answers: dict[int, Any] = {}

        def join(j: int, url: str) -> None:
            body = {"master_address": self.master_address, "master_port": self.master_port,
                    "rank_offset": 1 + j * self.server_tp, "world_size": world, "group_name": self.group_name,
                    "backend": self.backend}  # fmt: skip
            try:
                answers[j] = self._post(url, "/init_weights_update_group", body)
            except Exception as err:  # an HTTP 400 carries SGLang's message
                answers[j] = err

        made: list[Any] = []

        def make() -> None:
            try:
                made.append(init_weight_update_group(self.master_address, self.master_port, world, self.group_name,
                                                     backend=self.backend, timeout=self.group_timeout))  # fmt: skip
            except BaseException as err:  # raised below
                made.append(err)

        threads = [threading.Thread(target=join, args=(j, u), daemon=True) for j, u in enumerate(self.urls)]
        threads.append(threading.Thread(target=make, daemon=True))
        for t in threads:
            t.start()
        # Whichever side fails first ends the wait: a refusing server, or this side (its port taken), whose servers
        # would otherwise answer only at their own rendezvous timeout.
        while any(t.is_alive() for t in threads[:-1]) and not any(isinstance(a, Exception) for a in answers.values()):
            if made and isinstance(made[0], BaseException):
                raise made[0]
            time.sleep(0.05)
        for j in sorted(answers):
            if isinstance(answers[j], Exception):
                raise RuntimeError(f"sglang server {self.urls[j]} did not join weight-update group "
                                   f"{self.group_name}: {answers[j]}")  # fmt: skip
            _ok(answers[j], "init_weights_update_group")
        threads[-1].join()
        if isinstance(made[0], BaseException):
            raise made[0]
        return made[0]

    def _check_servers(self) -> None:
        """With delta_loader, every server lists the delta loader among its custom weight loaders (SGLang would end
        the server on a load_format it does not know: a NotImplementedError in its scheduler); with fp8, every server
        serves the block-FP8 layout the updates carry."""
        from megatron_dapo.rollout.fp8 import SGLANG_FP8_QUANTIZATION_CONFIG
        from megatron_dapo.rollout.sglang_loader import LOADER

        for url in self.urls if self.delta_loader or self.fp8 else []:
            info = self._get(url, "/get_server_info")
            if self.delta_loader and LOADER not in (info.get("custom_weight_loader") or []):
                why = "which rollout.weight_sync_delta needs to apply changed weights inside it"
                raise WeightUpdateError(f"sglang server {url}: started without --custom-weight-loader {LOADER}, {why}")
            if self.fp8:
                served = json.loads(info.get("json_model_override_args") or "{}").get("quantization_config") or {}
                wanted = {k: SGLANG_FP8_QUANTIZATION_CONFIG[k] for k in ("quant_method", "weight_block_size")}
                if {k: served.get(k) for k in wanted} != wanted:
                    override = json.dumps({"quantization_config": SGLANG_FP8_QUANTIZATION_CONFIG})
                    raise WeightUpdateError(f"sglang server {url}: serves quantization_config {served or 'none'}, "
                                            f"but rollout.weight_dtype fp8 sends block-FP8 weights; start it with "
                                            f"--json-model-override-args '{override}' --load-format dummy")  # fmt: skip
        self._servers_checked = True

    def update_weights(self, bucket: Sequence[tuple[str, Tensor | WeightDelta]]) -> None:
        """Announce the bucket to every server over HTTP, then broadcast each tensor from rank 0 (NCCL). WeightDelta
        entries (delta_loader): full ones go the same way, changed elements by POST /update_weights_from_tensor."""
        full, changed = [], []
        for name, t in bucket:
            if isinstance(t, WeightDelta):
                self._delta_version = t.version
                (full if t.index is None else changed).append((name, t.values if t.index is None else t))
            else:
                full.append((name, t))
        if changed:
            self._post_changed(changed)
        if full:
            self._broadcast(full)

    def _post_changed(self, changed: list[tuple[str, WeightDelta]]) -> None:
        """One /update_weights_from_tensor call per server carrying these deltas, with each tensor's shape (the
        loader traces where a name's elements land the first time), to its loader."""
        from megatron_dapo.rollout.delta import as_plain_tensors
        from megatron_dapo.rollout.sglang_loader import SHAPE_SUFFIX

        if not self.delta_loader:
            raise WeightUpdateError(f"sglang servers: tensor {changed[0][0]!r} is a delta but this engine was not "
                                    "built with delta_loader")  # fmt: skip
        entries: list[tuple[str, Tensor]] = []
        for name, delta in changed:
            entries.append((name + SHAPE_SUFFIX, torch.tensor(delta.shape, dtype=torch.int64)))
            entries.extend(as_plain_tensors([(name, delta)]))
        self._post_loader(entries, changed[0][1].version, changed[0][1].base, end=False)

    def _post_loader(self, entries: list[tuple[str, Tensor]], version: int, base: int | None, *, end: bool) -> None:
        """One call of the delta loader on every server: the body encoded once, the same bytes to each."""
        from megatron_dapo.rollout.sglang_loader import body_bytes
        from megatron_dapo.rollout.sglang_loader import request_body

        body = request_body(entries, version=version, base=base, end=end, server_tp=self.server_tp)
        if self._update_version is not None:  # stamp the tokens, as the broadcast's announcement does
            body["weight_version"] = self._update_version
        for r in self._post_all("/update_weights_from_tensor", body, body_bytes(body)):
            _ok(r, "update_weights_from_tensor")

    def _broadcast(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        import torch.distributed as dist

        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [_dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,
        }
        if self._update_version is not None:  # an update while generating (paused_update): stamp its tokens
            body["weight_version"] = self._update_version
        # NCCL sends from the GPU: an engine rank relaying the direct route's rebuilt tensors holds them in host
        # memory, so one bucket at a time goes to its GPU (actor rank 0's export is already there).
        nccl = dist.get_backend(self._group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device() if self.gpu is None else self.gpu) if nccl else None
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(self._post_all, "/update_weights_from_distributed", body)
            for _, t in bucket:
                t = t.to(device).contiguous() if device else t.contiguous()
                # NCCL broadcasts float8 (torch maps it to ncclFloat8e4m3 or ncclUint8); gloo has no float8 type, so
                # on CPU both ends send the bytes (dev/cpu_sglang_server.py receives them the same way).
                wire = t.view(torch.uint8) if not nccl and t.dtype == torch.float8_e4m3fn else t
                dist.broadcast(wire, group_src=0, group=self._group)
            for r in pending.result():
                _ok(r, "update_weights_from_distributed")

    def end_weight_update(self, *, full: bool = True) -> None:
        """Close the server sessions (if any) and flush their radix caches. After a delta-mode update (WeightDelta
        entries) the loaders first learn it completed: the version the next deltas may build on."""
        if self._delta_version is not None:
            self._post_loader([], self._delta_version, None, end=True)
            self._delta_version = None
        if self._session_routes:
            self._post_all("/end_weight_update", {})
        self._post_all("/flush_cache")

    @contextmanager
    def paused_update(self, version: int) -> Iterator[None]:
        """An update while the servers generate (asynchronous training): inside, begin/update/end_weight_update as
        usual. The servers pause in PAUSE_MODE (running requests back to their queue, tokens kept), the update sets
        their weight_version to `version` (each request in flight records the change at its length: the result's
        weight-version spans, parsed into its segments), the flush in end_weight_update drops the old weights'
        cache, and /continue_generation prefills the paused requests again under the new weights. A /generate call
        in flight just takes longer; a failed update still continues the servers before it raises."""
        from megatron_dapo.rollout.sglang_api import PAUSE_MODE

        try:  # a pause refused by one server still continues the others
            self._post_all("/pause_generation", {"mode": PAUSE_MODE})
            self._update_version = str(int(version))
            yield
        finally:
            self._update_version = None
            self._post_all("/continue_generation", {})
        self.weight_version = int(version)

    def release_memory(self, tags: Sequence[str]) -> None:
        """No-op: the servers own their GPUs."""

    def resume_memory(self, tags: Sequence[str]) -> None:
        """No-op: the servers own their GPUs."""

    def shutdown(self) -> None:
        """Destroy the update group on this side and ask every server to destroy its side (best effort: a server gone
        is no error; a job killed outright leaves its group on the servers, under its own name); the servers keep
        running."""
        if self._group is not None:
            import torch.distributed as dist

            for url in self.urls:
                try:
                    self._post(url, "/destroy_weights_update_group", {"group_name": self.group_name})
                except Exception:  # the server may be gone or already restarted
                    pass
            dist.destroy_process_group(self._group)
            self._group = None
