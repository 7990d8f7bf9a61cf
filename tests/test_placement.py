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
