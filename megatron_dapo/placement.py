"""Disaggregated placement: one launch split into actor ranks and engine ranks (asynchronous training, issue 24).

    torchrun --nproc-per-node W, rollout.engine_ranks = E (1 <= E < W):
      ranks 0 .. W-E-1   actor:  torch.distributed's default group over these ranks only (megatron-core sizes data
                                 parallel from the default group's world, so it must not count the engines)
      ranks W-E .. W-1   engine: a default group of their own (the rollout stream's exchange, queue and meetings)
      every rank         the launch's rendezvous store (torchrun's agent store, or rank 0's), on which each role's
                         group and the weight channel are built under their own prefixes

    weight channel (WeightChannel): actor rank 0 + every engine rank, a gloo group (channel rank 0 is the actor)
      actor rank 0:  announce(version) on the store -> wait on the store until every engine rank has joined it,
                     polling the peers' liveness and the preemption flag -> broadcast the buckets (header, payload),
                     then an end marker
      engine ranks:  a thread (StagedReceiver) joins each announced push (posting joined/<rank> = version) and holds
                     its buckets; the main thread loads them between engine steps (apply); requests in flight go on
                     and stamp later tokens with the new version. An engine rank relaying to SGLang servers
                     (RelayReceiver) streams each push into them on that thread instead, holding a few buckets
    messages (Mailbox, wire.py's data-only encoding on the store): "start" (actor -> engines: step, data position,
      carry), "gen/<s>" (engine rank 0 -> actor ranks: StepGeneration, without the rows: row_channel.py sends each
      actor rank its own), "eval/<version>/<engine rank>" (scores), "stop" (actor -> engines); launch_watch: every
      rank's heartbeat, so a wait on a stopped or dead peer ends within distributed.timeout_minutes naming it

Actor ranks come first so an actor's global rank is its rank in the actor group (and rank 0, which logs and
checkpoints, is an actor). On GPU the engines are SGLang servers on their own GPUs and the weights travel over the
NCCL weight-update group (rollout/sglang_engine.py); this module is the CPU form of the same split, over gloo.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.errors import JobError
from megatron_dapo.errors import first_line
from megatron_dapo.rollout.delta import DeltaDecoder
from megatron_dapo.rollout.delta import DeltaEncoder
from megatron_dapo.rollout.delta import DeltaReader
from megatron_dapo.rollout.delta import as_plain_tensors
from megatron_dapo.rollout.delta import forward_unit
from megatron_dapo.rollout.delta import payload_bytes
from megatron_dapo.rollout.stream import PeerWatch
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.rollout.types import RolloutGroup
from megatron_dapo.rollout.weight_sync import bucket_named_tensors

PREFIX = "megatron_dapo/placement/"
"""Key prefix of every group and counter this module puts on the launch's store."""
POLL_S = 0.005
"""How long a rank waiting for a message or a push sleeps between looks at the store."""
JOIN_S = 10.0
"""How long closing waits for a thread (bounded: a call blocked on an unreachable store must not hold the exit)."""


@dataclass(frozen=True)
class Placement:
    """Which ranks of a launch train (actor) and which generate (engine): the last `num_engine_ranks` generate."""

    rank: int
    world_size: int
    num_engine_ranks: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_engine_ranks < self.world_size:
            raise ValueError(
                f"rollout.engine_ranks: {self.num_engine_ranks} engine ranks out of {self.world_size} leaves "
                f"{self.world_size - self.num_engine_ranks} for the actor; need 1 <= engine_ranks < the launch's "
                "ranks (e.g. --nproc-per-node 2 with rollout.engine_ranks=1)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Placement: rank {self.rank} outside a world of {self.world_size}")

    @property
    def num_actor_ranks(self) -> int:
        return self.world_size - self.num_engine_ranks

    @property
    def actor_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_actor_ranks))

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_actor_ranks, self.world_size))

    @property
    def is_engine(self) -> bool:
        return self.rank >= self.num_actor_ranks

    @property
    def role(self) -> str:
        return "engine" if self.is_engine else "actor"

    def role_of(self, rank: int) -> str:
        """The role of global rank `rank`."""
        return "engine" if rank >= self.num_actor_ranks else "actor"

    @property
    def role_rank(self) -> int:
        """This rank in its role's default group."""
        return self.rank - self.num_actor_ranks if self.is_engine else self.rank

    @property
    def role_size(self) -> int:
        return self.num_engine_ranks if self.is_engine else self.num_actor_ranks

    @property
    def channel_rank(self) -> int | None:
        """This rank in the weight channel (actor rank 0 is 0, engine ranks 1..E); None: not a member."""
        if self.is_engine:
            return 1 + self.role_rank
        return 0 if self.rank == 0 else None


def launch_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The launch's rendezvous store (collective: every rank of the launch calls it): torchrun's agent store when
    torchrun hosts one, else a TCPStore hosted by rank 0 on the job's interface only (launch_env.launch_store)."""
    from megatron_dapo import launch_env

    return launch_env.launch_store(addr, port, rank, world_size, timedelta(seconds=timeout_s))


