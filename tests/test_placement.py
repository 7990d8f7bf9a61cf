"""Disaggregated placement (megatron_dapo/placement.py): which ranks act and which generate. The split launch itself
(groups, weight channel, messages) runs in tests/test_async_training.py under torchrun --rdzv-backend c10d, at TP=1
and TP=2; a load while requests run is checked against transformers in tests/rollout/test_continuous_batching.py."""

from __future__ import annotations

import pytest

from megatron_dapo.placement import Placement


@pytest.mark.parametrize(
    "world, engines, error",
    [(2, 0, "need 1 <= engine_ranks < the launch's ranks"), (2, 2, "leaves 0 for the actor"), (1, 1, "leaves 0")],
)
def test_a_split_without_actor_or_engine_ranks_is_one_line(world, engines, error):
    with pytest.raises(ValueError, match=error):
        Placement(0, world, engines)


def test_actor_ranks_come_first_and_actor_rank_0_leads_the_weight_channel():
    roles = [Placement(r, 5, 2) for r in range(5)]
    assert [p.role for p in roles] == ["actor"] * 3 + ["engine"] * 2
    assert [(p.role_rank, p.role_size) for p in roles] == [(0, 3), (1, 3), (2, 3), (0, 2), (1, 2)]
    assert [p.channel_rank for p in roles] == [0, None, None, 1, 2]
    assert roles[0].engine_ranks == (3, 4) and roles[0].actor_ranks == (0, 1, 2)


def test_a_header_that_does_not_match_its_bytes_is_refused():
    """A bucket's header (decoded from wire.py's encoding) must add up to its payload; else one line, no view error."""
    import torch

    from megatron_dapo.errors import JobError
    from megatron_dapo.placement import _as_bytes
    from megatron_dapo.placement import _from_bytes

    a, b = torch.randn(3, 2), torch.arange(4, dtype=torch.int64)
    payload = torch.cat([_as_bytes(a), _as_bytes(b)])
    header = [("a", a.dtype, (3, 2)), ("b", b.dtype, (4,))]
    (name_a, got_a), (name_b, got_b) = _from_bytes(payload, header)
    assert (name_a, name_b) == ("a", "b") and torch.equal(got_a, a) and torch.equal(got_b, b)
    for bad in (
        [("a", a.dtype, (3, 2))],
        [("a", a.dtype, (3, 2)), ("b", b.dtype, (5,))],
        [*header, ("c", b.dtype, (1,))],
    ):
        with pytest.raises(JobError, match="does not match its 56 bytes"):
            _from_bytes(payload, bad)


def test_a_bucket_of_mixed_dtypes_at_unaligned_offsets_reads_back():
    """A delta push puts an int32 index after an odd count of bf16 values: each tensor reads back whole."""
    import torch

    from megatron_dapo.placement import _as_bytes
    from megatron_dapo.placement import _from_bytes

    parts = [torch.randn(3).to(torch.bfloat16), torch.arange(5, dtype=torch.int32), torch.randn(2, 3)]
    payload = torch.cat([_as_bytes(t) for t in parts])
    back = _from_bytes(payload, [(str(i), t.dtype, tuple(t.shape)) for i, t in enumerate(parts)])
    assert all(torch.equal(t, got) for t, (_, got) in zip(parts, back, strict=True))


def _push_waits_worker() -> dict:
    """Actor rank 0 and one engine rank over a real weight channel (gloo, the launch's store): a push the engine joins
    arrives whole; a push it never joins (stopped) ends at the caller's liveness check, and one given up for a
    preemption raises PushAbandoned, in both cases before any tensor of the export is read."""
    import os
    from datetime import timedelta

    import torch

    from megatron_dapo.errors import JobError
    from megatron_dapo.launch_env import launch_store
    from megatron_dapo.placement import PushAbandoned
    from megatron_dapo.placement import WeightChannel

    rank = int(os.environ["RANK"])
    store = launch_store("127.0.0.1", int(os.environ["MASTER_PORT"]), rank, 2, timedelta(seconds=60), env={})
    channel = WeightChannel(Placement(rank, 2, 1), store, timeout_s=60)
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    if rank == 1:
        while channel.pending() is None:
            pass
        version, buckets = channel.receive_buckets()
        got = {n: t for bucket in buckets for n, t in bucket}
        store.wait(["actor/done"])
        return {"version": version, "equal": all(torch.equal(got[n], weights[n]) for n in weights)}
    out: dict = {"first": channel.push(1, iter(weights.items()), 1 << 20)["weight_sync/num_tensors"]}
    read: list[str] = []

    def export():
        for name, t in weights.items():
            read.append(name)
            yield name, t

    def stalled():
        raise JobError("engine rank 1 (host h, pid 1) made no progress for 15 s")

    for poll, kind in ((stalled, JobError), (lambda: (_ for _ in ()).throw(PushAbandoned()), PushAbandoned)):
        try:
            channel.push(channel.version + 1, export(), 1 << 20, poll=poll)
            out[kind.__name__] = "returned"
        except kind as err:
            out[kind.__name__] = str(err)
    out["read"] = read
    try:
        channel.push(channel.version + 1, export(), 1 << 20, poll=lambda: None, timeout_s=0.2)
    except JobError as err:
        out["timeout"] = str(err)
    store.set("actor/done", "1")
    return out


def test_a_push_waits_for_the_engine_ranks_with_the_callers_liveness_and_preemption_checks():
    from tests.actor._dist import run_distributed

    actor, engine = run_distributed(_push_waits_worker, 2, timeout_s=120)
    assert engine == {"version": 1, "equal": True} and actor["first"] == 2.0
    assert actor["JobError"] == "engine rank 1 (host h, pid 1) made no progress for 15 s"
    assert actor["PushAbandoned"] == "" and actor["read"] == []  # nothing of the export was consumed
    assert actor["timeout"].startswith("weight push of version 2: not every engine rank joined within 0 s")


def test_the_store_value_limit_is_torchs_and_a_message_over_it_is_one_line():
    """torch's TCPStore (the launch's, hosted_store) closes the connection of a client sending a value over 8 MiB:
    before the rows went over row_channel.py, a split launch whose step held more than that died with "Connection
    reset by peer". placement.STORE_VALUE_LIMIT is that limit (checked here against torch), and a message over it is
    one line naming the key."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_dapo import launch_env
    from megatron_dapo.errors import JobError
    from megatron_dapo.placement import STORE_VALUE_LIMIT
    from megatron_dapo.placement import Mailbox

    store = launch_env.hosted_store("127.0.0.1", 0, 0, 1, timedelta(seconds=10), bind="127.0.0.1")
    store.set("fits", b"x" * (STORE_VALUE_LIMIT - 4096))
    assert len(store.get("fits")) == STORE_VALUE_LIMIT - 4096
    with pytest.raises(Exception):  # noqa: B017 - torch's DistNetworkError or DistStoreError, as it reports it
        store.set("over", b"x" * (STORE_VALUE_LIMIT + 1))
    box = Mailbox(dist.HashStore())
    with pytest.raises(JobError, match=r"the message 'gen/3' is 9\.0 MiB, over the launch store's 8 MiB per value"):
        box.post("gen/3", {"data": b"x" * (9 * 2**20)})
    assert not box.has("gen/3")
