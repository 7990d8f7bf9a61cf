"""One step's generation as a stream: a global prompt queue feeding every engine, groups decided in queue order.

    queue positions:  [carried 0..k-1 | fresh k, k+1, ... (the data in order)]     (one store counter, all ranks)
    engine rank:      while not decided: take the next position if the window allows (position < decided +
                      rollout.max_inflight_prompts, and below the cap) and its engine has a free slot -> submit G
                      requests; engine.step(); a group whose G responses finished is scored, published on the
                      store and offered to dynamic sampling
    every rank:       reads published groups in queue order -> StepSampling decides -> done at the target / cap
    at the cut:       in-flight work aborted (rollout.partial=false: its prompts return to the queue) or carried
                      into the next step with its tokens, engine log-probs and weight versions (partial=true)

The queue is a counter on a torch.distributed Store (a TCPStore hosted by rank 0; a HashStore in one process): any
engine rank takes the next position as capacity frees, so no rank waits for a static shard. Which groups are kept
does not depend on which rank finished first (StepSampling decides in queue order), and each response is seeded by
(seed, step, prompt index, sample), so with a batch-invariant engine (the embedded one on CPU,
rollout/slot_cache.py) the kept batch is the same whatever the timing. What does depend on timing: which rank
generated a group, the work wasted at the cut and, with rollout.partial, how far carried responses got (metrics
under "stream/"). docs/rollout.md, "The stream".

Engine failures ("Engine failures" in docs/rollout.md). An engine that dies (EngineDied: its process exited, or it
returned nothing for rollout.engine_stall_minutes with requests in flight) is restarted in place on its rank:

    dying rank:  its requests in flight are lost; each of their prompts is charged one retry (past
                 rollout.prompt_retries the group is given up: decided as dropped, logged); the engine is shut down
                 and built again (no weights yet); the store's resync counter goes up
    every rank:  leaves its loop (the counter, seen within CHECK_S) and meets the others (one all_gather), walks the
                 actor's export together (it may be collective) while the restarted engines load it, then goes on:
                 the dying rank re-submits the lost requests, with their seeds and carried prefixes

The same seeds give the same responses, so with a batch-invariant engine a step with restarts keeps the same groups
as one without. rollout.engine_restarts bounds the restarts of one rank's engine in a run; past it the job ends
(retryable: the rank-restart path of docs/reliability.md resumes it from its last checkpoint).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.algorithms.dynamic_sampling import StepSampling
from megatron_dapo.errors import JobError
from megatron_dapo.metrics import Stat
from megatron_dapo.metrics import Stats
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import merge_stats
from megatron_dapo.rollout.base import EngineDied
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import completion_seed
from megatron_dapo.rollout.exchange import ExchangeTimeout
from megatron_dapo.rollout.turns import next_turn
from megatron_dapo.rollout.turns import turn_seed
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup

POLL_S = 0.002
"""How long an idle rank sleeps between looks at the queue."""
CHECK_S = 0.25
"""How often a rank looks at the step's shared flags (stop, time cut) and its peers' heartbeats."""
HEARTBEAT_S = 1.0
"""How often each rank's heartbeat thread bumps its counter on the store (a stopped process stops bumping)."""


def step_seed(seed: int, step: int) -> int:
    """The base of every response seed of one training step (completion_seed(step_seed, prompt index, sample))."""
    return seed * 1_000_003 + step * 1009


class StoreQueue:
    """The step's queue counter and published group summaries on a store (one PrefixStore per step).

    take(cap) hands each fresh position to exactly one caller (an atomic add); positions are offset by the
    number of carried groups, which sit at the head of the queue and are never taken.
    """

    def __init__(self, store: dist.Store, step: int, num_carried: int) -> None:
        self.store = dist.PrefixStore(f"megatron_dapo/stream/{step}/", store)
        self.num_carried = num_carried

    def take(self, cap: int) -> int | None:
        """The next fresh queue position, or None when the queue has reached `cap` positions (0 = no cap)."""
        if cap and self.num_carried + self.store.add("next", 0) >= cap:
            return None
        position = self.num_carried + self.store.add("next", 1) - 1
        return None if cap and position >= cap else position

    def taken(self) -> int:
        """Fresh positions taken so far (final once every rank has stopped taking)."""
        return self.store.add("next", 0)

    def publish(self, position: int, summary: GroupSummary) -> None:
        self.store.set(str(position), wire.dumps(summary))

    def read(self, position: int) -> GroupSummary | None:
        key = str(position)
        if not self.store.check([key]):
            return None
        return wire.load_stored(self.store.get(key), f"rollout queue: queue position {position} on the job store")

    def delete(self, positions: list[int]) -> None:
        for p in positions:
            self.store.delete_key(str(p))


def job_store(rank: int, world_size: int, exchange: Any, timeout_s: float) -> dist.Store:
    """The store the queue lives on (collective): a TCPStore hosted by rank 0 of the job on the job's interface only
    (loopback on one node), its address all-gathered over the exchange's gloo group; an in-process HashStore for one
    process. What crosses it is wire.py's data-only encoding.

    Not the default group's store: under torchrun that is the agent's, and the workers outlive a dead launcher long
    enough to save a checkpoint (docs/reliability.md), which they could not do with the queue gone.
    """
    if world_size == 1:
        return dist.HashStore()
    from megatron_dapo.launch_env import job_store_host
    from megatron_dapo.launch_env import listening_fd

    timeout = timedelta(seconds=timeout_s)
    store = None
    address: list[Any] = []
    if rank == 0:  # listening on the job's interface only (loopback on one node): launch_env.job_store_host
        host = job_store_host(world_size)
        fd, port = listening_fd(host)
        store = dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
        address = [(host, port)]
    host, port = exchange.all_gather(address, "rollout queue address")[0]
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return store


