"""Per-step weight sync: full HF-named tensors from the actor, in size-bounded buckets, into a rollout engine.

    MegatronActor.export_hf_weights() --(hf_name, full tensor)*--> WeightSync.sync
        [rollout.weight_dtype "fp8": fp8.quantize_named_tensors, linear weights -> e4m3 + 128x128 scale_inv]
        --bucket_named_tensors (<= bucket_bytes each)--> engine.begin_weight_update()
                                                         engine.update_weights(bucket) per bucket
                                                         engine.end_weight_update(full=True)

On ranks that hold no engine (engine=None) sync() still drains the iterator: the actor's export may be
collective (TP/PP gathers), so every rank must walk it in step.

With delta (rollout.weight_sync_delta) each tensor travels as a delta.WeightDelta: only its changed elements against
what the engine received last, or the full tensor where that is no smaller; every full_every-th sync, the first one,
and the one after a failed sync or `reset` (an engine restart) are full (rollout/delta.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Iterator

from torch import Tensor

from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.delta import DeltaEncoder
from megatron_dapo.rollout.delta import WeightDelta
from megatron_dapo.rollout.delta import payload_bytes

MiB = 1 << 20


def tensor_bytes(t: Tensor | WeightDelta) -> int:
    """Size of a tensor's elements in bytes (a WeightDelta: what it sends)."""
    return payload_bytes(t)


LOADED_TOGETHER = (("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa."),)
"""Tensors an engine loads only in one call: SGLang 0.5.23's DeepSeek loader (deepseek_common/deepseek_weight_loader.py,
do_load_weights) fuses a layer's q_a_proj and kv_a_proj_with_mqa (weights, and their FP8 scales) into
fused_qkv_a_proj_with_mqa once both are in the same load_weights call, and drops one left alone when the call ends."""


def _partner(name: str) -> str | None:
    """The name that must share a bucket with `name` (LOADED_TOGETHER), when `name` is the first of a pair."""
    for first, second in LOADED_TOGETHER:
        if first in name:
            return name.replace(first, second)
    return None


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, Tensor | WeightDelta]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor | WeightDelta]]]:
    """Group (name, tensor) pairs, in order, into lists of at most bucket_bytes bytes.

    A tensor larger than bucket_bytes gets a bucket of its own; a pair of LOADED_TOGETHER is never split (the bucket
    stays open past the bound until the second arrives). Consumes the input lazily, so at most one bucket of tensors
    is alive at a time.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_named_tensors: bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    waiting: set[str] = set()  # second halves of pairs whose first half is in the bucket
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes and not waiting:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        waiting.discard(name)
        partner = _partner(name)
        if partner is not None:
            waiting.add(partner)
    if bucket:
        yield bucket


class WeightSync:
    """Push the actor's weights into a rollout engine once per step.

    engine: a RolloutEngine, or None on ranks that only take part in the actor's export.
    bucket_bytes: size bound of one bucket (RolloutConfig.weight_sync_bucket_mb MiB).
    delta: changed-weights sync (rollout.weight_sync_delta; engines whose update takes delta.WeightDelta entries);
    full_every: with delta, every full_every-th sync is full (rollout.weight_sync_full_every; 0: only when needed).
    """

    def __init__(
        self,
        engine: RolloutEngine | None,
        bucket_bytes: int = 512 * MiB,
        weight_dtype: str = "auto",
        *,
        delta: bool = False,
        full_every: int = 0,
    ) -> None:
        from megatron_dapo.rollout.fp8 import WEIGHT_DTYPES

        if bucket_bytes < 1:
            raise ValueError(f"WeightSync.bucket_bytes: must be >= 1, got {bucket_bytes}")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"rollout.weight_dtype: unknown {weight_dtype!r}; choose one of {list(WEIGHT_DTYPES)}")
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.weight_dtype = weight_dtype
        """"auto": tensors as exported; "fp8": linear weights quantized per 128 x 128 block (rollout/fp8.py)."""
        self.encoder = DeltaEncoder(full_every) if delta else None
        self.num_syncs = 0

    def reset(self) -> None:
        """The engine's weights came from elsewhere (a restarted engine's resync): the next sync is full."""
        if self.encoder is not None:
            self.encoder.reset()

    def _encoded(self, named_tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, WeightDelta]]:
        """Every tensor as this sync's WeightDelta (full on the first sync, after a reset and every full_every)."""
        self.encoder.start()
        for name, tensor in named_tensors:
            yield name, self.encoder.encode(name, tensor, self.num_syncs)

    def sync(self, named_tensors: Iterable[tuple[str, Tensor]], *, full: bool = True) -> dict[str, float]:
        """Send every (hf_name, full tensor) to the engine; returns metrics.

        named_tensors: e.g. MegatronActor.export_hf_weights(); tensors are full (un-sharded) HF-layout weights.
        full: the update must cover every engine parameter (checked by the engine at the end).
        With weight_dtype "fp8" the linear weights travel as float8_e4m3fn plus fp32 block scales, and the bytes
        metric counts what was sent (about half of bf16, a quarter of fp32, for the linear layers).
        Returns {"weight_sync/bytes", "weight_sync/seconds", "weight_sync/gb_per_s", "weight_sync/num_buckets",
        "weight_sync/num_tensors"} (GB = 1e9 bytes; seconds include the export time of the iterator); with delta also
        "weight_sync/changed_fraction" (elements sent as changed or in full tensors, of all).
        """
        start = time.perf_counter()
        total_bytes = 0
        num_buckets = 0
        num_tensors = 0
        engine = self.engine
        if self.weight_dtype == "fp8":
            from megatron_dapo.rollout.fp8 import quantize_named_tensors

            # Every rank walks the export (collective); only engine ranks need the quantized tensors.
            named_tensors = quantize_named_tensors(named_tensors) if engine is not None else named_tensors
        self.num_syncs += 1
        delta = self.encoder is not None and engine is not None
        if delta:
            named_tensors = self._encoded(named_tensors)
        try:
            if engine is not None:
                engine.begin_weight_update()
            for bucket in bucket_named_tensors(named_tensors, self.bucket_bytes):
                num_buckets += 1
                num_tensors += len(bucket)
                total_bytes += sum(tensor_bytes(t) for _, t in bucket)
                if engine is not None:
                    engine.update_weights(bucket)
            if engine is not None:
                engine.end_weight_update(full=full)
        except BaseException:
            self.reset()  # the copies are a mix of two versions now: the next sync is full
            raise
        if delta:
            self.encoder.version = self.num_syncs
        seconds = time.perf_counter() - start
        extra = {"weight_sync/changed_fraction": self.encoder.pop_fraction()} if delta else {}
        return {
            **extra,
            "weight_sync/bytes": float(total_bytes),
            "weight_sync/seconds": seconds,
            "weight_sync/gb_per_s": total_bytes / 1e9 / seconds if seconds > 0 else 0.0,
            "weight_sync/num_buckets": float(num_buckets),
            "weight_sync/num_tensors": float(num_tensors),
        }
