"""actor.shared_prefix, single process: SharedPrefixLayout (actor/packing.py), its micro-batching, the masked
attention of VarlenDotProductAttention (actor/model.py) and RoPE at per-token positions.

Oracles: every row re-read from the layout (tokens, positions, predecessors and the exact set of keys each position
sees), and dense float64 causal attention run on each row alone."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_dapo.actor.packing import SharedPrefixLayout
from megatron_dapo.actor.packing import prompt_groups
from megatron_dapo.actor.packing import prompt_lengths
from megatron_dapo.actor.packing import sequence_lengths
from megatron_dapo.actor.packing import shared_prefix_cost
from megatron_dapo.actor.packing import shared_prefix_micro_batches


def _group_rows(seed: int, groups: int = 3, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows in prompt groups (prompts of 1-5 tokens, shared within a group; responses of 1-6 tokens), shuffled,
    plus one row without response tokens. Returns (tokens [B, S], response_mask [B, S], group_ids [B]: the rows of
    one group share an id, as ActorBatch.group_ids)."""
    rng = random.Random(seed)
    spec = []
    for g in range(groups):
        prompt = [rng.randint(1, 50) for _ in range(rng.randint(3 if g == 0 else 1, 5))]
        for _ in range(rng.randint(2 if g == 0 else 1, rows)):  # group 0 always shares a prompt of >= 3 tokens
            spec.append((g, prompt, [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]))
    spec.append((groups, [7, 8, 9], []))  # a dummy-like row: no response
    rng.shuffle(spec)
    s = max(len(p) + len(r) for _, p, r in spec) + 2
    tokens = torch.zeros(len(spec), s, dtype=torch.int64)
    mask = torch.zeros(len(spec), s)
    for i, (_, p, r) in enumerate(spec):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) : len(p) + len(r)] = 1.0
    return tokens, mask, torch.tensor([g for g, _, _ in spec], dtype=torch.int64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("multiple", [1, 4])
def test_layout_round_trip_positions_and_visible_keys(seed: int, multiple: int) -> None:
    tokens, mask, ids = _group_rows(seed)
    lengths = sequence_lengths(mask)
    prompts = prompt_lengths(mask, lengths)
    layout = SharedPrefixLayout.build(tokens, lengths, prompts, ids, multiple)
    packed = layout.tokens[0]
    allowed = ~layout.attention_mask()[0, 0]
    assert layout.num_tokens % multiple == 0 and layout.num_tokens - layout.num_real < multiple
    # Each distinct prompt is held once: prefix P - 1 per group, one branch per row.
    groups = prompt_groups(ids, list(range(len(tokens))))
    assert layout.num_real == sum(shared_prefix_cost(lengths.tolist(), prompts, g) for g in groups)
    assert layout.num_real < int(lengths.sum())
    for r in range(len(tokens)):
        n, p = int(lengths[r]), prompts[r]
        first = int(mask[r].nonzero().min()) if mask[r].any() else n
        assert p == max(first, 1)
        for j in range(n):
            q = int(layout.index[r, j])
            assert packed[q] == tokens[r, j]
            assert layout.position_ids[0, q] == j
            # position j's context is exactly the row's tokens 0..j, each at its own position
            seen = allowed[q].nonzero().flatten()
            assert sorted(layout.position_ids[0, seen].tolist()) == list(range(j + 1)), (r, j)
            assert torch.equal(packed[seen], tokens[r, : j + 1][layout.position_ids[0, seen]])
        for j in range(1, n):
            if mask[r, j] > 0:  # a response token: predicted from the packed position before it
                assert layout.valid[r, j]
                q = int(layout.index[r, j])
                assert packed[q - 1] == tokens[r, j - 1] and allowed[q - 1].sum() == j
        assert not layout.valid[r, 0] and not layout.valid[r, n:].any()
    values = torch.randn(1, layout.num_tokens, requires_grad=True)
    out = layout.unpack(values)
    out.sum().backward()
    assert out.shape == tokens.shape and values.grad is not None and (out[~layout.valid] == 0).all()


def test_prompt_lengths_clamp_and_rows_without_response() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert prompt_lengths(mask, sequence_lengths(mask)) == [2, 1, 2]


@pytest.mark.parametrize("budget", [0, 1, 9, 20, 60])
def test_shared_prefix_micro_batches_keep_groups_and_budget(budget: int) -> None:
    rng = random.Random(budget)
    for _ in range(30):
        groups, lengths, prompts, r = [], [], [], 0
        for _ in range(rng.randint(1, 5)):
            p = rng.randint(1, 12)
            size = rng.randint(1, 6)
            groups.append(list(range(r, r + size)))
            for _ in range(size):
                lengths.append(p + rng.randint(0, 10))
                prompts.append(p)
            r += size
        rows_per_mb = rng.randint(1, 8)
        micro = shared_prefix_micro_batches(
            lengths, prompts, groups, max_tokens=budget, rows_per_micro_batch=rows_per_mb
        )
        assert sorted(i for m in micro for i in m) == list(range(r))
        assert micro == shared_prefix_micro_batches(
            lengths, prompts, groups, max_tokens=budget, rows_per_micro_batch=rows_per_mb
        )
        where = {i: k for k, m in enumerate(micro) for i in m}
        for m in micro:
            parts = [[i for i in m if i in g] for g in groups]
            cost = sum(shared_prefix_cost(lengths, prompts, part) for part in parts)
            size = len(m) if budget == 0 else cost
            limit = rows_per_mb if budget == 0 else budget
            assert size <= limit or len(m) == 1, (m, size, limit)
        for g in groups:  # a group that fits the budget is never split
            fits = len(g) <= rows_per_mb if budget == 0 else shared_prefix_cost(lengths, prompts, g) <= budget
            if fits:
                assert len({where[i] for i in g}) == 1, g


def _row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one row, float64, dense: q [L, H, D], k/v [L, KV, D] -> [L, H * D]."""
    group = q.shape[1] // k.shape[1]
    qq, kk, vv = (t.double().transpose(0, 1) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
    scores = (qq @ kk.transpose(1, 2)) * scale
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vv
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("seed", range(4))
def test_masked_block_attention_matches_unshared_rows(seed: int) -> None:
    from megatron_dapo.actor.model import masked_block_attention

    tokens, mask, ids = _group_rows(seed + 10)
    lengths = sequence_lengths(mask)
    prompts = prompt_lengths(mask, lengths)
    layout = SharedPrefixLayout.build(tokens, lengths, prompts, ids, multiple=3)
    gen = torch.Generator().manual_seed(seed)
    heads, kv, dim, scale = 6, 2, 8, 0.3
    # Per-token q/k/v as a function of (token, position) only, so rows sharing a prompt share its values, as
    # inside a model whose earlier layers see the same context.
    table = {n: torch.randn(64, 32, n, dim, generator=gen) for n in (heads, kv)}
    pos = layout.position_ids[0]

    def qkv(tok: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return table[heads][tok, p], table[kv][tok, p], table[kv][(tok + 1) % 64, p]

    q, k, v = (t.requires_grad_() for t in qkv(layout.tokens[0], pos))
    out = masked_block_attention(q, k, v, layout.attention_mask()[0, 0], scale=scale)
    dy = torch.randn(out.shape, generator=gen)
    (out * dy).sum().backward()
    grads = torch.zeros_like(q, dtype=torch.float64)
    for r in range(len(tokens)):
        n = int(lengths[r])
        rq, rk, rv = (t.detach().double().requires_grad_() for t in qkv(tokens[r, :n], torch.arange(n)))
        ref = _row_attention(rq, rk, rv, scale)
        idx = layout.index[r, :n]  # every column of the row, prompt included
        torch.testing.assert_close(out[idx].double(), ref, rtol=1e-5, atol=1e-5)
        # the gradient a row's own outputs send into q (branch positions are each row's alone)
        (ref * dy[idx].double()).sum().backward()
        branch = torch.arange(n) >= prompts[r] - 1
        grads[idx[branch]] += rq.grad[branch]
    branch_tokens = layout.branch >= 0
    torch.testing.assert_close(q.grad[branch_tokens].double(), grads[branch_tokens], rtol=1e-5, atol=1e-5)
    assert out.shape == (layout.num_tokens, heads * dim)


def test_rope_at_positions_equals_megatron_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # RotaryEmbedding.get_emb moves to it
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_dapo.actor.model import rope_at_positions

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    positions = torch.tensor([0, 1, 2, 2, 3, 4, 2, 0, 1])
    got = rope_at_positions(rope, positions)
    table = rope(5)
    assert got.shape == (9, 1, 1, 16)
    for i, p in enumerate(positions.tolist()):
        assert torch.equal(got[i], table[p])


@pytest.mark.parametrize("shared", [False, True])
def test_packed_logprobs_only_at_needed_positions(shared: bool) -> None:
    """micro_batch_logprobs(needed=...) runs the log-prob op on the needed predictions only, with the same values and
    gradient there as the whole-row computation, and 0 elsewhere."""
    from megatron_dapo.actor.loss import get_logprob_impl
    from megatron_dapo.actor.loss import micro_batch_logprobs
    from megatron_dapo.actor.packing import PackedLayout

    tokens, mask, ids = _group_rows(7)
    lengths = sequence_lengths(mask)
    if shared:
        layout = SharedPrefixLayout.build(tokens, lengths, prompt_lengths(mask, lengths), ids, multiple=2)
    else:
        layout = PackedLayout.build(tokens, lengths, multiple=2)
    fn = get_logprob_impl("reference").fn
    rows_seen = []

    def spy(logits: torch.Tensor, labels: torch.Tensor, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        rows_seen.append(labels.numel())
        return fn(logits, labels, **kw)

    logits = torch.randn(1, layout.num_tokens, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    kw = dict(packed=layout, temperature=0.7, vocab_size=60, logprob_fn=spy)
    full_lp, full_ent = micro_batch_logprobs(logits, tokens, **kw)
    (full_grad,) = torch.autograd.grad(((full_lp + full_ent) * mask).sum(), logits)
    lp, ent = micro_batch_logprobs(logits, tokens, needed=mask > 0, **kw)
    (grad,) = torch.autograd.grad(((lp + ent) * mask).sum(), logits)
    assert rows_seen == [layout.num_tokens - 1, int(mask.sum())]
    torch.testing.assert_close(lp, full_lp * mask, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, full_ent * mask, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-6)


def test_shared_prefix_refuses_the_transformer_engine_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_dapo.actor import model
    from megatron_dapo.config import ActorConfig

    on = ActorConfig(shared_prefix=True)
    model.check_shared_prefix(on, on_cpu=True)  # CPU: the local spec
    model.check_shared_prefix(ActorConfig(), on_cpu=False)  # off: nothing to check
    monkeypatch.setattr(model, "_have_te", lambda: True)
    with pytest.raises(ValueError, match="actor.shared_prefix: needs the local layer spec"):
        model.check_shared_prefix(on, on_cpu=False)
    monkeypatch.setattr(model, "_have_te", lambda: False)
    model.check_shared_prefix(ActorConfig(shared_prefix=True, allow_local_spec_on_gpu=True), on_cpu=False)
