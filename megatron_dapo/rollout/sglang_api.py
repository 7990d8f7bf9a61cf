"""The contract with SGLang's source: every SGLang name megatron_dapo uses (Engine methods and their keyword
arguments, ServerArgs fields, sampling parameters, HTTP routes, request fields) is listed once in SGLANG_API; calls
go through checked(), which refuses a name not listed there, and tests/rollout/test_sglang_adapter.py checks the
list against SGLang's source with `ast`. Also the translation of requests and results both SGLang engines share
(sglang_engine.py, sglang_stream.py). sglang itself is not imported here. Supported versions: SGLANG_VERSIONS.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.rollout.base import RoutedShape
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import request_result
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout

SGLANG_VERSIONS = ("0.5.15", "0.5.23")
"""Oldest and newest SGLang release whose source was checked against SGLANG_API (CI pins the newest)."""

ENGINE = ("srt/entrypoints/engine.py",)
SERVER_ARGS = ("srt/server_args.py", "srt/arg_groups/fields/*.py")  # 0.5.23 split ServerArgs into namespaces
IO_STRUCT = ("srt/managers/io_struct.py",)
TOKENIZER_MANAGER = ("srt/managers/tokenizer_manager.py",)
HTTP = ("srt/entrypoints/http_server.py",)


@dataclass(frozen=True)
class ApiUse:
    """One SGLang name we depend on.

    kind: "params" (owner "Class.method", names = keyword arguments we pass), "fields" (owner a class, or "*" for
    any class in files, names = annotated fields), "route" (owner an HTTP path, names = (request class,) or ()),
    "literals" (names = substrings of string constants in files), "attributes" (owner a class, names = attributes its
    methods assign on self).
    files: globs relative to the sglang package directory. optional: absent in older releases; used via hasattr.
    """

    kind: str
    files: tuple[str, ...]
    owner: str
    names: tuple[str, ...]
    optional: bool = False


ROUTED_EXPERTS_KEY = "routed_experts"
"""meta_info key of a result's routed experts (requests with return_routed_experts; 0.5.23)."""
MAX_RUNNING_KEY = "effective_max_running_requests_per_dp"
"""The scheduler's internal-state key of its effective max_running_requests (0.5.23)."""
WEIGHT_VERSIONS_KEY = "weight_versions"
"""meta_info key of a finished request's weight-version spans [{"version", "start", "end"}] over its output tokens
(0.5.23, srt/utils/weight_versions.py): a request in flight when an update set a new weight_version gets a span per
version; the version strings are whatever the updates set (ours: the step number), "default" before any."""
PAUSE_MODE = "retract"
"""/pause_generation mode for an update while generating (0.5.23, io_struct.PauseGenerationReqInput): running
requests go back to the queue with their tokens, so the prefix cache can be flushed under the pause (a scheduler
paused in that mode ignores its queue when asked whether it is idle) and they are prefilled again under the new
weights on /continue_generation. "in_place" would keep their KV, and the old weights' radix cache, which the next
requests of the same prompts would reuse: computed by weights no version stamp records."""

WEIGHT_UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"
PARALLEL_STATE = "srt/distributed/parallel_state.py"

