"""Routing-replay bookkeeping (actor/routing.py, batch.RoutedExperts): pure torch, no megatron."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.packing import PackedLayout
from megatron_dapo.actor.routing import routing_by_row
from megatron_dapo.actor.routing import routing_in_order
from megatron_dapo.batch import ActorBatch
from megatron_dapo.batch import RoutedExperts
from megatron_dapo.config import ActorConfig
from megatron_dapo.config import ConfigError

LAYERS, K = 3, 2


def _rows(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 60, (n, LAYERS, K), generator=gen) for n in lengths]


@pytest.mark.parametrize("multiple", [1, 4])
def test_packed_order_is_the_rows_back_to_back_then_the_pad(multiple):
    lengths = [4, 1, 3]
    tokens = torch.randint(1, 50, (3, 6))
    layout = PackedLayout.build(tokens, torch.tensor(lengths), multiple)
    rows = _rows(lengths)
    flat, real = routing_in_order(rows, layout, 6, LAYERS, K)
    assert flat.shape == (layout.num_tokens, LAYERS, K)
    assert real.tolist() == [True] * 8 + [False] * (layout.num_tokens - 8)
    assert torch.equal(flat[:8], torch.cat(rows))
    assert (flat[8:] == torch.arange(K)).all()  # the alignment pad routes to experts 0..k-1
    assert all(torch.equal(a, b) for a, b in zip(routing_by_row(flat, layout, lengths, 6), rows, strict=True))


def test_padded_order_is_s_major_as_megatron_flattens_s_b_h():
    lengths, width = [2, 5, 3], 5
    rows = _rows(lengths, seed=1)
    flat, real = routing_in_order(rows, None, width, LAYERS, K)
    assert flat.shape == (width * 3, LAYERS, K)
    assert real.view(width, 3).sum(0).tolist() == lengths
    for j, r in enumerate(rows):
        for s in range(width):
            want = r[s] if s < len(r) else torch.arange(K).expand(LAYERS, K)
            assert torch.equal(flat[s * 3 + j], want), (j, s)
    assert all(torch.equal(a, b) for a, b in zip(routing_by_row(flat, None, lengths, width), rows, strict=True))


def test_routed_experts_are_ragged_compact_and_follow_batch_selection():
    rows = _rows([3, 0, 5, 2])
    routed = RoutedExperts.from_rows(rows, num_experts=64)
    assert routed.data.dtype == torch.uint8 and routed.data.shape == (10, LAYERS, K)  # no padding stored
    assert RoutedExperts.from_rows(rows, num_experts=300).data.dtype == torch.int16
    batch = ActorBatch(
        tokens=torch.zeros(4, 6, dtype=torch.long),
        loss_mask=torch.zeros(4, 6),
        response_mask=torch.zeros(4, 6),
        advantages=torch.zeros(4),
        routed_experts=routed,
    )
    picked = batch.select(torch.tensor([2, 0])).routed_experts
    assert torch.equal(picked.row(0), rows[2]) and torch.equal(picked.row(1), rows[0])
    assert len(batch.select(slice(1, 3)).routed_experts) == 2 and batch.to("cpu").routed_experts is routed
    with pytest.raises(ValueError, match="ActorBatch.routed_experts: expected 2 rows, got 4"):
        ActorBatch(tokens=torch.zeros(2, 6, dtype=torch.long), loss_mask=torch.zeros(2, 6),
                   response_mask=torch.zeros(2, 6), advantages=torch.zeros(2), routed_experts=routed)  # fmt: skip


def test_routing_replay_config_refusals():
    with pytest.raises(ConfigError, match="actor.routing_replay: must be one of"):
        ActorConfig(routing_replay="r1")
    with pytest.raises(ConfigError, match="actor.routing_replay: not supported with actor.shared_prefix"):
        ActorConfig(routing_replay="r2", shared_prefix=True)


def test_r3_needs_an_engine_that_returns_routed_experts():
    from pathlib import Path

    from megatron_dapo.config import load_config

    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
    assert load_config(tiny, ["--actor.routing_replay=r3"]).actor.routing_replay == "r3"  # the embedded engine
    assert load_config(tiny, ["--actor.routing_replay=r3", "--rollout.engine=sglang"]).rollout.engine == "sglang"
    with pytest.raises(ConfigError, match="actor.routing_replay: r3 needs .* rollout.engine 'vllm' does not"):
        load_config(tiny, ["--actor.routing_replay=r3", "--rollout.engine=vllm"])
