r"""Dynamic Sampling (DAPO section 3.2): train only on prompt groups with 0 < accuracy < 1, sampling until enough.

    prompt queue (positions 0, 1, 2, ... of one step) --engines, any order--> finished groups
        offer(position, group) ---> decided in queue order: position p is decided once 0..p-1 are
                                    admit (0 < acc < 1) -> kept        all-correct / all-wrong -> counted, dropped
        done when `target_prompts` groups are kept, or when every position below the cap is decided

Which groups are kept depends only on the groups at each queue position, never on the order in which engines
finish them: the first `target_prompts` useful groups in queue order (`decided` is the cut; positions after it
are the stream's to abort or carry). The admission rule looks at the verifier's accuracy, never at the shaped
(overlong-penalised) score.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Generic
from typing import Protocol
from typing import TypeVar

import torch
from torch import Tensor

from megatron_dapo.errors import JobError

ON_CAP = ("error", "partial")
MIN_FOR_ESTIMATE = 4
"""Decided positions after which a step's own keep ratio replaces the prior in StepSampling.ahead."""
MIN_KEEP = 0.05
"""Floor of the keep ratio StepSampling.ahead divides by (a step that has kept nothing yet)."""
"""What happens when the cap of sampled prompts is reached before the target (algorithm.on_max_gen_batches)."""


def group_is_informative(accs: Tensor) -> bool:
    """True if the group's accuracy is strictly between 0 and 1 (its advantages are not all zero).

    Args:
        accs: [G] bool or {0,1} float, the verifier's per-response correctness.
    """
    if accs.numel() == 0:
        return False
    mean = accs.to(torch.float32).mean().item()
    return 0.0 < mean < 1.0


class Scored(Protocol):
    """Anything with the verifier's per-response accuracy: accs [G] bool (a GroupSummary, a Group)."""

    accs: Tensor


P = TypeVar("P")


@dataclass
class Group(Generic[P]):
    """A minimal scored group for callers without rollout records (dev/simulate.py, tests): accs [G] bool + payload."""

    accs: Tensor
    payload: P


class DynamicSamplingError(JobError):
    """The step's sampling bound (prompts or time) stopped it short of its target, with on_cap "error"."""


@dataclass
class DynamicSampler:
    """The admission rule and its stopping point; `start()` opens one step's queue-order decision.

    Args:
        target_prompts: groups per training batch (DAPO: 512).
        enabled: False reproduces plain GRPO batching: every group is kept, the first target_prompts positions.
        max_sampled_prompts: queue positions a step may use (the stream hands out no position at or past it);
            0 = unlimited (the step then ends only at the target).
        on_cap: "error" raises DynamicSamplingError stating the counts; "partial" trains on what was kept.
        cap_name: how the cap is spelled in the error (the config fields it comes from).
    """

    target_prompts: int
    enabled: bool = True
    max_sampled_prompts: int = 0
    on_cap: str = "error"
    cap_name: str = "max_sampled_prompts"

    def __post_init__(self) -> None:
        if self.target_prompts < 1:
            raise ValueError(f"target_prompts must be >= 1, got {self.target_prompts}")
        if self.max_sampled_prompts < 0:
            raise ValueError(f"max_sampled_prompts must be >= 0 (0 = unlimited), got {self.max_sampled_prompts}")
        if self.on_cap not in ON_CAP:
            raise ValueError(f"on_cap must be one of {ON_CAP}, got {self.on_cap!r}")

    @classmethod
    def from_config(cls, algorithm: Any, trainer: Any) -> DynamicSampler:
        """A sampler for the `algorithm` and `trainer` config sections: target trainer.prompts_per_step, cap
        algorithm.max_gen_batches x trainer.gen_prompts_per_batch prompts (the bound the generation rounds had;
        0 batches = unlimited), on_cap algorithm.on_max_gen_batches."""
        cap = algorithm.max_gen_batches * trainer.gen_prompts_per_batch
        return cls(
            target_prompts=trainer.prompts_per_step,
            enabled=algorithm.dynamic_sampling,
            max_sampled_prompts=cap,
            on_cap=algorithm.on_max_gen_batches,
            cap_name=(
                f"algorithm.max_gen_batches={algorithm.max_gen_batches} x "
                f"trainer.gen_prompts_per_batch={trainer.gen_prompts_per_batch}"
            ),
        )

    def start(self) -> StepSampling:
        """A fresh decision for one step."""
        return StepSampling(self)


