"""actor/packing.py (row placement, token budgets, THD layout) and the CPU varlen attention, single process.

Oracles: brute force over every assignment for the balance bound, per-row recomputation for the packed layout, and
dense float64 attention with an explicit block-diagonal causal mask for varlen_causal_attention."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_dapo.actor.packing import PackedLayout
from megatron_dapo.actor.packing import balance_rows
from megatron_dapo.actor.packing import micro_batch_cost
from megatron_dapo.actor.packing import micro_batch_rows
from megatron_dapo.actor.packing import sequence_lengths


def test_sequence_lengths_end_at_the_last_response_token() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]])
    assert sequence_lengths(mask).tolist() == [4, 6, 2, 4]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_balance_rows_covers_every_row_and_is_within_lpt_bound(parts: int) -> None:
    rng = random.Random(0)
    for _ in range(40):
        lengths = [rng.choice([1, 2, 3, 5, 8, 40]) for _ in range(rng.randint(0, 7))]
        plan = balance_rows(lengths, parts)
        assert len(plan) == parts
        assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
        assert plan == balance_rows(lengths, parts)  # deterministic
        worst = max((sum(lengths[i] for i in p) for p in plan), default=0)
        best = min(
            (
                max(sum(lengths[i] for i, a in enumerate(assign) if a == k) for k in range(parts))
                for assign in itertools.product(range(parts), repeat=len(lengths))
            ),
            default=0,
        )
        assert worst <= best * 4 / 3 + 1e-9  # Graham's bound for longest-processing-time-first


def test_balance_rows_one_long_row_against_many_short() -> None:
    lengths = [48] + [3] * 15
    plan = balance_rows(lengths, 2)
    assert [sum(lengths[i] for i in p) for p in plan] == [48, 45]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("budget", [1, 7, 16, 50])
def test_token_budget_micro_batches(packed: bool, budget: int) -> None:
    rng = random.Random(budget)
    for _ in range(30):
        lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 12))]
        rows = sorted(rng.sample(range(len(lengths)), k=rng.randint(1, len(lengths))))
        micro = micro_batch_rows(lengths, rows, max_tokens=budget, packed=packed)
        assert sorted(i for m in micro for i in m) == rows
        assert micro == micro_batch_rows(lengths, rows, max_tokens=budget, packed=packed)
        for m in micro:
            assert m, "no empty micro-batch"
            cost = micro_batch_cost(lengths, m, packed)
            assert cost <= budget or len(m) == 1, (lengths, m, cost)
        # First-fit decreasing never leaves two micro-batches that could have been one.
        for a, b in itertools.combinations(micro, 2):
            assert micro_batch_cost(lengths, a + b, packed) > budget


def test_rows_per_micro_batch_without_budget_groups_similar_lengths() -> None:
    lengths = [5, 1, 9, 3, 7]
    assert micro_batch_rows(lengths, [0, 1, 2, 3, 4], rows_per_micro_batch=2) == [[2, 4], [0, 3], [1]]
    assert micro_batch_rows(lengths, [], max_tokens=10) == []


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_packed_layout_round_trip(multiple: int) -> None:
    g = torch.Generator().manual_seed(multiple)
    lengths = torch.tensor([4, 2, 7, 1, 3])
    b, s = len(lengths), 9
    tokens = torch.randint(1, 100, (b, s), generator=g)
    layout = PackedLayout.build(tokens, lengths, multiple)
    t = layout.num_tokens
    assert t % multiple == 0 and t - int(lengths.sum()) < multiple
    expected = torch.cat([tokens[i, : lengths[i]] for i in range(b)])
    assert torch.equal(layout.tokens[0, : len(expected)], expected)
    cu = layout.cu_seqlens.tolist()
    assert cu[: b + 1] == [0, *torch.cumsum(lengths, 0).tolist()] and cu[-1] == t
    assert layout.max_seqlen == 7
    for i in range(b):  # positions restart at 0 in every sequence
        assert layout.position_ids[0, cu[i] : cu[i + 1]].tolist() == list(range(int(lengths[i])))
    # Values aligned with the packed tokens (position p: a function of tokens p-1 and p) unpack to the same
    # function of each row's own tokens, 0 at column 0 and past the row's length.
    packed_vals = torch.zeros(1, t)
    packed_vals[0, 1:] = (layout.tokens[0, 1:] * 1000 + layout.tokens[0, :-1]).float()
    rows = layout.unpack(packed_vals)
    for i in range(b):
        n = int(lengths[i])
        want = torch.zeros(s)
        want[1:n] = (tokens[i, 1:n] * 1000 + tokens[i, : n - 1]).float()
        assert torch.equal(rows[i], want), i


def test_unpack_is_differentiable() -> None:
    layout = PackedLayout.build(torch.arange(1, 13).reshape(3, 4), torch.tensor([4, 2, 3]))
    x = torch.randn(1, layout.num_tokens, requires_grad=True)
    layout.unpack(x).sum().backward()
    # Every packed position that is not the first of its sequence feeds exactly one row value.
    assert x.grad[0].tolist() == [0, 1, 1, 1, 0, 1, 0, 1, 1]


def _dense_reference(q, k, v, cu, scale):
    t, heads, dim = q.shape
    seq = torch.zeros(t, dtype=torch.int64)
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        seq[a:b] = i
    pos = torch.arange(t)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())
    return out.reshape(t, heads * dim)


def test_varlen_causal_attention_matches_masked_dense_attention() -> None:
    from megatron_dapo.actor.model import varlen_causal_attention

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8, generator=g)
    k = torch.randn(16, 2, 8, generator=g)  # grouped-query: 2 KV heads for 4 query heads
    v = torch.randn(16, 2, 8, generator=g)
    out = varlen_causal_attention(q, k, v, cu, scale=0.3)
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, cu.tolist(), 0.3), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cu_seqlens ends at 15"):
        varlen_causal_attention(q, k, v, torch.tensor([0, 15]), scale=0.3)
