"""Rollout object exchange between ranks on a host (gloo) group with an explicit generation timeout.

    engine ranks:     generate (minutes) ----------------------------> all_gather(local groups) --> every group
    ranks without:    all_gather([]) ... wait in gloo, on the CPU ...-^

Ranks without an engine (and engine ranks that finish early) wait inside this gather for the whole generation
round. On the default NCCL group that wait is a GPU kernel spinning on the GPUs SGLang is decoding on, and it ends
only at the job's collective timeout (distributed.timeout_minutes) with NCCL's watchdog message. Here the wait
is a blocking socket read in gloo, pickled objects never touch a GPU, and the group's own timeout
(rollout.generation_timeout_minutes) ends it with one line that says what was waited for.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


class ExchangeTimeout(RuntimeError):
    """A rank did not reach the rollout exchange within the generation timeout."""


class RolloutExchange:
    """all_gather of Python objects over a gloo group of every rank (build it on every rank, in the same order).

    timeout_s: how long a rank may wait for the slowest rank's generation (config: rollout.generation_timeout_minutes)
    world_size: ranks in the job; with 1 nothing is created and all_gather returns its input.
    """

    def __init__(self, world_size: int, *, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world_size > 1 else None

    def all_gather(self, items: list[Any], what: str = "rollouts") -> list[Any]:
        """Concatenate every rank's list of picklable items in rank order (the same result on every rank).

        Raises ExchangeTimeout (one line) when some rank has not arrived within timeout_s.
        """
        if self.group is None:
            return list(items)
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, items, group=self.group)
        except RuntimeError as err:
            text = str(err)
            if "timed out" not in text.lower() and "timeout" not in text.lower():
                raise
            raise ExchangeTimeout(
                f"rollout exchange ({what}): not every rank arrived within rollout.generation_timeout_minutes="
                f"{self.timeout_s / 60:g} (a rank's generation ran longer, or a rank died: see its log); "
                f"gloo: {text.splitlines()[0][:200]}"
            ) from None
        return [x for part in out for x in part]

    def close(self) -> None:
        """Destroy the group (optional; the default group's destruction also ends it)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