class PeerWatch:
    """Every rank's heartbeat on the job store, and this rank's check that its peers' are moving.

    A thread bumps this rank's counter every HEARTBEAT_S over its own store connection, so a rank busy in a long
    engine step still beats; a stopped (SIGSTOP) or wedged process does not. `check()` (from the stream loop) raises
    JobError naming a peer whose counter has not moved for `stall_s`, and SIGKILLs it when it runs on this host (it
    could not act on the launcher's SIGTERM; nobody else would clean it up before the launcher's own timeout).

    `close()` stops and joins the thread; it also runs at interpreter exit (atexit, before daemon threads are torn
    down). A daemon thread left inside the store call at exit is ended by CPython while pybind11's GIL guard is on its
    C++ stack, which aborts the process ("terminate called without an active exception") after a clean run.
    """

    PREFIX = "megatron_dapo/alive/"
    JOIN_S = 10.0

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, stall_s: float, watched: Iterable[int] | None = None,
        names: Callable[[int], str] = lambda r: f"rank {r}",
    ) -> None:  # fmt: skip
        """watched: the ranks `check` looks at (default: every other rank). names: how an error names a rank (a split
        launch says "engine rank 3")."""
        self.store, self.rank, self.world, self.stall_s, self.names = store, rank, world_size, stall_s, names
        store.set(f"{self.PREFIX}who/{rank}", f"{socket.gethostname()} {os.getpid()}")
        now = time.monotonic()
        watched = [r for r in range(world_size) if r != rank] if watched is None else [r for r in watched if r != rank]
        self.seen: dict[int, tuple[bytes | None, float]] = {r: (None, now) for r in watched}
        self.next = 0.0
        client = store.clone()  # its own connection (a TCPStore, or the launch's PrefixStore over one)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(client,), name="megatron_dapo-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _beat(self, client: dist.Store) -> None:
        key = f"{self.PREFIX}beat/{self.rank}"
        while True:
            try:
                client.add(key, 1)
            except Exception:  # the store is gone: the job is ending
                return
            if self._stop.wait(HEARTBEAT_S):
                return

    def close(self) -> None:
        """Stop beating and join the thread (idempotent). Peers then see this rank stall only after stall_s. The join
        is bounded (JOIN_S): a beat blocked on an unreachable store host (stopped, partitioned) must not hold the
        process's exit for the store's whole timeout."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.JOIN_S)
        atexit.unregister(self.close)

    def check(self, waiting_for: str = "") -> None:
        """JobError naming each watched rank whose beat has not moved for stall_s (looked at once per HEARTBEAT_S);
        waiting_for: what this rank waits on, for the line."""
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + HEARTBEAT_S
        self._look(now)
        stalled = sorted(r for r, (_, since) in self.seen.items() if now - since > self.stall_s)
        if stalled:
            self._end(stalled, waiting_for)

    def silent_s(self, rank: int) -> float:
        """Seconds since watched rank `rank`'s beat last moved, as this rank has seen it (a fresh look)."""
        now = time.monotonic()
        self._look(now)
        return now - self.seen[rank][1]

    def _look(self, now: float) -> None:
        for r, (value, _) in list(self.seen.items()):
            key = f"{self.PREFIX}beat/{r}"
            current = self.store.get(key) if self.store.check([key]) else None
            if current != value:
                self.seen[r] = (current, now)

    def _end(self, stalled: list[int], waiting_for: str = "") -> None:
        parts = []
        for r in stalled:
            who_key = f"{self.PREFIX}who/{r}"
            host, pid = _identity(self.store.get(who_key) if self.store.check([who_key]) else None)
            note = ""
            if host == socket.gethostname() and pid > 0:
                if not _sibling(pid):  # the store is not authenticated: never kill a pid it names on its word alone
                    note = ", not killed: not a process of this job"
                else:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        note = ", killed"
                    except OSError:
                        pass
            parts.append(f"{self.names(r)} (host {host}, pid {pid}{note})")
        alive = [r for r in [self.rank, *self.seen] if r not in stalled]  # this rank and the watched ones it sees
        waiting = f" while rank {self.rank} waited for {waiting_for}" if waiting_for else ""
        raise JobError(
            f"{', '.join(parts)} made no progress for {self.stall_s:g} s{waiting} (distributed.timeout_minutes): "
            "stopped (SIGSTOP), hung or swapping; ending the job, which resumes from its last checkpoint",
            report_rank=min(alive),
            retryable=True,
        )


def _identity(value: bytes | None) -> tuple[str, int]:
    """(host, pid) a rank posted on the store as "host pid"; ("?", 0) for none or anything else."""
    parts = value.decode("utf-8", "replace").split() if value else []
    if len(parts) == 2 and parts[1].isascii() and parts[1].isdigit() and len(parts[1]) <= 9:
        return parts[0][:255], int(parts[1])
    return "?", 0


