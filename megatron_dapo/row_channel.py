"""A split launch's step data off the store (issue 39 item 3): each step's rows go from engine rank 0 to the actor
ranks over a gloo group of their own, each actor rank receiving only the rows it trains on.

    engine rank 0 (RowServer)                              actor rank r (RowClient)
      hold(step, groups) after the step's generation;        reads gen/<step> from the store (summaries, metrics,
      its thread, for each request on the store:             data position, carry: no rows), builds the same RowPlan
        rows/<step>/<r> = {rows: [[group key, response]],    as every actor rank, posts its request, waits for
                           layers: its stage's MoE layers}     ready/<step>/<r> (polling the engine's liveness and
        -> posts ready/<step>/<r>, sends [bytes], then         the preemption flag), then receives [bytes] and the
           the step and the Rollouts (wire.py: no pickle)      step and its Rollouts
      a step is let go once every actor rank took it or
      asked for a later one (it dropped it: a preemption)

The store keeps small control messages only (a request is a few bytes per row). Before, engine rank 0 posted every
kept row on the store and every actor rank read all of them: A x the step's bytes through the one TCP connection of
the store's host. The server is a thread so that the rows go out whatever engine rank 0's main thread is doing
(generating ahead, or inside a collective of the engine ranks that waits on weights these rows will train).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.errors import JobError
from megatron_dapo.errors import first_line
from megatron_dapo.placement import JOIN_S
from megatron_dapo.placement import POLL_S
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup

PREFIX = "megatron_dapo/rows/"
"""Key prefix of the requests, the ready marks and the group on the launch's store."""
POSTED = "posted"
"""A counter every request adds to: the server's thread looks at the requests only when it moved (or a step was
held since), one store call per poll instead of one per actor rank and held step."""
_TAG = 39


def rows_group(num_actor_ranks: int, group_rank: int, store: dist.Store, timeout_s: float) -> Any:
    """The gloo group of the actor ranks (group ranks 0..A-1) and engine rank 0 (group rank A); every member builds it
    at start-up (the constructor connects them)."""
    return dist.ProcessGroupGloo(
        dist.PrefixStore(f"{PREFIX}group/", store), group_rank, num_actor_ranks + 1, timedelta(seconds=timeout_s)
    )


def _stopped(step: int, who: str, err: RuntimeError) -> JobError:
    """A transfer of a step's rows that gloo ended (the group's timeout, distributed.timeout_minutes, or a closed
    connection): one retryable line naming the peer."""
    return JobError(f"step {step}'s rows: {who} stopped answering in the transfer (distributed.timeout_minutes; "
                    f"gloo: {first_line(err)})", retryable=True)  # fmt: skip