def init_role_group(placement: Placement, store: dist.Store, backend: str, timeout_s: float) -> None:
    """torch.distributed's default group over this rank's role only (actor ranks or engine ranks)."""
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"{PREFIX}role/{placement.role}/", store),
        rank=placement.role_rank,
        world_size=placement.role_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_role(num_engine_ranks: int, timeout_s: float = 1800.0) -> tuple[Placement, dist.Store]:
    """Split this launch into actor and engine ranks (rollout.engine_ranks): connect to the launch's rendezvous store
    and initialise torch.distributed's default group over this rank's role only (NCCL for actor ranks with CUDA, else
    gloo). Call before init_distributed on actor ranks, which then builds megatron's groups over the actor ranks.
    Returns (Placement, the launch store)."""
    from megatron_dapo.launch_env import launch_env

    rank, world, _, addr, port = launch_env()
    placement = Placement(rank, world, num_engine_ranks)
    store = launch_store(addr, port, rank, world, timeout_s)
    backend = "nccl" if torch.cuda.is_available() and not placement.is_engine else "gloo"
    init_role_group(placement, store, backend, timeout_s)
    return placement, store


class PushAbandoned(Exception):
    """A weight push given up before any byte was sent (its `poll` raised it: a preemption signal while an engine rank
    had not joined); nothing of it reached an engine."""


class WeightChannel:
    """Versioned weight pushes from actor rank 0 to every engine rank (build it on those ranks; others skip it).

    The actor announces a version on the store and broadcasts its buckets; an engine rank sees the announcement with
    `pending()` (one store read) and joins with `receive_buckets()` (StagedReceiver does both on a thread). The actor's
    broadcast waits until every engine has joined.
    """

    def __init__(self, placement: Placement, store: dist.Store, timeout_s: float) -> None:
        rank = placement.channel_rank
        if rank is None:
            raise ValueError(f"WeightChannel: rank {placement.rank} is neither actor rank 0 nor an engine rank")
        self.placement = placement
        self.store = dist.PrefixStore(f"{PREFIX}weights/", store)
        self.wire = _Wire(_gloo_group(store, "weights/group/", rank, 1 + placement.num_engine_ranks, timeout_s))
        self.version: int | None = None
        """The last version pushed (actor) or received (engine; StagedReceiver.loaded is the one in the engine)."""
        self.decoder: DeltaDecoder | None = None
        """An engine rank's, with rollout.weight_sync_delta: rebuilds the full tensors of a delta push."""

    # ----------------------------------------------------------------------------------------------- actor rank 0
    def push(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        encoder: DeltaEncoder | None = None,
        poll: Callable[[], None] | None = None,
        timeout_s: float = float("inf"),
    ) -> dict:
        """Send every (hf_name, full tensor) as weight `version` (actor rank 0; blocks until every engine has joined
        and received). Returns {"weight_sync/bytes", "weight_sync/num_buckets", "weight_sync/num_tensors"}.
        encoder (rollout.weight_sync_delta): each tensor goes as its changed elements against the previous push
        (rollout/delta.py; the engine ranks' DeltaDecoder rebuilds the full tensors), "weight_sync/changed_fraction"
        is added; a push that fails drops the encoder's base, so the next one is full.
        poll: called while waiting for the engine ranks to join (each joins once it has applied the previous push):
        the caller's liveness check (JobError naming a stopped or dead rank) and preemption check (PushAbandoned:
        `named_tensors` is then not consumed). timeout_s: how long an engine rank may take to join (JobError).
        An engine rank that stops answering inside the transfer ends it at the group's timeout (JobError)."""
        if self.placement.is_engine:
            raise RuntimeError("WeightChannel.push: only actor rank 0 sends weights")
        _check_next_version("WeightChannel.push", version, self.version)
        base, named_tensors = _encoded(encoder, named_tensors, version)
        self.store.set("base", "" if base is None else str(base))
        self.store.set("announced", str(version))
        try:
            self._await_joins(version, poll, timeout_s)
            total, buckets, tensors = self.wire.send(named_tensors, bucket_bytes)
        except BaseException as err:
            if encoder is not None:
                encoder.reset()
            if _stopped_in_transfer(err):
                raise _transfer_error(version, err) from None
            raise
        self.version = version
        return _push_metrics(total, buckets, tensors, encoder, version)

    def _await_joins(self, version: int, poll: Callable[[], None] | None, timeout_s: float) -> None:
        """Wait on the store until every engine rank has joined push `version` (poll() between looks)."""
        keys = [f"joined/{e}" for e in range(1, 1 + self.placement.num_engine_ranks)]
        start = time.monotonic()
        while True:
            if all(self.store.check([k]) for k in keys) and all(
                wire.stored_int(self.store.get(k), "a weight channel's joined version") >= version for k in keys
            ):
                return
            if poll is not None:
                poll()
            if time.monotonic() - start > timeout_s:
                raise JobError(
                    f"weight push of version {version}: not every engine rank joined within {timeout_s:.0f} s "
                    "(rollout.generation_timeout_minutes + trainer.eval_timeout_minutes; an engine rank is stuck: see "
                    "its log)",
                    retryable=True,
                )
            time.sleep(POLL_S)

    # ----------------------------------------------------------------------------------------------- engine ranks
    def pending(self) -> int | None:
        """The version the actor has announced and this engine has not loaded, or None."""
        if not self.store.check(["announced"]):
            return None
        version = wire.stored_int(self.store.get("announced"), "the weight channel's announced version")
        return version if self.version is None or version > self.version else None

    def receive_buckets(self) -> tuple[int, list[list[tuple[str, torch.Tensor]]]]:
        """Join the announced push; returns (version, its buckets of (hf_name, tensor)) without loading them. With a
        `decoder` (rollout.weight_sync_delta), the buckets hold the full tensors it rebuilt."""
        version = self.pending()
        if version is None:
            raise RuntimeError("WeightChannel.receive_buckets: no push was announced")
        if self.decoder is not None:
            stored = self.store.get("base")
            base = wire.stored_int(stored, "the weight channel's base version") if stored else None
            try:
                self.decoder.begin(version, base)
            except ValueError as err:
                raise JobError(str(err)) from None
        self.store.set(f"joined/{self.placement.channel_rank}", str(version))  # the actor's push waits for this
        buckets = []
        for bucket in self.wire.receive():
            if self.decoder is not None:
                try:
                    bucket = self.decoder.decode(bucket)
                except ValueError as err:
                    raise JobError(str(err)) from None
            buckets.append(bucket)
        if self.decoder is not None:
            self.decoder.end()
        self.version = version
        return version, buckets