def _sibling(pid: int) -> bool:
    """Whether `pid` is another process of this job on this host: a child of this process's parent (torchrun's agent,
    srun's step daemon, a spawning parent), not of init."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
    except (OSError, ValueError, IndexError):
        return False
    return pid != os.getpid() and ppid == os.getppid() and ppid > 1


@wire.record
@dataclass(slots=True, eq=False)
class CarryEntry:
    """A group carried into the next step (rollout.partial), as every rank knows it: its example, its owner rank
    (who holds the rows and continues it) and, when all G responses are finished, its summary."""

    index: int
    truth: str
    owner: int
    key: str
    summary: GroupSummary | None = None


@dataclass
class StreamResult:
    """What one step's stream produced.

    kept: summaries of the kept groups in queue order (the same on every rank).
    decided: summaries of every decided group (kept or dropped), in queue order: the step's sampled responses.
    groups: this rank's kept groups by key (the rows routing sends).
    carry: the next step's carried groups in queue order (every rank); carry_rows: the owner's rollouts of each
        carried group it owns, by key (G Rollouts each, unfinished ones with finish ABORT; all finished when the
        entry has a summary).
    consumed: fresh queue positions consumed (the data iterator advances by this).
    metrics: "sampling/*" (deterministic) and "stream/*" (timing-dependent) floats.
    """

    kept: list[GroupSummary]
    decided: list[GroupSummary]
    groups: dict[str, RolloutGroup]
    carry: list[CarryEntry]
    carry_rows: dict[str, list[Rollout]]
    consumed: int
    metrics: dict[str, float] = field(default_factory=dict)
    interrupted: bool = False
    """A rank asked the step to stop (a preemption signal): nothing was decided; carry and data are as before."""
    samples: list[dict[str, Any]] | None = None
    """logging.trajectory_samples' records, when chosen where every kept group is (a split launch's engine rank 0);
    None: each rank samples its own groups (trajectories.gather_samples)."""


@dataclass(eq=False)
class _Building:
    """A group being generated on this rank: G slots filled as responses finish; `before` counts each response's
    tokens from earlier steps (a carried prefix), so this step's generated tokens can be told apart."""

    position: int
    index: int
    truth: str
    key: str
    prompt: list[int]
    rollouts: list[Rollout | None]
    before: list[int]
    prefixes: list[Rollout]
    """What each response held when this step started it (carried tokens, or nothing): a lost request restarts here."""
    episodes: list[Any] | None = None
    """Multi-turn: each response's episode (StreamHooks.episode), begun again whenever the response (re)starts, from
    the state its prefix carries (Rollout.episode["state"]) when it continues a carried trajectory."""

    def generated(self) -> int:
        return sum(len(r) - n for r, n in zip(self.rollouts, self.before) if r is not None)


@dataclass(frozen=True)
class StreamConfig:
    """The stream's settings, resolved once from the run's config (`from_run`: seconds, not minutes; the window and the
    cap resolved). Field by field:

    group_size: G. window: rollout.max_inflight_prompts (0: trainer.gen_prompts_per_batch). cap: the sampler's
    max_sampled_prompts (0 = none). partial: rollout.partial. timeout_s: longest time without a decision before the
    stream gives up (rollout.generation_timeout_minutes). over_sampling: rollout.over_sampling; positions past the
    decided ones are started only up to StepSampling.ahead(over_sampling, keep estimate) (0: up to the window).
    expected_keep: the first step's prior keep ratio (algorithm.expected_keep_ratio). max_gen_s:
    algorithm.max_gen_minutes (0: none): past it no further queue position is decided. stall_s: a peer whose heartbeat
    has not moved for this long ends the job naming it (0: no watch; distributed.timeout_minutes on more than one
    rank). max_restarts: rollout.engine_restarts; prompt_retries: rollout.prompt_retries; engine_stall_s:
    rollout.engine_stall_minutes (0: no stall check). max_staleness: trainer.max_staleness (-1: no bound); a carried
    response past it (`oldest_version`) restarts from nothing (on_stale "regenerate": a finished group that held one
    is carried unfinished to generate it again) or its whole group is not carried (on_stale "drop": the prompt counts
    as consumed, it is not trained on).
    """

    group_size: int
    window: int
    cap: int
    partial: bool
    timeout_s: float
    over_sampling: float = 0.0
    expected_keep: float = 0.5
    max_gen_s: float = 0.0
    stall_s: float = 0.0
    max_restarts: int = 0
    prompt_retries: int = 0
    engine_stall_s: float = 0.0
    max_staleness: int = -1
    on_stale: str = "regenerate"

    @classmethod
    def from_run(cls, config: Any, cap: int, world_size: int) -> StreamConfig:
        """From a RunConfig; cap: the dynamic sampler's max_sampled_prompts; world_size: the stream's ranks."""
        c = config
        return cls(
            group_size=c.algorithm.group_size,
            window=c.rollout.max_inflight_prompts or c.trainer.gen_prompts_per_batch,
            cap=cap,
            partial=c.rollout.partial,
            timeout_s=c.rollout.generation_timeout_minutes * 60.0,
            over_sampling=c.rollout.over_sampling,
            expected_keep=c.algorithm.expected_keep_ratio,
            max_gen_s=c.algorithm.max_gen_minutes * 60.0,
            stall_s=c.distributed.timeout_s if world_size > 1 else 0.0,
            max_restarts=c.rollout.engine_restarts,
            prompt_retries=c.rollout.prompt_retries,
            engine_stall_s=c.rollout.engine_stall_minutes * 60.0,
            max_staleness=c.trainer.max_staleness,
            on_stale=c.trainer.on_stale,
        )