SGLANG_API: tuple[ApiUse, ...] = (
    ApiUse(
        "params",
        ENGINE,
        "Engine.async_generate",
        ("input_ids", "sampling_params", "return_logprob", "rid", "return_routed_experts"),
    ),
    ApiUse("params", ENGINE, "Engine.get_server_info", ()),
    ApiUse("params", TOKENIZER_MANAGER, "TokenizerManager.abort_request", ("rid", "abort_all")),
    ApiUse("literals", ("srt/managers/scheduler_components/*.py",), "*", (MAX_RUNNING_KEY,)),
    ApiUse("params", ENGINE, "Engine.update_weights_from_tensor", ("named_tensors", "load_format", "flush_cache")),
    ApiUse("params", ENGINE, "Engine.release_memory_occupation", ("tags",)),
    ApiUse("params", ENGINE, "Engine.resume_memory_occupation", ("tags",)),
    ApiUse("params", ENGINE, "Engine.flush_cache", ()),
    ApiUse("params", ENGINE, "Engine.shutdown", ()),
    ApiUse("params", ENGINE, "Engine.begin_weight_update", (), optional=True),
    ApiUse("params", ENGINE, "Engine.end_weight_update", (), optional=True),
    ApiUse(
        "fields",
        SERVER_ARGS,
        "*",
        (
            "model_path",
            "tp_size",
            "mem_fraction_static",
            "enable_memory_saver",
            "skip_tokenizer_init",
            "dtype",
            "base_gpu_id",
            "random_seed",
            "enable_deterministic_inference",
            "json_model_override_args",
            "load_format",
            "max_running_requests",
            "custom_sigquit_handler",
            "enable_return_routed_experts",
            "custom_weight_loader",
        ),
    ),
    # The running phase's SIGQUIT handler: TokenizerManager builds it from this class attribute (sglang_engine.py).
    ApiUse("attributes", TOKENIZER_MANAGER, "TokenizerManager", ("signal_handler_class",)),
    ApiUse("params", TOKENIZER_MANAGER, "SignalHandler.running_phase_sigquit_handler", ("signum", "frame")),
    ApiUse(
        "fields",
        ("srt/sampling/sampling_params.py",),
        "SamplingParams",
        ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "no_stop_trim", "sampling_seed"),
    ),
    ApiUse(
        "fields",
        IO_STRUCT,
        "GenerateReqInput",
        ("input_ids", "sampling_params", "return_logprob", "rid", "return_routed_experts"),
    ),
    # meta_info["routed_experts"]: base64 of int32 [seqlen - 1, num_hidden_layers, top_k] (state_capturer/
    # routed_experts.py extract_routed_experts_from_meta_info; encoded by the tokenizer / detokenizer managers).
    ApiUse("literals", ("srt/managers/tokenizer_manager.py",), "*", (ROUTED_EXPERTS_KEY,)),
    ApiUse("fields", IO_STRUCT, "AbortReq", ("rid", "abort_all")),  # rid is inherited from BaseReq
    ApiUse(
        "fields",
        IO_STRUCT,
        "InitWeightsUpdateGroupReqInput",
        ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    ),
    ApiUse("fields", IO_STRUCT, "DestroyWeightsUpdateGroupReqInput", ("group_name",)),
    ApiUse(
        "fields",
        IO_STRUCT,
        "UpdateWeightsFromDistributedReqInput",
        ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format", "weight_version"),
    ),
    ApiUse(
        "fields",
        IO_STRUCT,
        "UpdateWeightsFromTensorReqInput",
        ("serialized_named_tensors", "load_format", "flush_cache", "weight_version"),
    ),
    ApiUse("fields", IO_STRUCT, "PauseGenerationReqInput", ("mode",)),
    ApiUse("fields", IO_STRUCT, "ContinueGenerationReqInput", ("torch_empty_cache",)),
    ApiUse("literals", IO_STRUCT, "*", (PAUSE_MODE,)),
    ApiUse("literals", ("srt/utils/weight_versions.py",), "*", (WEIGHT_VERSIONS_KEY,)),
    ApiUse("fields", IO_STRUCT, "BeginWeightUpdateReqInput", (), optional=True),
    ApiUse("fields", IO_STRUCT, "EndWeightUpdateReqInput", (), optional=True),
    ApiUse("route", HTTP, "/generate", ("GenerateReqInput",)),
    ApiUse("route", HTTP, "/abort_request", ("AbortReq",)),
    ApiUse("route", HTTP, "/get_server_info", ()),
    ApiUse("route", HTTP, "/init_weights_update_group", ("InitWeightsUpdateGroupReqInput",)),
    ApiUse("route", HTTP, "/destroy_weights_update_group", ("DestroyWeightsUpdateGroupReqInput",)),
    ApiUse("route", HTTP, "/update_weights_from_distributed", ("UpdateWeightsFromDistributedReqInput",)),
    ApiUse("route", HTTP, "/update_weights_from_tensor", ("UpdateWeightsFromTensorReqInput",)),
    ApiUse("route", HTTP, "/flush_cache", ()),
    ApiUse("route", HTTP, "/pause_generation", ("PauseGenerationReqInput",)),
    ApiUse("route", HTTP, "/continue_generation", ("ContinueGenerationReqInput",)),
    ApiUse("route", HTTP, "/begin_weight_update", ("BeginWeightUpdateReqInput",), optional=True),
    ApiUse("route", HTTP, "/end_weight_update", ("EndWeightUpdateReqInput",), optional=True),
    ApiUse(
        "fields",
        ("srt/weight_sync/tensor_bucket.py",),
        "FlattenedTensorMetadata",
        ("name", "shape", "dtype", "start_idx", "end_idx", "numel"),
    ),
    ApiUse("params", ("srt/utils/common.py",), "MultiprocessingSerializer.serialize", ("obj",)),
    ApiUse("params", ("srt/utils/patch_torch.py",), "monkey_patch_torch_reductions", ()),
    # The receiver of load_format="flattened_bucket" reads these two keys of the payload dict.
    ApiUse(
        "literals",
        ("srt/managers/*.py", "srt/model_executor/**/*.py"),
        "*",
        ("flattened_bucket", "flattened_tensor", "metadata"),
    ),
    # SGLang's restricted unpickler must admit our FlattenedTensorMetadata objects, and the delta loader's payload:
    # plainly pickled CPU tensors (rollout/sglang_loader.py).
    ApiUse("literals", ("srt/utils/common.py",), "*", ("sglang.srt.weight_sync.tensor_bucket",)),
    ApiUse("literals", ("srt/utils/common.py",), "*", ("_rebuild_tensor_v2", "_load_from_bytes")),
    # The custom-loader seam the delta loader plugs into: each TP rank its own payload entry, then the loader.
    ApiUse("fields", (WEIGHT_UPDATER,), "WeightUpdater", ("custom_weight_loaders",)),
    # The loader hands TP rank 0's entries to the other ranks over the server's TP group.
    ApiUse("params", (PARALLEL_STATE,), "get_tp_group", ()),
    ApiUse("params", (PARALLEL_STATE,), "GroupCoordinator.broadcast_tensor_dict", ("tensor_dict", "src")),
    ApiUse(
        "params", ("srt/managers/tp_worker.py",), "BaseTpWorker.deserialize_own_rank", ("serialized_named_tensors",)
    ),
)