class DirectChannel(WeightChannel):
    """Direct resharding (rollout.weight_sync_route "direct"): every actor rank sends the Megatron shards the transfer
    plan gives it (actor/reshard.py) straight to every engine rank, each on a gloo group of its own (the actor rank
    and the engine ranks), all at once; no actor rank gathers or holds more than its own shards and one bucket. The
    announcement and the joins on the store are WeightChannel's; actor rank 0 waits for the joins and tells the other
    actor ranks (`gather`, an all-gather over the actor ranks) to send or not. An engine rank rebuilds each full HF
    tensor once its pieces are in (reshard.Assembler), bit for bit the rank-0 export's: all of them at once, from a
    thread per sender (receive_buckets: the senders' links overlap), or as they complete, taking a bucket from each
    sender in turn (stream: what it holds stays bounded).

    Build it on every rank of the split launch: actor ranks with hf_config None, engine ranks with the model's HF
    config and the actor's TP size. delta: each sender keeps a DeltaEncoder of its own pieces and each engine rank a
    DeltaDecoder per sender (the base version travels with each sender's stream and is checked there); forward
    (with delta, an engine rank relaying to SGLang servers): a DeltaReader per sender instead, holding no base: the
    rebuilt entries are WeightDelta, each HF tensor's changed elements for the servers' delta loader, or the full
    tensor (reshard.Assembler); fp8: the engine ranks quantize the rebuilt tensors (rollout.weight_dtype "fp8";
    the same tensors as a rank-0 FP8 push)."""

    def __init__(
        self, placement: Placement, store: dist.Store, timeout_s: float, *, hf_config: Any = None, actor_tp: int = 1,
        delta: bool = False, fp8: bool = False, forward: bool = False,
    ) -> None:  # fmt: skip
        self.placement = placement
        self.store = dist.PrefixStore(f"{PREFIX}weights/", store)
        engines, actors = placement.num_engine_ranks, placement.num_actor_ranks
        if placement.is_engine:
            if hf_config is None:
                raise ValueError("DirectChannel: an engine rank needs the model's HF config to rebuild the tensors")
            me = 1 + placement.role_rank
            self.wires = [_Wire(_gloo_group(store, f"direct/{a}/", me, 1 + engines, timeout_s)) for a in range(actors)]
        else:
            self.wires = [_Wire(_gloo_group(store, f"direct/{placement.rank}/", 0, 1 + engines, timeout_s))]
        self.hf_config, self.actor_tp, self.fp8 = hf_config, actor_tp, fp8
        if forward and fp8:
            raise ValueError(
                "DirectChannel: forwarded deltas cannot be FP8 (the relay keeps no base to quantize a "
                "change against; rollout.weight_dtype fp8 deltas go to SGLang servers from actor rank 0)"
            )
        kind = DeltaReader if forward else DeltaDecoder
        self.decoders = [kind() for _ in self.wires] if delta and placement.is_engine else None
        self.combine = forward_unit if forward and delta else None  # what reshard.Assembler returns per parameter
        self.version: int | None = None
        self.decoder = None

    # ----------------------------------------------------------------------------------------------- actor ranks
    def push(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        encoder: DeltaEncoder | None = None,
        poll: Callable[[], None] | None = None,
        timeout_s: float = float("inf"),
        *,
        gather: Callable[[Any], list[Any]],
    ) -> dict:
        """Every actor rank: send this rank's pieces (reshard.owned_shards) as weight `version`. Actor rank 0
        announces it and waits for the engine ranks to join (poll, timeout_s as WeightChannel.push), then every rank
        sends. gather(x): x of every actor rank, in rank order (a collective of the actor ranks). PushAbandoned on
        every rank when rank 0's poll raised it (nothing was sent); a JobError on every rank when rank 0's wait
        failed, and when a rank failed to send (its own error there, one naming it on the others; every encoder then
        drops its base). Returns, on every rank, the push's totals over the senders (WeightChannel.push's metrics)
        and "weight_sync/max_sender_bytes" (the most any one actor rank's link carried)."""
        if self.placement.is_engine:
            raise RuntimeError("DirectChannel.push: engine ranks receive")
        _check_next_version("DirectChannel.push", version, self.version)
        outcome, failure = "send", None
        if self.placement.rank == 0:
            self.store.set("announced", str(version))
            try:
                self._await_joins(version, poll, timeout_s)
            except PushAbandoned:
                outcome = "abandon"
            except BaseException as err:
                outcome, failure = "fail", err
        outcome = gather(outcome)[0]
        if outcome != "send":
            if failure is not None:
                raise failure
            if outcome == "fail":
                raise JobError(f"weight push of version {version}: given up by actor rank 0 (see its log)",
                               retryable=True)  # fmt: skip
            raise PushAbandoned
        base, named_tensors = _encoded(encoder, named_tensors, version)
        try:
            self.wires[0].send_header([version, base], 0)
            sent = self.wires[0].send(named_tensors, bucket_bytes)
        except Exception as err:
            if encoder is not None:
                encoder.reset()
            failure = _transfer_error(version, err) if _stopped_in_transfer(err) else err
            sent = (0, 0, 0)
        counts = (encoder.changed, encoder.elements) if encoder is not None else (0, 0)
        every = gather([failure is None, *sent, *counts])  # the senders learn whether every one of them got through
        if failure is not None:
            raise failure
        failed = [rank for rank, x in enumerate(every) if not x[0]]
        if failed:
            if encoder is not None:
                encoder.reset()  # the engine ranks hold no complete version of this push
            raise JobError(f"weight push of version {version}: actor rank {failed[0]} failed to send its shards "
                           "(see its log)", retryable=True)  # fmt: skip
        self.version = version
        if encoder is not None:
            encoder.version = version
            encoder.pop_fraction()
        every = [x[1:] for x in every]
        metrics = _push_metrics(*(sum(x[i] for x in every) for i in range(3)))
        metrics["weight_sync/max_sender_bytes"] = float(max(x[0] for x in every))
        if encoder is not None:
            elements = sum(x[4] for x in every)
            metrics["weight_sync/changed_fraction"] = sum(x[3] for x in every) / elements if elements else 0.0
        return metrics

    # ----------------------------------------------------------------------------------------------- engine ranks
    def receive_buckets(self) -> tuple[int, list[list[tuple[str, torch.Tensor]]]]:
        """Join the announced push and receive every sender's pieces, a thread per sender, all at once (the whole
        model is held anyway: the embedded engine loads between engine steps); returns (version, one bucket of the
        rebuilt full HF tensors, export order)."""
        from megatron_dapo.actor.reshard import Assembler

        version = self._join()
        pieces: list[tuple[str, torch.Tensor]] = []  # appended to by every thread; rebuilt once all are in, so the
        errors: list[BaseException] = []  # threads only receive (a rebuild between receives would hold up the links)

        def take(sender: int) -> None:
            try:
                wire_ = self.wires[sender]
                decoder = self._open(sender, version, wire_)
                for bucket in wire_.receive():
                    pieces.extend(decoder.decode(bucket) if decoder is not None else bucket)
                if decoder is not None:
                    decoder.end()
            except BaseException as err:  # raised on the receiving thread below
                errors.append(err)

        threads = [threading.Thread(target=take, args=(a,), name=f"direct-{a}") for a in range(len(self.wires))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assembler = Assembler(self.hf_config, self.actor_tp, self.combine)
        try:
            if errors:
                raise errors[0]
            full = [pair for name, piece in pieces for pair in assembler.add(name, piece)]
            assembler.finish()
        except ValueError as err:
            raise JobError(str(err)) from None
        self.version = version
        full.sort(key=lambda pair: assembler.order[pair[0]])
        return version, [list(self._quantized(full))]

    def stream(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Join the announced push; returns (version, its rebuilt full HF tensors, each as soon as its last piece is
        in). Held meanwhile: the pieces of parameters not yet complete and RECEIVE_AHEAD buckets' worth of rebuilt
        tensors, not the model: the receiving thread waits while the consumer is behind, and the senders wait on it
        (the relay to SGLang servers, RelayReceiver). Closing the iterator early lets every sender finish unread."""
        from megatron_dapo.actor.reshard import Assembler

        version = self._join()
        assembler = Assembler(self.hf_config, self.actor_tp, self.combine)
        return version, self._quantized(self._rebuilt(version, assembler))

    def _join(self) -> int:
        version = self.pending()
        if version is None:
            raise RuntimeError("DirectChannel: no push was announced")
        self.store.set(f"joined/{self.placement.channel_rank}", str(version))  # the actor ranks' push waits for this
        return version

    def _quantized(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        if not self.fp8:
            return tensors
        from megatron_dapo.rollout.fp8 import quantize_named_tensors

        return quantize_named_tensors(tensors)

    def _rebuilt(self, version: int, assembler: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Push `version`'s full HF tensors, rebuilt by a receiving thread that takes one bucket from each sender in
        turn (every engine rank in the same order: the senders' groups cannot deadlock whatever their buffering)
        and hands what each bucket completed over a queue of RECEIVE_AHEAD."""
        handoff: queue.Queue = queue.Queue(maxsize=RECEIVE_AHEAD)
        stop = threading.Event()

        def hand(item: tuple[str, Any]) -> None:
            while not stop.is_set():
                with contextlib.suppress(queue.Full):
                    return handoff.put(item, timeout=POLL_S)

        def receive() -> None:
            error: BaseException | None = None  # the first; the failing sender's stream is left unread (its push
            decoders, streams = {}, {}  # fails), the others are drained, so they finish theirs
            for a, wire_ in enumerate(self.wires):
                try:
                    decoders[a], streams[a] = self._open(a, version, wire_), wire_.receive()
                except BaseException as err:
                    error = error or err
            while streams:
                for a in list(streams):
                    try:
                        bucket = next(streams[a], None)
                        if bucket is None:
                            del streams[a]
                            if decoders[a] is not None and error is None and not stop.is_set():
                                decoders[a].end()
                        elif error is None and not stop.is_set():  # else drained
                            decoded = decoders[a].decode(bucket) if decoders[a] is not None else bucket
                            hand(("tensors", [pair for n, t in decoded for pair in assembler.add(n, t)]))
                    except BaseException as err:
                        error = error or err
                        del streams[a]
            hand(("end", None) if error is None else ("error", error))

        thread = threading.Thread(target=receive, name="direct-receive", daemon=True)
        thread.start()
        try:
            while (item := handoff.get())[0] == "tensors":
                yield from item[1]
            if item[0] == "error":
                raise item[1]
            assembler.finish()
        except ValueError as err:
            raise JobError(str(err)) from None
        finally:
            stop.set()
            thread.join()
        self.version = version

    def _open(self, sender: int, version: int, wire_: _Wire) -> DeltaDecoder | None:
        """Read a sender's header: its version and delta base, checked (JobError); the sender's decoder, begun."""
        (sent_version, base), _ = wire_.recv_header()
        if sent_version != version:
            raise JobError(f"weight push: actor rank {sender} sent version {sent_version} while version "
                           f"{version} was announced")  # fmt: skip
        decoder = self.decoders[sender] if self.decoders is not None else None
        if decoder is not None:
            try:
                decoder.begin(version, base)
            except ValueError as err:
                raise JobError(f"{err} (actor rank {sender}'s shards)") from None
        elif base is not None:
            raise JobError(
                f"weight push of version {version}: actor rank {sender} sent a delta against "
                f"version {base} but this engine rank keeps no base (rollout.weight_sync_delta)"
            )
        return decoder


RECEIVE_AHEAD = 2
"""Buckets' worth of rebuilt tensors a direct push's receiving thread may hold for its consumer (DirectChannel.stream):
what an engine rank holds is then bounded by a bucket per sender, these, and the parameters not yet complete."""


def _encoded(
    encoder: DeltaEncoder | None, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, plain: bool = True
) -> tuple[int | None, Iterable[tuple[str, Any]]]:
    """(the base version the push is a delta against, or None; the pairs as they go on the wire): with an encoder,
    each tensor as its changed elements against the previous push, lazily: as plain pairs (as_plain_tensors), or
    the WeightDelta entries themselves (plain False)."""
    if encoder is None:
        return None, named_tensors
    encoder.start()
    entries = ((n, encoder.encode(n, t, version)) for n, t in named_tensors)
    return encoder.version, as_plain_tensors(entries) if plain else entries


class _Wire:
    """Buckets of (name, tensor) from rank 0 of a gloo group to its other ranks: per bucket a header [(name, dtype,
    shape)] and one uint8 payload (both broadcast), then an end marker (a None header)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[int, int, int]:
        """Send every pair, bucketed, then the end marker; returns (payload bytes, buckets, tensors)."""
        total = buckets = tensors = 0
        for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
            header = [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
            payload = torch.cat([_as_bytes(t) for _, t in bucket])
            self.send_header(header, payload.numel())
            self.broadcast(payload)
            total, buckets, tensors = total + payload.numel(), buckets + 1, tensors + len(bucket)
        self.send_header(None, 0)
        return total, buckets, tensors

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets of one `send`, in order, up to its end marker."""
        while True:
            header, size = self.recv_header()
            if header is None:
                return
            payload = torch.empty(size, dtype=torch.uint8)
            self.broadcast(payload)
            yield _from_bytes(payload, header)

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def send_header(self, header: list | None, payload_bytes: int) -> None:
        blob = torch.frombuffer(bytearray(wire.dumps(header)), dtype=torch.uint8)
        self.broadcast(torch.tensor([blob.numel(), payload_bytes], dtype=torch.int64))
        self.broadcast(blob)

    def recv_header(self) -> tuple[list | None, int]:
        sizes = torch.empty(2, dtype=torch.int64)
        self.broadcast(sizes)
        blob = torch.empty(int(sizes[0]), dtype=torch.uint8)
        self.broadcast(blob)
        return wire.loads(blob.numpy().tobytes()), int(sizes[1])


def _gloo_group(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of `size` ranks on the launch's store under PREFIX + prefix (blocks until every member joins)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(PREFIX + prefix, store), rank, size, timedelta(seconds=timeout_s))


def _stopped_in_transfer(err: BaseException) -> bool:
    """gloo's error when a peer stopped answering inside a transfer (not our own JobError)."""
    return isinstance(err, RuntimeError) and not isinstance(err, JobError)


def _transfer_error(version: int, err: BaseException) -> JobError:
    return JobError(
        f"weight push of version {version}: an engine rank stopped answering in the transfer "
        f"(distributed.timeout_minutes; gloo: {first_line(err)})",
        retryable=True,
    )


def load_buckets(engine: Any, version: int, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    """One full weight update of `engine` from received buckets; its tokens from now on carry `version`."""
    engine.begin_weight_update()
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.end_weight_update(full=True)
    engine.weight_version = version


def _check_next_version(who: str, version: int, last: int | None) -> None:
    if last is not None and version <= last:
        raise ValueError(f"{who}: version {version} after {last}; versions must increase")


def _push_metrics(
    total_bytes: int, buckets: int, tensors: int, encoder: DeltaEncoder | None = None, version: int = 0
) -> dict[str, float]:
    """The metrics of one completed push (WeightChannel's and ServerPush's); with an encoder the push becomes the base
    of the next one's deltas, and its changed fraction is added."""
    metrics = {"weight_sync/bytes": float(total_bytes), "weight_sync/num_buckets": float(buckets),
               "weight_sync/num_tensors": float(tensors)}  # fmt: skip
    if encoder is not None:
        encoder.version = version
        metrics["weight_sync/changed_fraction"] = encoder.pop_fraction()
    return metrics


class StagedReceiver:
    """An engine rank's side of the channel on a thread: it joins each push as soon as it is announced (whatever the
    main thread is doing: generating, or inside a collective of the engine ranks that a rank still in a push would
    never join) and holds the weights until `apply` loads them between two engine steps. One version is held at a
    time; the actor's next push waits for it to be applied."""

    def __init__(self, channel: WeightChannel) -> None:
        self.channel = channel
        self._staged: tuple[int, list] | None = None
        self._applied = threading.Event()
        self._applied.set()
        self._closed = False
        self._error: BaseException | None = None
        self.loaded: int | None = None
        """The version loaded into the engine last (None before the first)."""
        self.received_s = 0.0
        """Seconds the thread spent receiving (overlapped with generation)."""
        self.loaded_s = 0.0
        """Seconds `apply` spent loading into the engine (generation waits; with SGLang servers, the relay)."""
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _run(self) -> None:
        try:
            while not self._closed:
                if self.channel.pending() is None:
                    time.sleep(POLL_S)
                    continue
                start = time.perf_counter()
                staged = self._receive()
                self.received_s += time.perf_counter() - start
                self._applied.clear()
                self._staged = staged
                while not self._applied.wait(POLL_S):
                    if self._closed:
                        return
        except BaseException as err:  # surfaced on the main thread by apply()
            self._error = err

    def _receive(self) -> tuple[int, Any]:
        """On the thread: join the announced push; (its version, what `_load` needs)."""
        return self.channel.receive_buckets()

    def _load(self, engine: Any, staged: tuple[int, Any]) -> None:
        """On the main thread, between engine steps: load what `_receive` staged into `engine`."""
        start = time.perf_counter()
        load_buckets(engine, *staged)
        self.loaded_s += time.perf_counter() - start

    def apply(self, engine: Any) -> int | None:
        """Load the staged weights into `engine` (main thread, between engine steps); returns their version, or
        None when nothing is staged."""
        if self._error is not None:
            raise self._error
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        self._load(engine, staged)
        self.loaded = staged[0]
        self._applied.set()
        return self.loaded

    def close(self) -> None:
        """Stop the thread and join it (idempotent; also at interpreter exit): a daemon thread left inside a store or
        gloo call when the interpreter finalizes aborts the process ("terminate called without an active
        exception")."""
        self._closed = True
        self._applied.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)
        atexit.unregister(self.close)


class RelayReceiver(StagedReceiver):
    """An engine rank's end of the direct route into the SGLang servers it drives (rollout.weight_sync_route
    "direct", mode "server"): its thread streams each push into them as the pieces arrive (relay_push) while the main
    thread generates, so no rank holds the model (the pieces of parameters not yet complete and a few buckets:
    DirectChannel.stream); `apply` takes the version it loaded (the staleness bound, evaluation). The next push
    waits for that, as StagedReceiver's. loaded_s: seconds the servers were paused for the updates."""

    def __init__(self, channel: DirectChannel, engine: Any, bucket_bytes: int) -> None:
        self.engine, self.bucket_bytes = engine, bucket_bytes
        super().__init__(channel)

    def _receive(self) -> tuple[int, Any]:
        version, paused = relay_push(self.channel, self.engine, self.bucket_bytes)
        self.loaded_s += paused
        return version, None

    def _load(self, engine: Any, staged: tuple[int, Any]) -> None:
        """Loaded already, on the thread."""


def relay_push(channel: DirectChannel, engine: Any, bucket_bytes: int) -> tuple[int, float]:
    """Join the announced direct push and stream it into SGLang servers (`engine`, a SGLangServerEngine whose weight
    update group this rank leads) in buckets of bucket_bytes as its tensors are rebuilt: the servers pause when the
    first one is ready and continue after the flush (paused_update: requests in flight wait, then go on stamped with
    the new version). Returns (version, seconds the servers were paused). A failure in between leaves the servers
    continued on a mix of the two versions and raises: the engine rank ends the job (retryable), whose restart
    pushes in full."""
    version, tensors = channel.stream()
    with contextlib.closing(iter(tensors)) as rebuilt:
        first = next(rebuilt)  # the servers pause once there is something to load
        start = time.perf_counter()
        with engine.paused_update(version):
            engine.begin_weight_update()
            for bucket in bucket_named_tensors(itertools.chain([first], rebuilt), bucket_bytes):
                engine.update_weights(bucket)
            engine.end_weight_update(full=True)
    return version, time.perf_counter() - start


class ServerPush:
    """Actor rank 0's side of a split launch whose engines are SGLang servers (rollout.engine sglang, mode server):
    the weights go straight to the servers over their weight-update group (NCCL on GPU), while the engine ranks'
    requests are in flight (SGLangServerEngine.paused_update: pause, update stamped with the version, flush,
    continue); then the version is posted on the store for the engine ranks (ServerVersions). With delta
    (rollout.weight_sync_delta) each tensor goes as its changes against the last push (rollout/delta.py), applied by
    the servers' delta loader (rollout/sglang_loader.py); a push that fails makes the next one full."""

    def __init__(self, updater: Any, store: dist.Store) -> None:
        self.updater = updater
        self.store = dist.PrefixStore(f"{PREFIX}server_version/", store)
        self.version: int | None = None

    def push(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        encoder: DeltaEncoder | None = None,
    ) -> dict:
        """As WeightChannel.push: every (hf_name, full tensor) as weight `version`; the same metrics. encoder: the
        WeightDelta entries go to the servers as they are (SGLangServerEngine.update_weights)."""
        _check_next_version("ServerPush.push", version, self.version)
        total = buckets = tensors = 0
        _, named_tensors = _encoded(encoder, named_tensors, version, plain=False)
        try:
            with self.updater.paused_update(version):
                self.updater.begin_weight_update()
                for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
                    self.updater.update_weights(bucket)
                    total += sum(payload_bytes(t) for _, t in bucket)
                    buckets, tensors = buckets + 1, tensors + len(bucket)
                self.updater.end_weight_update()
        except BaseException:
            if encoder is not None:
                encoder.reset()  # the servers may hold a mix: the next push is full
            raise
        self.store.set("loaded", str(version))
        self.version = version
        return _push_metrics(total, buckets, tensors, encoder, version)

    def close(self) -> None:
        """The run is over: the servers' weight-update group is destroyed on both sides (the servers keep running)."""
        self.updater.shutdown()


class ServerVersions:
    """An engine rank's view of the servers' weights (ServerPush): StagedReceiver's contract with nothing to load,
    the servers hold the weights. `apply` takes the newest version actor rank 0 has posted as the engine's (the
    tokens' own stamps come from the servers, in each result's weight-version spans)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore(f"{PREFIX}server_version/", store)
        self.loaded: int | None = None
        self.received_s = self.loaded_s = 0.0

    def apply(self, engine: Any) -> int | None:
        if not self.store.check(["loaded"]):
            return None
        version = wire.stored_int(self.store.get("loaded"), "the servers' weight version on the launch's store")
        if version == self.loaded:
            return None
        engine.weight_version = self.loaded = version
        return version

    def close(self) -> None:
        pass


GONE_S = 5.0
"""An engine rank whose work is over keeps loading pushes until the actor says stop. After a preemption signal it
leaves once actor rank 0's beat has stood still this long (killed or stopped: nobody will say stop); without one, a
silent actor ends the job at distributed.timeout_minutes naming it (EngineRank._await_stop)."""
STOP_ANSWER_S = 10.0
"""How long actor ranks wait, after a preemption signal, for the engine ranks to answer a step's generation as
interrupted; past it the step is dropped without them (a stopped or dead engine answers nothing), so the actor saves
and exits within the signal's grace period."""


def launch_watch(placement: Placement, store: dist.Store, stall_s: float) -> PeerWatch:
    """Every rank's heartbeat on the launch's store, and the peers this rank waits on: actor ranks watch the engine
    ranks (a step's generation, evaluation scores), engine ranks watch actor rank 0 (the start state, the weights,
    the end). A watched peer silent for stall_s (distributed.timeout_minutes) ends the wait with one line naming its
    role and rank (rollout/stream.py's PeerWatch: the colocated stream's own liveness check, over a subset)."""
    watched = (0,) if placement.is_engine else placement.engine_ranks
    return PeerWatch(
        dist.PrefixStore(f"{PREFIX}watch/", store), placement.rank, placement.world_size, stall_s, watched=watched,
        names=lambda r: f"{placement.role_of(r)} rank {r}",
    )  # fmt: skip


@wire.record
@dataclass
class StepGeneration:
    """What the engine ranks hand the actor ranks for one step (posted by engine rank 0 on the store).

    kept / decided: the step's kept and decided group summaries in queue order (StreamResult's); groups: every kept
    group by key (the rows, gathered from the engine ranks) when they go with the message; empty on a launch, where
    each actor rank takes its own rows from engine rank 0's row server (row_channel.py); metrics: the stream's, the
    sampled responses' and the engine ranks' own; data / carry: the data iterator's state and the carry (checkpoint
    form) after this step, which the actor saves with the step; interrupted: a preemption stopped the step (nothing
    else is set).
    """

    step: int
    kept: list[GroupSummary] = field(default_factory=list)
    decided: list[GroupSummary] = field(default_factory=list)
    groups: dict[str, RolloutGroup] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    carry: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    samples: list[dict[str, Any]] | None = None
    """logging.trajectory_samples' records of the step (trajectories.sample_records over every kept group), or None."""


STORE_VALUE_LIMIT = 8 * 2**20
"""The largest value torch's TCPStore takes (its libuv server, the default, closes the connection of a client that
sends more: "Invalid payload size", then "Connection reset by peer" on the sender)."""


class Mailbox:
    """Messages between the roles on the launch's store, in the data-only encoding of wire.py (never pickle: the
    store is reachable by whoever reaches its port): the actor's start state, each step's generation, evaluation
    scores, the actor's stop."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore(f"{PREFIX}mail/", store)

    def post(self, key: str, message: Any) -> None:
        data = wire.dumps(message)
        if len(data) > STORE_VALUE_LIMIT:
            raise JobError(
                f"asynchronous training: the message {key!r} is {len(data) / 2**20:.1f} MiB, over the launch store's "
                f"{STORE_VALUE_LIMIT / 2**20:g} MiB per value (rows go over row_channel.py; a carry this large: lower "
                "rollout.max_inflight_prompts or set rollout.partial false)"
            )
        self.store.set(key, data)

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def take(self, key: str, timeout_s: float, what: str, setting: str, poll: Callable[[], None] | None = None) -> Any:
        """The message at `key` once posted (poll() is called while waiting); JobError naming `what` and the config
        field `setting` after timeout_s."""
        start = time.monotonic()
        while not self.store.check([key]):
            if poll is not None:
                poll()
            if time.monotonic() - start > timeout_s:
                raise JobError(
                    f"asynchronous training: {what} did not come within {setting}={timeout_s / 60:g} min (an engine "
                    "or actor rank is stuck or dead: see its log)",
                    retryable=True,
                )
            time.sleep(POLL_S)
        return wire.load_stored(
            self.store.get(key), f"asynchronous training: the message {key!r} on the launch's store"
        )

    def delete(self, key: str) -> None:
        self.store.delete_key(key)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 tensor (a copy when not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(payload: torch.Tensor, header: list) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one bucket from its bytes and header [(name, dtype, shape)]; a header that does not
    add up to the payload's bytes is a JobError."""
    out, offset = [], 0
    for name, dtype, shape in header:
        size = torch.empty((), dtype=dtype).element_size()
        n = torch.Size(shape).numel() * size
        if offset + n > payload.numel():
            break
        chunk = payload[offset : offset + n]
        chunk = chunk.clone() if offset % size else chunk  # a view needs its dtype's alignment (a delta's int32
        out.append((name, chunk.view(dtype).reshape(shape)))  # index after an odd count of bf16 values)
        offset += n
    if offset != payload.numel() or len(out) != len(header):
        raise JobError(
            f"weight channel: a bucket header of {len(header)} tensors does not match its {payload.numel()} bytes"
        )
    return out
