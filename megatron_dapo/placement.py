"""Disaggregated placement: one launch split into actor ranks and engine ranks (asynchronous training, issue 24).

    torchrun --nproc-per-node W, rollout.engine_ranks = E (1 <= E < W):
      ranks 0 .. W-E-1   actor:  torch.distributed's default group over these ranks only (megatron-core sizes data
                                 parallel from the default group's world, so it must not count the engines)
      ranks W-E .. W-1   engine: a default group of their own (the rollout stream's exchange, queue and meetings)
      every rank         the launch's rendezvous store (torchrun's agent store, or rank 0's), on which each role's
                         group and the weight channel are built under their own prefixes

    weight channel (WeightChannel): actor rank 0 + every engine rank, a gloo group (channel rank 0 is the actor)
      actor rank 0:  announce(version) on the store -> broadcast the buckets (header, payload), then an end marker
      engine ranks:  pending() between engine steps (one store read) -> receive(): join the broadcasts and load each
                     bucket into the engine; requests in flight go on and stamp later tokens with the new version

Actor ranks come first so an actor's global rank is its rank in the actor group (and rank 0, which logs and
checkpoints, is an actor). On GPU the engines are SGLang servers on their own GPUs and the weights travel over the
NCCL weight-update group (rollout/sglang_engine.py); this module is the CPU form of the same split, over gloo.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.rollout.weight_sync import bucket_named_tensors

PREFIX = "megatron_dapo/placement/"
"""Key prefix of every group and counter this module puts on the launch's store."""


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
    torchrun hosts one, else a TCPStore hosted by rank 0 (the same rule as init_process_group's tcp:// method)."""
    url = f"tcp://{addr}:{port}?rank={rank}&world_size={world_size}"
    store, _, _ = next(dist.rendezvous(url, timeout=timedelta(seconds=timeout_s)))
    return store


def init_role_group(placement: Placement, store: dist.Store, backend: str, timeout_s: float) -> None:
    """torch.distributed's default group over this rank's role only (actor ranks or engine ranks)."""
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"{PREFIX}role/{placement.role}/", store),
        rank=placement.role_rank,
        world_size=placement.role_size,
        timeout=timedelta(seconds=timeout_s),
    )


class WeightChannel:
    """Versioned weight pushes from actor rank 0 to every engine rank (build it on those ranks; others skip it).

    The actor announces a version on the store and broadcasts its buckets; an engine rank sees the announcement with
    `pending()` (one store read, cheap enough between two engine steps) and joins with `receive(engine)`. The actor's
    broadcast waits until every engine has joined, so a push takes effect at each engine's next step boundary.
    """

    def __init__(self, placement: Placement, store: dist.Store, timeout_s: float) -> None:
        rank = placement.channel_rank
        if rank is None:
            raise ValueError(f"WeightChannel: rank {placement.rank} is neither actor rank 0 nor an engine rank")
        self.placement = placement
        self.store = dist.PrefixStore(f"{PREFIX}weights/", store)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{PREFIX}weights/group/", store), rank, 1 + placement.num_engine_ranks,
            timedelta(seconds=timeout_s),
        )  # fmt: skip
        self.version: int | None = None
        """The last version pushed (actor) or loaded (engine)."""

    # ----------------------------------------------------------------------------------------------- actor rank 0
    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict:
        """Send every (hf_name, full tensor) as weight `version` (actor rank 0; blocks until every engine has joined
        and received). Returns {"weight_sync/bytes", "weight_sync/num_buckets", "weight_sync/num_tensors"}."""
        if self.placement.is_engine:
            raise RuntimeError("WeightChannel.push: only actor rank 0 sends weights")
        if self.version is not None and version <= self.version:
            raise ValueError(f"WeightChannel.push: version {version} after {self.version}; versions must increase")
        self.store.set("announced", str(version))
        total = buckets = tensors = 0
        for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
            header = [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
            payload = torch.cat([_as_bytes(t) for _, t in bucket])
            self._send_header(header, payload.numel())
            self._broadcast(payload)
            total, buckets, tensors = total + payload.numel(), buckets + 1, tensors + len(bucket)
        self._send_header(None, 0)
        self.version = version
        return {"weight_sync/bytes": float(total), "weight_sync/num_buckets": float(buckets),
                "weight_sync/num_tensors": float(tensors)}  # fmt: skip

    # ----------------------------------------------------------------------------------------------- engine ranks
    def pending(self) -> int | None:
        """The version the actor has announced and this engine has not loaded, or None."""
        if not self.store.check(["announced"]):
            return None
        version = int(self.store.get("announced"))
        return version if self.version is None or version > self.version else None

    def receive(self, engine: Any) -> int:
        """Join the announced push and load it into `engine` (begin / update_weights per bucket / end, full); sets
        engine.weight_version. Returns the version loaded."""
        version = self.pending()
        if version is None:
            raise RuntimeError("WeightChannel.receive: no push was announced")
        engine.begin_weight_update()
        while True:
            header, size = self._recv_header()
            if header is None:
                break
            payload = torch.empty(size, dtype=torch.uint8)
            self._broadcast(payload)
            engine.update_weights(_from_bytes(payload, header))
        engine.end_weight_update(full=True)
        engine.weight_version = self.version = version
        return version

    # ----------------------------------------------------------------------------------------------- wire
    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def _send_header(self, header: list | None, payload_bytes: int) -> None:
        blob = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
        self._broadcast(torch.tensor([blob.numel(), payload_bytes], dtype=torch.int64))
        self._broadcast(blob)

    def _recv_header(self) -> tuple[list | None, int]:
        sizes = torch.empty(2, dtype=torch.int64)
        self._broadcast(sizes)
        blob = torch.empty(int(sizes[0]), dtype=torch.uint8)
        self._broadcast(blob)
        return pickle.loads(blob.numpy().tobytes()), int(sizes[1])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 tensor (a copy when not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(payload: torch.Tensor, header: list) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one bucket from its bytes and header [(name, dtype, shape)]."""
    out, offset = [], 0
    for name, dtype, shape in header:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append((name, payload[offset : offset + n].view(dtype).reshape(shape)))
        offset += n
    return out