_ALLOWED: dict[str, frozenset[str]] = {use.owner: frozenset(use.names) for use in SGLANG_API if use.owner != "*"}
_ALLOWED["ServerArgs"] = frozenset(next(u.names for u in SGLANG_API if u.files == SERVER_ARGS))
ROUTE_BODY: dict[str, str | None] = {
    u.owner: (u.names[0] if u.names else None) for u in SGLANG_API if u.kind == "route"
}


def checked(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return kwargs after checking that every key is listed for owner in SGLANG_API (no drift from the test)."""
    allowed = _ALLOWED.get(owner)
    if allowed is None:
        raise KeyError(f"sglang_engine: {owner!r} is not listed in SGLANG_API")
    extra = sorted(set(kwargs) - allowed)
    if extra:
        raise KeyError(f"sglang_engine: {owner} argument {extra[0]!r} is not listed in SGLANG_API")
    return kwargs


def request_input_ids(request: GenerationRequest) -> list[int]:
    """What SGLang is asked to continue: the prompt, then the tokens a carried (partial) response already has."""
    ids = request.prompt_ids.tolist()
    return ids if request.prefix is None else ids + request.prefix.response_ids.tolist()


def sampling_params_dicts(requests: Sequence[GenerationRequest], params: SamplingParams) -> list[dict]:
    """One SGLang sampling-params dict per request.

    top_k 0 (disabled) becomes SGLang's -1; each request gets its own sampling_seed (honoured under deterministic
    inference only, docs/rollout.md); max_new_tokens is what the cap leaves after a carried prefix; no_stop_trim
    keeps the stop token in the output ids.
    """
    rows = []
    for req in requests:
        row = {
            "max_new_tokens": params.max_new_tokens - (0 if req.prefix is None else len(req.prefix)),
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": list(params.stop_token_ids),
            "no_stop_trim": True,
            "sampling_seed": req.seed,
        }
        rows.append(checked("SamplingParams", row))
    return rows


def parse_sglang_output(
    out: dict,
    request: GenerationRequest,
    want_logprobs: bool,
    version: int,
    *,
    allow_abort: bool = False,
    routed_shape: RoutedShape | None = None,
) -> Rollout:
    """One SGLang generate result (a dict with "output_ids" and "meta_info") -> the request's Rollout.

    meta_info.output_token_logprobs is a list of (logprob, token_id, text) over every generated token;
    meta_info.finish_reason is {"type": "stop" | "length" | "abort", "matched": ...}. An abort is an error unless
    allow_abort (the stream aborted it: the tokens so far come back unfinished). routed_shape: the request asked for
    routed experts; meta_info.routed_experts is decoded (`decode_routed_experts`).
    """
    meta = out.get("meta_info", {})
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length") and not (allow_abort and kind == "abort"):
        raise RuntimeError(f"sglang: generation ended with finish_reason {reason!r}")
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs:
        ids = [int(t[1]) for t in token_logprobs]
        logps: list[float] | None = [float(t[0]) for t in token_logprobs]
    else:
        ids, logps = [int(t) for t in out.get("output_ids", [])], None
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if kind == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
        raise RuntimeError(f"sglang: response does not end with its stop token {matched} (set no_stop_trim)")
    if want_logprobs and logps is None and ids:
        raise RuntimeError("sglang: no output_token_logprobs in the result (return_logprob was set)")
    version, versions = _weight_versions(meta.get(WEIGHT_VERSIONS_KEY), version, len(ids))
    routed = None
    if routed_shape is not None:
        routed = decode_routed_experts(meta.get(ROUTED_EXPERTS_KEY), routed_shape, len(request_input_ids(request)) +
                                       len(ids) - 1)  # fmt: skip
    return request_result(
        request, ids, logps if want_logprobs else None, FinishReason(kind), version, routed, versions=versions
    )


def _weight_versions(spans: list[dict] | None, version: int, num_ids: int) -> tuple[int, list[tuple[int, int]]]:
    """(version, versions) for request_result from meta_info.weight_versions: the server's own stamps when every span
    names a version our updates set (an integer), else `version` (the engine's) for every token. A request whose
    weights changed under it to or from a version we did not set is an error: its tokens could not be attributed."""
    if not spans:
        return version, []
    starts = [(int(s["start"]), s["version"]) for s in spans if int(s["start"]) < num_ids or int(s["start"]) == 0]
    ours = [v.isdigit() for _, v in starts]
    if not any(ours):
        if len(starts) > 1:
            raise RuntimeError(f"sglang: weights changed during a request under versions {starts} none of which an "
                               "update of this trainer set")  # fmt: skip
        return version, []
    if not all(ours):
        raise RuntimeError(f"sglang: a request's weight versions {starts} mix ours with ones this trainer did not set")
    return int(starts[-1][1]), [(start, int(v)) for start, v in starts]


def decode_routed_experts(encoded: str | None, shape: RoutedShape, positions: int) -> Tensor:
    """SGLang's meta_info.routed_experts (base64 of int32 [positions, layers, k], positions = prompt + output tokens
    - 1: the last token is never fed; SGLang's capturer holds a row per decoder layer, indexed by layer id) ->
    [positions, MoE layers, k] uint8 (<= 256 experts) / int16 (Rollout.routed_experts: the dense layers' unfilled
    rows dropped). A missing or mis-sized value is a RuntimeError naming the server flag."""
    if not encoded:
        raise RuntimeError(
            "sglang: no routed_experts in the result; the engine must run with enable_return_routed_experts "
            "(server mode: --enable-return-routed-experts)"
        )
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    layers, k = shape.layers, shape.topk
    if flat.numel() != positions * layers * k:
        raise RuntimeError(
            f"sglang: routed_experts holds {flat.numel()} ids, expected {positions} positions x {layers} layers x "
            f"top-{k}"
        )
    routed = flat.view(positions, layers, k)[:, shape.dense_layers :]
    return routed.to(torch.uint8 if shape.experts <= 256 else torch.int16)


def effective_max_running(server_info: dict) -> int:
    """Rows one SGLang scheduler runs at once, from Engine.get_server_info() / GET /get_server_info: its first
    data-parallel rank's internal state "effective_max_running_requests_per_dp" (0.5.23,
    scheduler_components/internal_state.py)."""
    try:
        return int(server_info["internal_states"][0][MAX_RUNNING_KEY])
    except (KeyError, IndexError, TypeError, ValueError):
        raise RuntimeError(
            f"sglang: server info has no internal_states[0][{MAX_RUNNING_KEY!r}]; set rollout.max_running_requests"
        ) from None
