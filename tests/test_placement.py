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