@dataclass(frozen=True)
class StreamHooks:
    """What the stream calls back into its owner.

    score: (position, example index, truth, G finished rollouts) -> RolloutGroup (the verifier, or a multi-turn
        episode's outcome on each rollout, Rollout.episode; + overlong shaping).
    episode: (example index, truth) -> a new episode of a multi-turn environment (envs/base.py; the trainer's hands it
        the prompt's record), or None (single-turn): each turn the
        engine finishes goes to its response's episode; not done, its observation is appended (Rollout.observe) and
        the next turn is submitted with the trajectory as the prefix (token in, token out: the engine's ids and the
        observation ids, never re-encoded text); done, or when the observation and a next turn no longer fit under
        the cap (SamplingParams.max_new_tokens counts the whole trajectory: finish LENGTH, episode.finish("length")),
        the trajectory is finished with the outcome in Rollout.episode. With rollout.partial an unfinished trajectory
        is carried mid-turn with its episode's state (episode.state(), restored with episode.restore()).
    stop: this rank's preemption flag; once any rank's is set the step stops everywhere (StreamResult.interrupted).
    restart: () -> a new engine for this rank, the dead one shut down (None: an engine failure ends the job).
    resync: (ranks whose engine was restarted) -> None, collective on every rank: the actor's weights into those
        engines (the owner walks its export; the engines' weight_version is set by the stream).
    log: one line to this rank's log.
    between_steps: called before each engine step (an engine rank of a split launch loads weights pushed while it
        generates there: megatron_dapo/engine_rank.py); None: nothing.
    """

    score: Callable[[int, int, str, list[Rollout]], RolloutGroup]
    episode: Callable[[int, str], Any] | None = None
    stop: Callable[[], bool] = lambda: False
    restart: Callable[[], Any] | None = None
    resync: Callable[[list[int]], None] | None = None
    log: Callable[[str], None] = lambda line: None
    between_steps: Callable[[], Any] | None = None


class RolloutStream:
    """Runs one step's generation (construct on every rank; `run` is collective).

    engine: this rank's engine (streaming protocol of rollout/base.py) or None.
    rank: this rank; exchange: the RolloutExchange (gloo all_gather at the end of the stream).
    store: `job_store(...)`. config: StreamConfig; hooks: StreamHooks.
    """

    def __init__(
        self, engine: Any, rank: int, exchange: Any, store: dist.Store, config: StreamConfig, hooks: StreamHooks
    ) -> None:
        c, h = config, hooks
        self.config, self.hooks = c, h
        self.engine, self.rank, self.exchange, self.store = engine, rank, exchange, store
        self.stop = h.stop
        self.max_gen_s = c.max_gen_s
        self.peers = PeerWatch(store, rank, exchange.world_size, c.stall_s) if c.stall_s > 0 else None
        self.group_size, self.window, self.cap, self.partial = c.group_size, c.window, c.cap, c.partial
        self.over_sampling = c.over_sampling
        self.keep_estimate = c.expected_keep
        """Prior keep ratio of a step (the last step's kept / sampled; first: algorithm.expected_keep_ratio)."""
        self.timeout_s = c.timeout_s
        self.score, self.episode = h.score, h.episode
        self._keys = 0
        self.restart, self.resync, self.log = h.restart, h.resync, h.log
        self.max_restarts, self.prompt_retries, self.engine_stall_s = c.max_restarts, c.prompt_retries, c.engine_stall_s
        self.max_staleness, self.on_stale = c.max_staleness, c.on_stale
        self.between_steps = h.between_steps
        self.restarts = 0
        """In-place restarts of this rank's engine so far (the run's; bounded by max_restarts)."""
        self.retries: dict[str, int] = {}
        """Engine failures each unfinished group (by key) has been in flight for; dropped when it finishes."""

    def close(self) -> None:
        """Stop this rank's heartbeat (end of the job; idempotent)."""
        if self.peers is not None:
            self.peers.close()

    def new_key(self) -> str:
        """A key unique in the job for a group this rank generates (routing and the carry refer to it)."""
        self._keys += 1
        return f"{self.rank}:{self._keys}"

    def run(
        self,
        step: int,
        sampling: StepSampling,
        params: SamplingParams,
        seed: int,
        fresh: Callable[[int], tuple[int, str, list[int]]],
        carry: list[CarryEntry],
        carry_rows: dict[str, list[Rollout]],
    ) -> StreamResult:
        """Generate until `sampling` is done; collective. fresh(offset) -> (example index, truth, prompt ids) of the
        offset-th fresh prompt of the data; carry / carry_rows: the previous step's StreamResult fields."""
        run = _Run(self, step, sampling, params, step_seed(seed, step), fresh, carry, carry_rows)
        try:
            run.loop()
            while run.meet():  # an engine was restarted: its weights re-synced, on with the step
                run.loop()
        except dist.DistStoreError as err:
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise JobError(
                f"rollout stream (step {step}): the queue's store on rank 0 did not answer ({why}): rank 0 is "
                "stopped, hung or dead; ending the job, which resumes from its last checkpoint",
                report_rank=1 if self.rank else 0,
                retryable=True,
            ) from None
        result = run.finish()
        if sampling.decided and not result.interrupted:
            self.keep_estimate = len(sampling.kept) / sampling.decided
        return result


