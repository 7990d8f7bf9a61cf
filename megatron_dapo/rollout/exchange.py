"""Rollout object exchange between ranks on a host (gloo) group with an explicit generation timeout.

    engine ranks:     the rollout stream (minutes) ------------------> all_gather(the carry, per-rank stream stats)
    ranks without:    follow the stream's decisions, then all_gather -^
    after sampling:   all_to_all(token rows) -> each rank receives only the rows its DP rank trains on

A rank that leaves the stream first waits inside the gather for the others. On the default NCCL group that wait is a
GPU kernel spinning on the GPUs SGLang is decoding on, and it ends only at the job's collective timeout
(distributed.timeout_minutes) with NCCL's watchdog message. Here the wait is a blocking socket read in gloo, the
objects (encoded by wire.py: data only, no pickle) never touch a GPU, and the group's own timeout
(rollout.generation_timeout_minutes) ends it with one line that says what was waited for.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.errors import first_line


class ExchangeTimeout(RuntimeError):
    """A rank did not reach the rollout exchange within the generation timeout."""


class RolloutExchange:
    """all_gather / all_to_all of Python values (wire.py's types) over a gloo group of every rank (build it on every
    rank, in the same order).

    timeout_s: how long a rank may wait for the slowest rank's generation (config: rollout.generation_timeout_minutes)
    setting: the config field timeout_s comes from, named when it expires (evaluation has its own group and field)
    world_size: ranks in the job; with 1 nothing is created and all_gather returns its input.
    """

    def __init__(
        self, world_size: int, *, timeout_s: float, setting: str = "rollout.generation_timeout_minutes"
    ) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.setting = setting
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world_size > 1 else None
        self.bytes_sent = 0
        self.bytes_received = 0

    def barrier(self) -> None:
        """A barrier over the group's ranks (a CPU wait on gloo: no NCCL kernel on an engine's GPU)."""
        if self.group is not None:
            dist.barrier(group=self.group)

    def all_gather(self, items: list[Any], what: str = "rollouts") -> list[Any]:
        """Concatenate every rank's list of items (wire.py's types) in rank order (the same result on every rank):
        each rank's list encoded (wire.dumps, never pickle), sizes all-gathered, then the padded bytes.

        Raises ExchangeTimeout (one line) when some rank has not arrived within timeout_s.
        """
        if self.group is None:
            return list(items)
        try:
            per_rank = wire.all_gather_values(items, self.group, self.world_size)
        except RuntimeError as err:
            raise self._timeout(err, what) from None
        return [item for part in per_rank for item in part]

    def all_to_all(self, per_rank: list[list[Any]], what: str = "rollout rows") -> list[Any]:
        """Send per_rank[r] (a list of items, wire.py's types) to rank r; return what every rank sent to this one,
        concatenated in source-rank order. Only the bytes addressed to a rank reach it (two gloo all_to_all_single
        calls: sizes, then the encoded bytes); `bytes_received` / `bytes_sent` hold the last call's totals.

        Raises ExchangeTimeout (one line) when some rank has not arrived within timeout_s.
        """
        if len(per_rank) != self.world_size:
            raise ValueError(f"RolloutExchange.all_to_all: expected {self.world_size} lists, got {len(per_rank)}")
        if self.group is None:
            self.bytes_sent = self.bytes_received = 0
            return list(per_rank[0])
        blobs = [wire.dumps(items) for items in per_rank]
        send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        recv_sizes = torch.empty(self.world_size, dtype=torch.int64)
        try:
            dist.all_to_all_single(recv_sizes, send_sizes, group=self.group)
            send = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)
            recv = torch.empty(max(int(recv_sizes.sum()), 1), dtype=torch.uint8)
            dist.all_to_all_single(
                recv[: int(recv_sizes.sum())] if int(recv_sizes.sum()) else recv[:0],
                send[: int(send_sizes.sum())] if int(send_sizes.sum()) else send[:0],
                output_split_sizes=recv_sizes.tolist(),
                input_split_sizes=send_sizes.tolist(),
                group=self.group,
            )
        except RuntimeError as err:
            raise self._timeout(err, what) from None
        self.bytes_sent, self.bytes_received = int(send_sizes.sum()), int(recv_sizes.sum())
        out: list[Any] = []
        for part in recv[: self.bytes_received].split(recv_sizes.tolist()):
            out.extend(wire.loads(part.numpy().tobytes()))
        return out

    def _timeout(self, err: RuntimeError, what: str) -> Exception:
        text = str(err)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            return err
        return ExchangeTimeout(
            f"rollout exchange ({what}): not every rank arrived within {self.setting}="
            f"{self.timeout_s / 60:g} (a rank's generation ran longer, or a rank died: see its log); "
            f"gloo: {first_line(err)}"
        )

    def close(self) -> None:
        """Destroy the group (optional; the default group's destruction also ends it)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
