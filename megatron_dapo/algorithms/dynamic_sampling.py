r"""Dynamic Sampling (DAPO section 3.2): train only on prompt groups with 0 < accuracy < 1, refilling the batch.

    gen batch 1 --groups--> admit (0<acc<1) --kept--> [ accumulator ] --target reached--> train batch
    gen batch 2 --groups--> admit            --kept-->       ^                 \--surplus--> dropped or carried
    ...                  (all-correct / all-wrong groups counted, then dropped)

The admission rule looks at the verifier's accuracy, never at the shaped (overlong-penalised) score.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Generic
from typing import TypeVar

import torch
from torch import Tensor

P = TypeVar("P")

_log = logging.getLogger(__name__)

ON_MAX_GEN_BATCHES = ("error", "partial")


def group_is_informative(accs: Tensor) -> bool:
    """True if the group's accuracy is strictly between 0 and 1 (its advantages are not all zero).

    Args:
        accs: [G] bool or {0,1} float, the verifier's per-response correctness.
    """
    if accs.numel() == 0:
        return False
    mean = accs.to(torch.float32).mean().item()
    return 0.0 < mean < 1.0


@dataclass
class Group(Generic[P]):
    """One prompt with its G responses. `accs` [G] bool; `payload` is whatever the trainer needs later."""

    accs: Tensor
    payload: P


class DynamicSamplingError(RuntimeError):
    pass


@dataclass
class _Counts:
    gen_batches: int = 0
    prompts_sampled: int = 0
    prompts_admitted: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    carried_in: int = 0


@dataclass
class DynamicSampler(Generic[P]):
    """Accumulates informative groups across generation batches until `target_prompts` are held.

    Args:
        target_prompts: prompts per training batch (DAPO: 512).
        enabled: False reproduces plain GRPO batching: one generation batch, every group kept.
        max_gen_batches: stop after this many generation batches in one step (default 10, as the DAPO recipe; 0 =
            unlimited: the loop then ends only when the target is met or the generator returns no groups, and spins
            for as long as every group is all-correct or all-wrong).
        on_max_gen_batches: "error" raises DynamicSamplingError stating the counts; "partial" trains on what was kept.
        keep_surplus: admitted groups beyond the target are kept for the next step (default: dropped, as DAPO does).
        log: receives one line per extra generation round (the second and later of a step); default: this module's
            logger at INFO.
    """

    target_prompts: int
    enabled: bool = True
    max_gen_batches: int = 10
    on_max_gen_batches: str = "error"
    keep_surplus: bool = False
    log: Callable[[str], None] | None = None
    _carry: list[Group[P]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.target_prompts < 1:
            raise ValueError(f"target_prompts must be >= 1, got {self.target_prompts}")
        if self.max_gen_batches < 0:
            raise ValueError(f"max_gen_batches must be >= 0 (0 = unlimited), got {self.max_gen_batches}")
        if self.on_max_gen_batches not in ON_MAX_GEN_BATCHES:
            raise ValueError(f"on_max_gen_batches must be one of {ON_MAX_GEN_BATCHES}, got {self.on_max_gen_batches!r}")

    @classmethod
    def from_config(
        cls, algorithm: Any, target_prompts: int, log: Callable[[str], None] | None = None
    ) -> DynamicSampler:
        """A sampler for the `algorithm` config section (dynamic_sampling, max_gen_batches, on_max_gen_batches,
        keep_surplus are read)."""
        return cls(
            target_prompts=target_prompts,
            enabled=algorithm.dynamic_sampling,
            max_gen_batches=algorithm.max_gen_batches,
            on_max_gen_batches=algorithm.on_max_gen_batches,
            keep_surplus=algorithm.keep_surplus,
            log=log,
        )

    def collect(self, generate: Callable[[int], Sequence[Group[P]]]) -> tuple[list[Group[P]], dict[str, float]]:
        """Run one step's sampling.

        Args:
            generate: called with the number of prompts still missing; returns one generation batch of groups (the
                trainer decides its size, e.g. always the full prompt batch as DAPO does). An empty result means the
                data source is exhausted.
        Returns:
            (groups for training, at most target_prompts of them; metrics of this step).
        """
        kept: list[Group[P]] = list(self._carry)
        self._carry = []
        counts = _Counts(carried_in=len(kept))
        while len(kept) < self.target_prompts:
            if self.max_gen_batches and counts.gen_batches >= self.max_gen_batches:
                if self.on_max_gen_batches == "error":
                    raise DynamicSamplingError(
                        f"dynamic sampling reached max_gen_batches={self.max_gen_batches}: kept {len(kept)} of "
                        f"{self.target_prompts} prompts after sampling {counts.prompts_sampled} "
                        f"({counts.all_correct} all-correct, {counts.all_wrong} all-wrong groups); raise "
                        f"algorithm.max_gen_batches or set algorithm.on_max_gen_batches=partial"
                    )
                break
            if counts.gen_batches >= 1:
                cap = self.max_gen_batches or "unlimited"
                (self.log or _log.info)(
                    f"dynamic sampling: generation round {counts.gen_batches + 1} (of at most {cap}): kept "
                    f"{len(kept)} of {self.target_prompts} prompts after {counts.prompts_sampled} sampled "
                    f"({counts.all_correct} all-correct, {counts.all_wrong} all-wrong groups)"
                )
            groups = list(generate(self.target_prompts - len(kept)))
            if not groups:
                break
            counts.gen_batches += 1
            kept.extend(self._admit(groups, counts))
            if not self.enabled:
                break
        batch, surplus = kept[: self.target_prompts], kept[self.target_prompts :]
        if self.keep_surplus:
            self._carry = surplus
        return batch, self._metrics(counts, len(batch), len(surplus))

    def _admit(self, groups: list[Group[P]], counts: _Counts) -> list[Group[P]]:
        admitted = []
        for group in groups:
            counts.prompts_sampled += 1
            acc = group.accs.to(torch.float32).mean().item() if group.accs.numel() else 0.0
            counts.all_correct += int(group.accs.numel() > 0 and acc == 1.0)
            counts.all_wrong += int(acc == 0.0)
            if not self.enabled or group_is_informative(group.accs):
                counts.prompts_admitted += 1
                admitted.append(group)
        return admitted

    def _metrics(self, counts: _Counts, num_kept: int, num_surplus: int) -> dict[str, float]:
        return {
            "sampling/gen_batches": float(counts.gen_batches),
            "sampling/prompts_sampled": float(counts.prompts_sampled),
            "sampling/prompts_kept": float(num_kept),
            "sampling/groups_all_correct": float(counts.all_correct),
            "sampling/groups_all_wrong": float(counts.all_wrong),
            "sampling/prompts_per_useful": counts.prompts_sampled / max(counts.prompts_admitted, 1),
            "sampling/carried_in": float(counts.carried_in),
            "sampling/surplus": float(num_surplus),
        }

    def state_dict(self) -> dict[str, Any]:
        """Carried-over groups (only with keep_surplus); payloads must be picklable for checkpoints."""
        return {"carry": list(self._carry)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._carry = list(state["carry"])