def _unfinished(prompt: list[int]) -> Rollout:
    return Rollout(prompt, [], None, FinishReason.ABORT)


def oldest_version(train_step: int, max_staleness: int) -> int | None:
    """The staleness rule, the one place it is written: the oldest weight version a token trained in `train_step`
    may come from. Step s trains after version s - 1 (the weights synced after step s - 1's update), and
    trainer.max_staleness bounds (s - 1) - version. None: no bound (-1)."""
    return None if max_staleness < 0 else train_step - 1 - max_staleness


def stale_before(step: int, max_staleness: int) -> int | None:
    """The oldest weight version a response carried out of `step` may hold (it is trained in step + 1)."""
    return oldest_version(step + 1, max_staleness)


def drop_stale(rows: list[Rollout], oldest: int | None) -> tuple[list[Rollout], int, int]:
    """rows with every response older than `oldest` (its first token's weight version) restarted from nothing;
    returns (rows, responses restarted, tokens they held)."""
    if oldest is None:
        return rows, 0, 0
    out, count, tokens = [], 0, 0
    for r in rows:
        if r.oldest_version is not None and r.oldest_version < oldest:
            out.append(_unfinished(r.prompt_ids.tolist()))
            count, tokens = count + 1, tokens + len(r)
        else:
            out.append(r)
    return out, count, tokens