class RowServer:
    """Engine rank 0's side (see the module docstring). store: the launch's store; timeout_s: the group's
    (distributed.timeout_minutes: a transfer an actor rank stopped answering ends with one line)."""

    def __init__(self, num_actor_ranks: int, store: dist.Store, timeout_s: float, group: Any = None) -> None:
        self.actors = num_actor_ranks
        self.store = dist.PrefixStore(PREFIX, store.clone())  # the thread's own connection (the main thread's waits)
        self.group = group if group is not None else rows_group(num_actor_ranks, num_actor_ranks, store, timeout_s)
        self._held: dict[int, dict[str, RolloutGroup]] = {}
        self._seen = -1
        """POSTED when the thread last looked at the requests (-1: look now); hold() resets it."""
        self._taken: dict[int, set[int]] = {}
        """Per held step, the actor ranks that took it (or asked for a later step)."""
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._run, name="row-server", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def hold(self, step: int, groups: dict[str, RolloutGroup]) -> None:
        """Keep `step`'s kept groups (by key) for the actor ranks' requests (main thread). Raises the thread's error."""
        if self._error is not None:
            raise self._error
        with self._lock:
            self._held[step], self._taken[step] = groups, set()
            self._seen = -1

    def _run(self) -> None:
        try:
            while not self._closed:
                posted = self.store.add(POSTED, 0)
                if posted == self._seen or not self._serve(posted):
                    time.sleep(POLL_S)
        except BaseException as err:  # surfaced on the main thread by hold()
            self._error = err

    def _serve(self, posted: int) -> bool:
        """Answer every request on the store for a held step (`posted`: POSTED before the look); True when one was
        answered."""
        with self._lock:
            steps = sorted(self._held)
            self._seen = posted  # a hold() after this resets it: the next poll looks again
        served = False
        for step in steps:
            for rank in range(self.actors):
                key = f"{step}/{rank}"
                with self._lock:
                    taken = self._taken.get(step)
                if taken is None:  # let go: every rank took it, or asked for a later step
                    break
                if rank in taken or not self.store.check([key]):
                    continue
                request = wire.load_stored(self.store.get(key), f"the row request {PREFIX}{key} on the launch's store")
                rows = self._rows(step, rank, request)
                payload = torch.frombuffer(bytearray(wire.dumps([step, rows])), dtype=torch.uint8)
                # The request is answered from here: consumed and counted before the rank can see its rows.
                self.store.delete_key(key)
                self._let_go(step, rank)
                self.bytes_sent += payload.numel()
                self.store.set(f"ready/{key}", "1")
                try:
                    self.group.send([torch.tensor([payload.numel()], dtype=torch.int64)], rank, _TAG).wait()
                    self.group.send([payload], rank, _TAG).wait()
                except RuntimeError as err:  # gloo: the actor rank stopped inside the transfer
                    raise _stopped(step, f"actor rank {rank}", err) from None
                served = True
        return served

    def _rows(self, step: int, rank: int, request: Any) -> list[Rollout]:
        """The Rollouts a request names, each with only its stage's MoE layers; one line for a malformed request."""
        what = f"actor rank {rank}'s row request for step {step}"
        if not isinstance(request, dict) or not isinstance(request.get("rows"), list):
            raise JobError(f"{what} on the launch's store is not a mapping with a 'rows' list")
        layers = request.get("layers")
        if layers is not None and not (isinstance(layers, list) and len(layers) == 2):
            raise JobError(f"{what}: 'layers' must be [first, count] or null")
        groups, out = self._held[step], []
        for item in request["rows"]:
            if not (isinstance(item, list) and len(item) == 2 and item[0] in groups and isinstance(item[1], int)):
                raise JobError(f"{what} names a row this engine rank does not hold: {str(item)[:80]}")
            rollouts = groups[item[0]].rollouts
            if not 0 <= item[1] < len(rollouts):
                raise JobError(f"{what} names response {item[1]} of a group of {len(rollouts)}")
            out.append(rollouts[item[1]].routing_layers(None if layers is None else tuple(layers)))
        return out

    def _let_go(self, step: int, rank: int) -> None:
        """`rank` took `step`: it will not ask for an earlier one (those it dropped); a step every rank is past goes."""
        with self._lock:
            for held in [s for s in self._held if s <= step]:
                self._taken[held].add(rank)
                if len(self._taken[held]) == self.actors:
                    del self._held[held], self._taken[held]

    def close(self) -> None:
        """Stop the thread and join it (idempotent; also at interpreter exit)."""
        self._closed = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)
        atexit.unregister(self.close)


class RowClient:
    """An actor rank's side (see the module docstring)."""

    def __init__(self, rank: int, num_actor_ranks: int, store: dist.Store, timeout_s: float, group: Any = None) -> None:
        self.rank, self.server = rank, num_actor_ranks
        self.store = dist.PrefixStore(PREFIX, store)
        self.group = group if group is not None else rows_group(num_actor_ranks, rank, store, timeout_s)
        self.bytes_received = 0

    def take(
        self, step: int, rows: list[tuple[str, int]], layers: tuple[int, int] | None, poll: Callable[[], None]
    ) -> list[Rollout] | None:
        """Rows (group key, response index) of `step`, in that order, with `layers` of their MoE routing. poll() is
        called while engine rank 0 has not answered: it raises to end the wait (JobError: the engine rank is silent),
        or returns False to give the rows up (a preemption signal): then None."""
        key = f"{step}/{self.rank}"
        self.store.set(key, wire.dumps({"rows": [[k, i] for k, i in rows], "layers": list(layers) if layers else None}))
        self.store.add(POSTED, 1)  # the server's thread looks at the requests when this moves
        while not self.store.check([f"ready/{key}"]):
            if poll() is False:
                return None
            time.sleep(POLL_S)
        size = torch.empty(1, dtype=torch.int64)
        try:
            self.group.recv([size], self.server, _TAG).wait()
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            self.group.recv([payload], self.server, _TAG).wait()
        except RuntimeError as err:  # gloo: the engine rank stopped inside the transfer
            raise _stopped(step, "engine rank 0", err) from None
        self.store.delete_key(f"ready/{key}")
        self.bytes_received += payload.numel()
        sent = wire.load_stored(payload.numpy().tobytes(), f"step {step}'s rows from engine rank 0")
        if not (isinstance(sent, list) and len(sent) == 2 and sent[0] == step and isinstance(sent[1], list)):
            raise JobError(f"step {step}'s rows from engine rank 0: not the rows of step {step}")
        if len(sent[1]) != len(rows) or not all(isinstance(r, Rollout) for r in sent[1]):
            raise JobError(f"step {step}'s rows from engine rank 0: {len(sent[1])} rollouts for {len(rows)} rows")
        return sent[1]