@dataclass
class StepSampling:
    """One step's decision in queue order (`DynamicSampler.start()`).

    offer(position, group) in any order; `decided` positions (0..decided-1) are decided; `done` once the target is
    kept or the cap reached; `result()` returns the kept groups in queue order and the step's metrics.
    """

    rule: DynamicSampler
    decided: int = 0
    kept: list[tuple[int, Scored]] = field(default_factory=list)
    all_correct: int = 0
    all_wrong: int = 0
    given_up: int = 0
    """Positions decided without a group: their prompt was given up after engine failures (rollout.prompt_retries)."""
    _pending: dict[int, Scored] = field(default_factory=dict)
    limit: int = 0
    """Queue positions the step may use after all, set by `stop_at` (0: only the rule's cap applies)."""
    limit_reason: str = ""

    @property
    def cap(self) -> int:
        """Queue positions this step may decide (0: unlimited): the rule's cap, lowered by `stop_at`."""
        caps = [c for c in (self.rule.max_sampled_prompts, self.limit) if c > 0]
        return min(caps) if caps else 0

    @property
    def done(self) -> bool:
        cap = self.cap
        return len(self.kept) >= self.rule.target_prompts or (cap > 0 and self.decided >= cap)

    def stop_at(self, positions: int, reason: str) -> None:
        """Decide no queue position at or past `positions` (a bound found while sampling, e.g. time; every rank
        must be given the same value); `reason` names it in the error of `result()`."""
        if self.limit == 0 or positions < self.limit:
            self.limit, self.limit_reason = max(positions, 0), reason

    def offer(self, position: int, group: Scored) -> None:
        """A finished group at queue `position` (each position offered at most once); decides as far as it can."""
        if position < self.decided or position in self._pending:
            raise ValueError(f"dynamic sampling: queue position {position} offered twice")
        self._pending[position] = group
        while not self.done and self.decided in self._pending:
            self._decide(self.decided, self._pending.pop(self.decided))
            self.decided += 1

    def _decide(self, position: int, group: Scored) -> None:
        if getattr(group, "dropped", False):  # given up after engine failures: neither kept nor filtered
            self.given_up += 1
            return
        accs = group.accs
        acc = accs.to(torch.float32).mean().item() if accs.numel() else 0.0
        self.all_correct += int(accs.numel() > 0 and acc == 1.0)
        self.all_wrong += int(acc == 0.0)
        if not self.rule.enabled or group_is_informative(accs):
            self.kept.append((position, group))

    def ahead(self, over_sampling: float, prior_keep: float) -> int:
        """Queue positions past the decided ones worth generating now: over_sampling x the groups still missing /
        the keep ratio (this step's once it has decided MIN_FOR_ESTIMATE positions, else prior_keep), at least 1
        while the step is undone. More in flight is work the cut is likely to abort; fewer, a later round trip."""
        if self.done:
            return 0
        missing = self.rule.target_prompts - len(self.kept)
        keep = 1.0 if not self.rule.enabled else prior_keep
        if self.rule.enabled and self.decided >= MIN_FOR_ESTIMATE:
            keep = len(self.kept) / self.decided
        return max(1, math.ceil(over_sampling * missing / max(keep, MIN_KEEP)))

    def undecided(self) -> list[tuple[int, Scored]]:
        """Offered groups past the cut (finished after the decision point), in queue order."""
        return sorted(self._pending.items())

    def result(self) -> tuple[list[Scored], dict[str, float]]:
        """(kept groups in queue order, metrics). Raises DynamicSamplingError when the cap stopped the step short
        of the target and on_cap is "error"."""
        if not self.done:
            raise RuntimeError("dynamic sampling: result() before the step's decision is done")
        kept = len(self.kept)
        if kept < self.rule.target_prompts and self.rule.on_cap == "error":
            if self.limit > 0 and self.cap == self.limit:  # a bound found while sampling (stop_at), e.g. time
                bound, fix = self.limit_reason, "raise it"
            else:
                bound = f"its cap of {self.rule.max_sampled_prompts} sampled prompts ({self.rule.cap_name})"
                fix = "raise algorithm.max_gen_batches"
            raise DynamicSamplingError(
                f"dynamic sampling reached {bound}: kept {kept} of {self.rule.target_prompts} prompts after sampling "
                f"{self.decided} ({self.all_correct} all-correct, {self.all_wrong} all-wrong groups); {fix} or set "
                "algorithm.on_max_gen_batches=partial"
            )
        return [g for _, g in self.kept], {
            "sampling/prompts_sampled": float(self.decided),
            "sampling/prompts_kept": float(kept),
            "sampling/groups_all_correct": float(self.all_correct),
            "sampling/groups_all_wrong": float(self.all_wrong),
            "sampling/prompts_per_useful": self.decided / max(kept, 1),
            "sampling/prompts_given_up": float(self.given_up),
        }


def sample_step(rule: DynamicSampler, generate: Callable[[int], Scored]) -> tuple[list[Scored], dict[str, float]]:
    """A whole step in one process, positions generated in order: `generate(position)` -> group (callers without
    engines: dev/simulate.py). The rule must have a cap (an unlimited one could spin forever)."""
    if rule.max_sampled_prompts == 0:
        raise ValueError("sample_step: the rule needs max_sampled_prompts > 0")
    step = rule.start()
    position = 0
    while not step.done:
        step.offer(position, generate(position))
        position += 1
    return step.result()