class _Run:
    """The state of one `RolloutStream.run` (one step)."""

    def __init__(self, stream, step, sampling, params, base, fresh, carry, carry_rows) -> None:
        self.s, self.step, self.sampling, self.params, self.base = stream, step, sampling, params, base
        self.fresh, self.carry, self.carry_rows = fresh, carry, carry_rows
        self.queue = StoreQueue(stream.store, step, len(carry))
        self.building: dict[int, _Building] = {}
        self.groups: dict[str, RolloutGroup] = {}
        self.decided: dict[int, GroupSummary] = {}
        self.mine: set[int] = set()  # positions whose summary this rank offers itself (never read from the store)
        self.published: list[int] = []
        self.held: int | None = None  # a position taken while the window was full: started when it opens
        self.busy = self.wait = 0.0
        self.tokens = self.started = 0
        self.t0 = time.perf_counter()
        self.stopped = False  # a rank asked the step to stop (preemption)
        self.next_check = 0.0
        self.t_start: float | None = None  # when the first loop began (algorithm.max_gen_minutes counts from it)
        self.last_result = 0.0  # when this rank's engine last returned a response or was idle
        self.handled = 0  # engine restarts every rank has met for (the store's "resync" counter when none pend)
        self.needs_sync = False  # this rank's engine was restarted and has no weights yet
        self.lost: list[_Building] = []  # groups whose requests the dead engine took with it, re-submitted after sync
        self.version = 0  # the weight version of the engine that died (the restarted one gets the same weights)
        self.restarted = self.requeued = 0
        # Carried responses past trainer.max_staleness (`drop_stale`), groups dropped for them, tokens discarded.
        self.stale_restarted = self.stale_dropped = self.stale_tokens = 0

    def offer(self, position: int, summary: GroupSummary) -> None:
        self.decided[position] = summary
        self.sampling.offer(position, summary)

    def start(self, position: int, index: int, truth: str, prompt: list[int], key: str, rows=None) -> None:
        g = self.s.group_size
        rows = rows or [_unfinished(prompt) for _ in range(g)]
        b = _Building(position, index, truth, key, prompt, [None] * g, [len(r) for r in rows], list(rows))
        if self.s.episode is not None:
            b.episodes = [None] * g
        for k, prefix in enumerate(rows):
            if prefix.finish.finished:
                b.rollouts[k] = prefix
        self.building[position] = b
        self.mine.add(position)
        self.started += 1
        if all(r is not None for r in b.rollouts):
            self.complete(b)
        else:
            self.submit(b)

    def submit(self, b: _Building) -> None:
        """Hand the unfinished responses of `b` to the engine, each from the prefix it had when the step started it."""
        requests = []
        for k, r in enumerate(b.rollouts):
            if r is None:
                prefix = b.prefixes[k]
                if b.episodes is not None:
                    b.episodes[k] = self.s.episode(b.index, b.truth)
                    if prefix.episode is not None and "state" in prefix.episode:  # a carried trajectory continues
                        b.episodes[k].restore(prefix.episode["state"])
                seed = completion_seed(self.base, b.index, k)
                requests.append(GenerationRequest((b.position, k), b.prompt, seed, prefix if len(prefix) else None))
        self.s.engine.submit(requests, self.params)

    def complete(self, b: _Building) -> None:
        """All G responses of `b` finished: score, publish, offer."""
        del self.building[b.position]
        self.s.retries.pop(b.key, None)
        self.tokens += b.generated()
        group = self.s.score(b.position, b.index, b.truth, list(b.rollouts))
        self.groups[b.key] = group
        summary = group.summary(self.s.rank, b.key)
        self.queue.publish(b.position, summary)
        self.published.append(b.position)
        self.offer(b.position, summary)

    def finished(self, b: _Building, k: int, rollout: Rollout) -> None:
        """Response k of `b` came back finished; multi-turn, only when its trajectory ended (`next_turn`)."""
        if b.episodes is not None and not self.next_turn(b, k, rollout):
            return
        b.rollouts[k] = rollout
        if all(r is not None for r in b.rollouts):
            self.complete(b)

    def next_turn(self, b: _Building, k: int, rollout: Rollout) -> bool:
        """Multi-turn (rollout/turns.py): True when the trajectory ended (its outcome in rollout.episode); False when
        its observation was appended and the next turn submitted, seeded per turn."""
        cap, engine = self.params.max_new_tokens, self.s.engine
        trajectory = next_turn(b.episodes[k], rollout, cap, engine.weight_version)
        if trajectory is None:
            return True
        seed = turn_seed(self.base, b.index, k, self.s.group_size, len(trajectory.observations))
        engine.submit([GenerationRequest((b.position, k), b.prompt, seed, trajectory)], self.params)
        return False

    def take(self) -> None:
        """Start fresh positions while this rank's engine has room and the window allows: position p starts when
        p < decided + min(window, what dynamic sampling still needs x rollout.over_sampling)."""
        s, engine = self.s, self.s.engine
        while engine.free_slots() > 0:
            if self.held is None:
                self.held = self.queue.take(self.sampling.cap)
            ahead = s.window
            if s.over_sampling > 0:
                ahead = min(ahead, self.sampling.ahead(s.over_sampling, s.keep_estimate))
            if self.held is None or self.held >= self.sampling.decided + ahead:
                return
            index, truth, prompt = self.fresh(self.held - len(self.carry))
            self.start(self.held, index, truth, prompt, self.s.new_key())
            self.held = None

    def start_carry(self) -> None:
        """Offer the carried groups that finished last step; restart this rank's unfinished carried ones."""
        for pos, entry in enumerate(self.carry):
            if entry.summary is not None:  # finished last step: known to every rank
                x = entry.summary
                x.position = pos
                if entry.owner == self.s.rank:
                    rows = self.carry_rows[entry.key]
                    group = RolloutGroup(x.index, pos, entry.truth, rows, x.accs, x.rewards, x.penalties)
                    self.groups[entry.key] = group
                self.mine.add(pos)
                self.offer(pos, x)
            elif entry.owner == self.s.rank:
                rows = self.carry_rows[entry.key]
                self.start(pos, entry.index, entry.truth, rows[0].prompt_ids.tolist(), entry.key, rows)

    def loop(self) -> None:
        """Generate and decide until the step is done, a rank asked it to stop, or an engine was restarted somewhere
        (every rank then meets: `meet`). An engine that dies here is restarted (`engine_died`)."""
        sampling = self.sampling
        if self.needs_sync:
            return
        try:
            if self.t_start is None:
                self.t_start = time.monotonic()
                self.start_carry()
            last = self.last_result = time.monotonic()
            while not sampling.done:
                if time.monotonic() >= self.next_check:
                    self.next_check = time.monotonic() + CHECK_S
                    if self.check(self.t_start):
                        return
                before = sampling.decided
                while not sampling.done and sampling.decided not in self.mine:
                    summary = self.queue.read(sampling.decided)
                    if summary is None:
                        break
                    self.offer(sampling.decided, summary)
                if sampling.done:
                    break
                tick = time.perf_counter()
                engine = self.s.engine
                if engine is not None:
                    self.take()
                if engine is not None and self.s.between_steps is not None:
                    self.s.between_steps()
                if engine is not None and engine.num_unfinished():
                    results = engine.step()
                    self.watch_engine(engine, bool(results))
                    for (position, k), rollout in results:
                        self.finished(self.building[position], k, rollout)
                    self.busy += time.perf_counter() - tick
                else:
                    self.last_result = time.monotonic()
                    time.sleep(POLL_S)
                    self.wait += time.perf_counter() - tick
                if sampling.decided > before:
                    last = time.monotonic()
                elif time.monotonic() - last > self.s.timeout_s:
                    raise ExchangeTimeout(
                        f"rollout stream (step {self.step}): no group decided for {self.s.timeout_s / 60:g} min at "
                        f"queue position {sampling.decided} (rollout.generation_timeout_minutes; a rank's engine is "
                        "stuck or a rank died: see its log)"
                    )
        except EngineDied as err:
            self.engine_died(err)

    def watch_engine(self, engine: Any, returned: bool) -> None:
        """The health check: an engine with requests in flight that returns nothing for engine_stall_s is dead."""
        now = time.monotonic()
        if returned:
            self.last_result = now
        elif 0 < self.s.engine_stall_s < now - self.last_result:
            raise EngineDied(
                f"it returned nothing for {self.s.engine_stall_s / 60:g} min with {engine.num_unfinished()} requests "
                "in flight (rollout.engine_stall_minutes)"
            )

    def replace_engine(self, err: EngineDied, lost: int) -> None:
        """Shut the dead engine down and build it again (no weights yet), or end the job past the restart budget."""
        s = self.s
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        s.restarts += 1
        if s.restart is None or s.restarts > s.max_restarts:
            raise JobError(
                f"rank {s.rank}, step {self.step}: the rollout engine died ({why}) after {s.restarts - 1} in-place "
                f"restarts in this run (rollout.engine_restarts={s.max_restarts}); ending the job, which resumes "
                "from its last checkpoint",
                report_rank=s.rank,
                retryable=True,
            ) from None
        s.log(
            f"rank {s.rank}, step {self.step}: the rollout engine died ({why}); restarting it in place (restart "
            f"{s.restarts} of rollout.engine_restarts={s.max_restarts}), {lost} requests in flight re-queued"
        )
        self.version = s.engine.weight_version
        self.restarted += 1
        self.requeued += lost
        s.engine = s.restart()

    def engine_died(self, err: EngineDied) -> None:
        """This rank's engine died while generating: charge each group in flight one retry (giving up those past
        prompt_retries), restart the engine and ask every rank to meet for its weights."""
        s = self.s
        lost = sorted(self.building.values(), key=lambda b: b.position)
        self.replace_engine(err, sum(r is None for b in lost for r in b.rollouts))
        self.lost = []
        for b in lost:
            s.retries[b.key] = s.retries.get(b.key, 0) + 1
            if s.retries[b.key] > s.prompt_retries:
                self.give_up(b)
            else:
                self.lost.append(b)
        self.needs_sync = True
        self.queue.store.add("resync", 1)

    def give_up(self, b: _Building) -> None:
        """Decide `b` as given up (not trained on; its queue position passes) and say so."""
        s = self.s
        s.log(
            f"rank {s.rank}, step {self.step}: the prompt of example {b.index} (queue position {b.position}) is given "
            f"up after {s.retries.pop(b.key)} engine failures while in flight (rollout.prompt_retries="
            f"{s.prompt_retries}); it is not trained on this step"
        )
        del self.building[b.position]
        summary = GroupSummary.given_up(b.index, b.position, s.rank, b.key, len(b.prompt))
        self.queue.publish(b.position, summary)
        self.published.append(b.position)
        self.offer(b.position, summary)

    def meet(self) -> bool:
        """After each loop, on every rank (one all_gather): agree on a stop and on the engines restarted since the last
        meeting; walk the actor's export together while those load it (`resync`), and the ranks that restarted re-submit
        their lost requests. True: generate on (a rank already done leaves its next loop at once)."""
        s = self.s
        flags = s.exchange.all_gather([(self.stopped, self.needs_sync, self.sampling.done)], "rollout stream")
        if any(stop for stop, _, _ in flags):
            self.stopped = True
            return False
        ranks = [r for r, (_, sync, _) in enumerate(flags) if sync]
        if not ranks:
            return not all(done for _, _, done in flags)
        self.handled += len(ranks)
        if s.resync is not None:
            s.resync(ranks)
        if self.needs_sync:
            self.needs_sync = False
            s.engine.weight_version = self.version
            lost, self.lost = self.lost, []
            try:
                for b in lost:
                    self.submit(b)
            except EngineDied as err:  # died again: the next loop returns at once and every rank meets again
                self.engine_died(err)
        return True

    def check(self, start: float) -> bool:
        """The step's shared flags, looked at every CHECK_S: True when a rank asked the step to stop (this one on its
        preemption flag) or restarted its engine. Past max_gen_s, the first rank to notice cuts the queue where it
        stands (compare_set: one value for every rank); every rank then decides only the positions before it. A
        stalled peer raises."""
        s, store = self.s, self.queue.store
        if s.peers is not None:
            s.peers.check()
        if s.stop() and not self.stopped:
            store.set("stop", "1")
        if store.check(["stop"]):
            self.stopped = True
            return True
        if store.add("resync", 0) > self.handled:  # an engine was restarted: every rank meets for its weights
            return True
        if s.max_gen_s > 0 and time.monotonic() - start > s.max_gen_s and not store.check(["cut"]):
            store.compare_set("cut", "", str(self.queue.num_carried + self.queue.taken()))
        if self.sampling.limit == 0 and store.check(["cut"]):
            minutes = s.max_gen_s / 60
            cut = wire.stored_int(store.get("cut"), "the rollout queue's cut on the job store")
            self.sampling.stop_at(cut, f"algorithm.max_gen_minutes={minutes:g} (the queue was cut at {cut} prompts)")
        return False

    def rank_stats(self, wasted: int) -> Stats:
        """This rank's part of the stream's timing-dependent cost ("stream/*"): on an engine rank, the engine busy
        fraction (share of the stream's wall time spent in engine.step; per rank, mean and min over engine ranks) and
        the seconds idle on the queue (window full or nothing left to take; mean over engine ranks); on every rank
        the prompts it started, the tokens it generated and wasted (aborted at the cut without rollout.partial), its
        engine's in-place restarts and the requests they re-queued, and the carried responses it restarted past
        trainer.max_staleness with the tokens they held."""
        s = self.s
        out: Stats = {
            "stream/prompts_started": Stat.sum(self.started),
            "stream/tokens_generated": Stat.sum(self.tokens),
            "stream/tokens_aborted": Stat.sum(wasted),
            "stream/engine_restarts": Stat.sum(self.restarted),
            "stream/requests_requeued": Stat.sum(self.requeued),
            "stream/stale_responses_restarted": Stat.sum(self.stale_restarted),
            "stream/stale_groups_dropped": Stat.sum(self.stale_dropped),
            "stream/stale_tokens_discarded": Stat.sum(self.stale_tokens),
        }
        if s.engine is not None:
            busy = self.busy / max(time.perf_counter() - self.t0, 1e-9)
            out[f"stream/engine_busy_fraction/rank{s.rank}"] = Stat.max(busy)
            out["stream/engine_busy_fraction"] = Stat.mean(busy, 1.0)
            out["stream/engine_busy_fraction_min"] = Stat.min(busy)
            out["stream/queue_wait_s"] = Stat.mean(self.wait, 1.0)
        return out

    def finish(self) -> StreamResult:
        """At the cut: abort what is in flight, carry it (rollout.partial) or drop it, agree on the carry. When any
        rank stopped the step (preemption), every rank returns an interrupted result instead."""
        s, cut, k = self.s, self.sampling.decided, len(self.carry)
        if s.engine is not None:
            try:
                for (position, j), rollout in s.engine.abort():
                    self.building[position].rollouts[j] = rollout
            except EngineDied as err:  # its responses in flight restart from their prefixes; the step's sync loads it
                self.replace_engine(err, sum(r is None for b in self.building.values() for r in b.rollouts))
        if self.stopped:  # agreed by every rank in the last meeting
            self.queue.delete(self.published)
            return StreamResult([], [], {}, self.carry, self.carry_rows, 0, {}, interrupted=True)
        carried_in = {e.key for e in self.carry}
        entries: list[tuple[int, CarryEntry]] = []
        rows_out: dict[str, list[Rollout]] = {}
        wasted = 0
        oldest = stale_before(self.step, s.max_staleness)

        def carry_group(position: int, entry: CarryEntry, rows: list[Rollout]) -> None:
            """Carry a group past the staleness bound: its stale responses restart (a finished group holding one is
            carried unfinished to generate them again), or with on_stale "drop" the group is not carried."""
            fresh, count, tokens = drop_stale(rows, oldest)
            if count and s.on_stale == "drop":
                self.stale_dropped += 1
                self.stale_tokens += sum(len(r) for r in rows)
                return
            self.stale_restarted, self.stale_tokens = self.stale_restarted + count, self.stale_tokens + tokens
            if count:
                entry.summary = None
            entries.append((position, entry))
            rows_out[entry.key] = fresh

        for position, b in sorted(self.building.items()):
            self.tokens += b.generated()
            if s.partial or b.key in carried_in:
                rows = [r if r is not None else b.prefixes[j] for j, r in enumerate(b.rollouts)]
                for j, r in enumerate(rows):  # multi-turn: an aborted trajectory carries its episode's state
                    if b.episodes is not None and r is b.rollouts[j] and not r.finish.finished:
                        r.episode = {"state": b.episodes[j].state()}
                carry_group(position, CarryEntry(b.index, b.truth, s.rank, b.key), rows)
            else:
                wasted += b.generated()
        for position, summary in self.sampling.undecided():
            if summary.owner != s.rank or summary.dropped:
                continue
            if s.partial or summary.key in carried_in:
                group = self.groups[summary.key]
                carry_group(
                    position, CarryEntry(summary.index, group.truth, s.rank, summary.key, summary), group.rollouts
                )
                if summary.key not in rows_out:
                    del self.groups[summary.key]
            else:
                wasted += int(summary.lengths.sum())
                del self.groups[summary.key]
        if self.held is not None and s.partial:  # taken, never started: carried unstarted
            index, truth, prompt = self.fresh(self.held - k)
            key = s.new_key()
            entries.append((self.held, CarryEntry(index, truth, s.rank, key)))
            rows_out[key] = [_unfinished(prompt) for _ in range(s.group_size)]
        gathered = s.exchange.all_gather([(entries, self.rank_stats(wasted))], "rollout stream")
        carry = sorted((e for part, _ in gathered for e in part), key=lambda pe: pe[0])
        taken = self.queue.taken()  # final: every rank has left its loop
        self.queue.delete(self.published)  # every rank has left its loop: nobody reads them any more
        kept, metrics = self.sampling.result()
        keep = {x.key for x in kept if x.owner == s.rank}
        metrics.update(finalize(merge_stats(st for _, st in gathered)))
        metrics.update(_stream_metrics(self.step, kept, carry))
        return StreamResult(
            kept=kept,
            decided=[self.decided[p] for p in range(cut) if not self.decided[p].dropped],
            groups={key: g for key, g in self.groups.items() if key in keep},
            carry=[e for _, e in carry],
            carry_rows=rows_out,
            consumed=taken if s.partial else max(0, cut - k),
            metrics=metrics,
        )


def _stream_metrics(step: int, kept: list[GroupSummary], carry: list) -> dict:
    """The stream's outcome beyond the per-rank parts (`_Run.rank_stats`): groups carried out (and how many
    unfinished), and the age in steps of the kept responses (weight versions behind the one generating now; > 0 only
    for responses carried in)."""
    ages = [step - 1 - v for x in kept for v in x.oldest_versions if v >= 0]
    carried = sum(1 for _, e in carry if e.summary is None)
    return {
        "stream/groups_carried": float(len(carry)),
        "stream/groups_carried_unfinished": float(carried),
        "stream/response_age_max": float(max(ages, default=0)),
        "stream/response_age_mean": sum(ages) / len(ages) if ages else 0.0,
    }
