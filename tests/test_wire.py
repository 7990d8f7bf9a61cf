"""wire.py: the data-only encoding of what crosses between ranks (the job store, the rollout exchange, the split
launch's mailbox and weight channel). Round trips of every type that crosses; refusals; and hostile bytes (a pickle
that would run code, truncations, mutations, unknown types) that must decode to a WireError and nothing else."""

from __future__ import annotations

import os
import pickle
import random
from collections import namedtuple
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.errors import JobError
from megatron_dapo.metrics import Stat
from megatron_dapo.placement import Mailbox
from megatron_dapo.placement import StepGeneration
from megatron_dapo.rollout.stream import CarryEntry
from megatron_dapo.rollout.stream import StoreQueue
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup


class _Payload:
    """What an attacker pickles: creating `path` when unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def _group() -> RolloutGroup:
    routed = torch.randint(0, 8, (5, 2, 2), dtype=torch.uint8)
    r = Rollout([1, 2, 3], [4, 5, 6], [-0.5, -0.25, -1.0], FinishReason.STOP, ((0, 2), (1, 3)), routed)
    unfinished = Rollout([1, 2, 3], [], None, FinishReason.ABORT)
    return RolloutGroup(3, 1, "42", [r, unfinished], torch.tensor([True, False]), torch.tensor([1.0, -1.0]),
                        torch.zeros(2))  # fmt: skip


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def test_every_type_that_crosses_round_trips():
    g = _group()
    values = [
        None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**80, -(3**60), 1.5, float("inf"), float("nan"), "", "aé∑",
        b"\x00\xff", [], (), {}, [1, (2, [3])], {"a": 1, 2: "b", (1, 2): None},
        torch.tensor(3.0), torch.zeros(0, 4), torch.arange(12).reshape(3, 4).T,  # 0-dim, empty, non-contiguous
        *(torch.ones(2, 3).to(dt) for dt in wire.DTYPES.values()), torch.float8_e4m3fn,
        g, g.summary(1, "1:7"), g.rollouts[1], FinishReason.LENGTH, Stat.mean(3.0, 4.0), Stat.max(-2.0),
        CarryEntry(3, "42", 1, "1:7", g.summary(1, "1:7")),
        StepGeneration(2, [g.summary(0, "k")], [], {"k": g}, {"m": 0.5}, {"position": 4}, [{"index": 1}]),
        [("rank 0: boom", {"file": "x"})],
    ]  # fmt: skip
    for value in values:
        assert _same(wire.loads(wire.dumps(value)), value), value


def test_what_is_not_data_is_refused_when_encoding():
    point = namedtuple("point", "x y")
    for value in (object(), point(1, 2), {1, 2}, torch.zeros(2, dtype=torch.complex64), lambda: 0, _Payload("/x")):
        with pytest.raises(wire.WireError, match="cannot cross"):
            wire.dumps(value)
    deep: list = []
    for _ in range(wire.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(wire.WireError, match="nesting deeper"):
        wire.dumps(deep)


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    for blob in (pickle.dumps(_Payload(str(marker))), wire.MAGIC + pickle.dumps(_Payload(str(marker)))):
        with pytest.raises(wire.WireError):
            wire.loads(blob)
    assert not marker.exists()


def _record_named(name: str, fields: dict) -> bytes:
    out = bytearray(wire.MAGIC + b"c")
    wire._str(name, out)
    out += len(fields).to_bytes(4, "little")
    for key, value in fields.items():
        wire._str(key, out)
        wire._encode(value, out, 1)
    return bytes(out)


def test_unknown_types_and_fields_are_refused():
    with pytest.raises(wire.WireError, match="'os.system' is not a type"):
        wire.loads(_record_named("os.system", {}))
    with pytest.raises(wire.WireError, match="has no field 'command'"):
        wire.loads(_record_named("megatron_dapo.metrics.Stat", {"command": "ls"}))
    with pytest.raises(wire.WireError, match="Stat:"):  # a required field missing
        wire.loads(_record_named("megatron_dapo.metrics.Stat", {"value": 1.0}))
    enum_as_record = _record_named("megatron_dapo.rollout.types.FinishReason", {})
    with pytest.raises(wire.WireError, match="not a type"):
        wire.loads(enum_as_record)
    bad_enum = bytearray(wire.MAGIC + b"e")
    wire._str("megatron_dapo.rollout.types.FinishReason", bad_enum)
    wire._encode("explode", bad_enum, 1)
    with pytest.raises(wire.WireError, match="not a value of FinishReason"):
        wire.loads(bytes(bad_enum))
    with pytest.raises(wire.WireError, match="bytes after the end"):
        wire.loads(wire.dumps(1) + b"N")
    with pytest.raises(wire.WireError, match="unknown tag"):
        wire.loads(wire.MAGIC + b"Z")


def test_every_truncation_and_random_mutations_give_wire_errors_only():
    blob = wire.dumps({"g": _group(), "s": Stat.mean(1.0, 2.0), "t": torch.randn(3, 2).bfloat16()})
    for end in range(len(blob)):
        with pytest.raises(wire.WireError):
            wire.loads(blob[:end])
    rng = random.Random(0)
    for _ in range(3000):
        mutated = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(wire.MAGIC), len(mutated))] = rng.randrange(256)
        try:
            wire.loads(bytes(mutated))
        except wire.WireError:
            pass


def test_the_queue_and_the_mailbox_refuse_a_planted_payload_with_one_line(tmp_path):
    marker = tmp_path / "pwned"
    store = dist.HashStore()
    queue = StoreQueue(store, step=1, num_carried=0)
    queue.publish(0, _group().summary(0, "0:1"))
    assert queue.read(0).key == "0:1"
    queue.store.set("1", pickle.dumps(_Payload(str(marker))))  # another process wrote position 1
    with pytest.raises(JobError, match="queue position 1 on the job store is not a message of this job"):
        queue.read(1)
    box = Mailbox(store)
    box.post("gen/1", StepGeneration(1, interrupted=True))
    assert box.take("gen/1", 1, "step 1", "x").interrupted
    box.store.set("gen/2", pickle.dumps(_Payload(str(marker))))
    with pytest.raises(JobError, match="'gen/2' on the launch's store is not a message of this job"):
        box.take("gen/2", 1, "step 2", "x")
    assert not marker.exists()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of the sockets listening on `port`."""
    out = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            out.add(address)
    return out


