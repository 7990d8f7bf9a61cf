"""The split launch's rows off the store (row_channel.py, issue 39 item 3): engine rank 0's RowServer and the actor
ranks' RowClients, each a thread of this process with its own store connection and a real gloo group.

Each actor rank receives exactly the rows it asked for (bit for bit, MoE routing cut to its stage's layers) and no
other; a step an actor rank skipped (dropped on a preemption) is let go once it asks for a later one; a request for a
row the engine does not hold, or a store answer of the wrong shape, is one line; a client whose poll gives up (a
preemption signal) gets None."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.errors import JobError
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup
from megatron_dapo.row_channel import POSTED
from megatron_dapo.row_channel import PREFIX
from megatron_dapo.row_channel import RowClient
from megatron_dapo.row_channel import RowServer
from megatron_dapo.row_channel import rows_group

ACTORS = 2


def _rollout(seed: int, layers: int = 4) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    p, n = 3 + seed % 4, 5 + seed % 7
    return Rollout(
        torch.randint(0, 1000, (p,), generator=g), torch.randint(0, 1000, (n,), generator=g),
        -torch.rand(n, generator=g, dtype=torch.float32), FinishReason.STOP, ((0, seed % 3),),
        torch.randint(0, 8, (p + n - 1, layers, 2), generator=g).to(torch.uint8),
    )  # fmt: skip


def _groups(step: int, count: int = 3, size: int = 4) -> dict[str, RolloutGroup]:
    out = {}
    for k in range(count):
        rollouts = [_rollout(1000 * step + 10 * k + i) for i in range(size)]
        acc = torch.tensor([i % 2 == 0 for i in range(size)])
        out[f"g{step}:{k}"] = RolloutGroup(k, k, str(k), rollouts, acc, acc.float() * 2 - 1, torch.zeros(size))
    return out


@pytest.fixture
def channel():
    """(server, [client per actor rank], master store) over a real gloo group; closed afterwards."""
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    built: dict[int, object] = {}

    def build(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
        group = rows_group(ACTORS, rank, store, 30.0)
        built[rank] = (RowServer(ACTORS, store, 30.0, group=group) if rank == ACTORS
                       else RowClient(rank, ACTORS, store, 30.0, group=group))  # fmt: skip

    threads = [threading.Thread(target=build, args=(r,)) for r in range(ACTORS + 1)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    server = built[ACTORS]
    yield server, [built[r] for r in range(ACTORS)], master
    server.close()


def _same(a: Rollout, b: Rollout) -> bool:
    return wire.dumps(a) == wire.dumps(b)


def test_each_actor_rank_receives_exactly_its_rows_and_routing_layers(channel):
    server, clients, _ = channel
    held = {1: _groups(1), 2: _groups(2)}
    for step, groups in held.items():
        server.hold(step, groups)
    asked = {0: [("g1:0", 1), ("g1:2", 3), ("g1:1", 0)], 1: [("g1:2", 0), ("g1:0", 1)]}
    layers = {0: (0, 2), 1: (2, 2)}  # two pipeline stages of a 4-MoE-layer model
    out: dict[int, list] = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, clients[r].take(1, asked[r], layers[r],
                                                                                         lambda: True)))
               for r in range(ACTORS)]  # fmt: skip
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    for r in range(ACTORS):
        assert len(out[r]) == len(asked[r])
        for (key, i), got in zip(asked[r], out[r], strict=True):
            assert _same(got, held[1][key].rollouts[i].routing_layers(layers[r]))
            assert got.routed_experts.shape[1] == 2
    sent = sum(c.bytes_received for c in clients)
    assert sent == server.bytes_sent
    assert sent < len(wire.dumps(list(held[1].values()))) / 2  # five of twelve rows, not the step's whole data
    assert 1 not in server._held and 2 in server._held  # both ranks took step 1: let go


def test_a_step_an_actor_rank_dropped_is_let_go_when_it_asks_for_a_later_one(channel):
    server, clients, _ = channel
    for step in (1, 2, 3):
        server.hold(step, _groups(step))
    # rank 0 dropped step 1 (a preemption before its rows) and 2; rank 1 took 1 and 2; both take 3
    got = {}
    t = threading.Thread(target=lambda: got.__setitem__("r1", [clients[1].take(s, [(f"g{s}:0", 0)], None, lambda: True)
                                                                for s in (1, 2, 3)]))  # fmt: skip
    t.start()
    got["r0"] = clients[0].take(3, [("g3:1", 2)], None, lambda: True)
    t.join(30)
    assert _same(got["r0"][0], _groups(3)["g3:1"].rollouts[2])
    assert [len(x) for x in got["r1"]] == [1, 1, 1]
    assert not server._held  # nothing kept for a step nobody will ask for


def test_a_client_gives_up_when_its_poll_says_so_and_a_bad_request_is_one_line(channel):
    server, clients, master = channel
    assert clients[0].take(7, [("g7:0", 0)], None, lambda: False) is None  # no step 7: the poll gives up
    server.hold(8, _groups(8))
    planted = dist.PrefixStore(PREFIX, master)
    planted.set("8/1", wire.dumps({"rows": [["nope", 0]], "layers": None}))
    planted.add(POSTED, 1)  # as a client's request does
    for _ in range(400):
        if server._error is not None:
            break
        threading.Event().wait(0.01)
    with pytest.raises(JobError, match=r"actor rank 1's row request for step 8 names a row this engine rank does not"):
        server.hold(9, _groups(9))


def test_ranks_asking_in_any_order_each_get_their_rows_once(channel):
    """The last rank to take a step lets it go while the server still walks that step's ranks (rank 1 asked first,
    rank 0 last: the walk must not look at the step again)."""
    server, clients, _ = channel
    for step in (1, 2):
        server.hold(step, _groups(step))
        assert len(clients[1].take(step, [(f"g{step}:0", 1)], None, lambda: True)) == 1
        assert len(clients[0].take(step, [(f"g{step}:2", 0)], None, lambda: True)) == 1
    assert not server._held and server._error is None