def test_the_job_store_listens_on_loopback_only_on_one_node(monkeypatch):
    """Rank 0's job store binds 127.0.0.1 on a single node (was 0.0.0.0: every interface of the host)."""
    from megatron_dapo.rollout.stream import job_store

    class TwoRanks:  # rank 0's view of a 2-rank exchange: the gather hands its own address back
        world_size = 2

        def all_gather(self, items, what):
            return list(items)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    store = job_store(0, 2, TwoRanks(), timeout_s=10)
    assert store.host == "127.0.0.1"
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, nothing else
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", b"v")
    assert store.get("k") == b"v"


def test_numbers_on_a_store_that_are_not_numbers_end_the_job_in_one_line():
    """The counters and versions the ranks keep on a store as decimal text (the weight channel's announced and base
    versions, the servers' version, the queue's cut): a planted value is one JobError line, not int()'s traceback."""
    from megatron_dapo.placement import ServerVersions

    assert wire.stored_int(b"42", "x") == 42 and wire.stored_int(b"-1", "x") == -1
    for planted in (b"", b"4 2", b"\x80\x03cos\nsystem", b"1e3", "\u0663".encode(), b"9" * 40, b"-"):
        with pytest.raises(JobError, match=r"^the cut is not a message of this job \(not a number: .*\); another"):
            wire.stored_int(planted, "the cut")
    store = dist.HashStore()
    versions = ServerVersions(store)
    versions.store.set("loaded", "3")
    assert versions.apply(type("E", (), {})()) == 3
    versions.store.set("loaded", pickle.dumps(_Payload("/tmp/mdapo_never")))
    with pytest.raises(JobError, match="the servers' weight version on the launch's store is not a message"):
        versions.apply(object())


def test_a_stalled_peer_is_killed_only_when_it_is_a_process_of_this_job(tmp_path):
    """PeerWatch kills a stalled peer on its own host (it cannot act on SIGTERM). The pid comes from the store, which
    anyone who reaches its port can write: a pid that is not a sibling of this rank (a child of its launcher) is named
    and left alone, and an identity that is not "host pid" names no process."""
    import socket
    import subprocess
    import sys
    import time

    from megatron_dapo.rollout.stream import PeerWatch

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # our child: not a peer
    try:
        store = dist.HashStore()
        watch = PeerWatch(store, rank=0, world_size=3, stall_s=0.01)
        store.set(f"{PeerWatch.PREFIX}who/1", f"{socket.gethostname()} {victim.pid}")
        store.set(f"{PeerWatch.PREFIX}who/2", pickle.dumps(_Payload(str(tmp_path / "pwned"))))
        time.sleep(0.05)
        with pytest.raises(JobError) as err:
            watch.check()
        line = str(err.value)
        assert "\n" not in line
        assert f"rank 1 (host {socket.gethostname()}, pid {victim.pid}, not killed: not a process of this job)" in line
        assert "rank 2 (host ?, pid 0)" in line
        assert victim.poll() is None and not (tmp_path / "pwned").exists()
        watch.close()
    finally:
        victim.kill()
        victim.wait()
