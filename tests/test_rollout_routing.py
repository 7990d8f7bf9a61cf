"""The pieces of data-parallel rollout routing: RowPlan, group summaries / rows, and the local batch."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.packing import RowPlan
from megatron_dapo.actor.packing import balance_rows
from megatron_dapo.actor.packing import sequence_lengths
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.experience import apply_rollout_correction
from megatron_dapo.experience import batch_advantages
from megatron_dapo.experience import rollout_correction_parts
from megatron_dapo.experience import row_index
from megatron_dapo.experience import row_lengths
from megatron_dapo.experience import rows_to_batch
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import merge_stats
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import RolloutGroup


def _group(index: int, prompt: int, lens: list[int], finish: list[str], seed: int, logp: bool = True) -> RolloutGroup:
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 50, (prompt,), generator=gen)
    rollouts = [
        Rollout(
            prompt_ids,
            torch.randint(3, 50, (n,), generator=gen),
            -torch.rand(n, generator=gen) if logp else None,
            FinishReason(f),
            ((0, 0),) if n else (),
        )
        for n, f in zip(lens, finish, strict=True)
    ]
    return RolloutGroup(
        index=index,
        position=index,
        truth="7",
        rollouts=rollouts,
        accs=torch.tensor([True, False, False, True][: len(lens)]),
        rewards=torch.tensor([1.0, -1.0, -1.0, 1.0][: len(lens)]) - 0.1 * torch.arange(len(lens)),
        penalties=torch.zeros(len(lens)),
    )


def build_actor_batch(groups: list[RolloutGroup], algo: AlgorithmConfig, pad_token_id: int, std_normalize=True):
    """The oracle: every row of `groups` (full records, one process) as one ActorBatch with group-normalised
    advantages; loss_mask covers response tokens (EOS included), zeroed for truncated responses under overlong
    filtering."""
    summaries = [g.summary(0, str(i)) for i, g in enumerate(groups)]
    advantages, keep = batch_advantages(summaries, algo, std_normalize)
    rows = [(r, i) for i, g in enumerate(groups) for r in g.rollouts]
    return rows_to_batch(rows, advantages, keep, pad_token_id)


def test_row_plan_per_mini_batch_balance():
    lengths = [5, 9, 2, 7, 7, 1, 30, 4, 3, 3]
    plan = RowPlan.build(lengths, dp_size=2, mini_batch_size=4)
    assert plan.num_rows == 10 and plan.dp_size == 2 and len(plan.parts) == 3
    for m, start in enumerate(range(0, 10, 4)):  # each mini-batch is balance_rows of its own rows
        chunk = lengths[start : start + 4]
        assert [list(p) for p in plan.parts[m]] == [[start + i for i in r] for r in balance_rows(chunk, 2)]
    rows = [plan.rows_of(d) for d in range(2)]
    assert not set(rows[0]) & set(rows[1]) and sorted(rows[0] + rows[1]) == list(range(10))
    for d in range(2):
        slices = plan.local_mini_batches(d)
        assert [rows[d][s] for s in slices] == [list(p[d]) for p in plan.parts]
        assert plan.tokens_of(d) == sum(lengths[r] for r in rows[d])
    # fewer rows than ranks: a rank may hold none of a mini-batch
    tiny = RowPlan.build([4], dp_size=2, mini_batch_size=4)
    assert tiny.rows_of(0) == [0] and tiny.rows_of(1) == [] and tiny.local_mini_batches(1) == [slice(0, 0)]


def test_summaries_plus_routed_rows_give_the_full_batch_rows():
    algo = AlgorithmConfig(group_size=4, overlong_filtering=True)
    groups = [
        _group(0, 5, [3, 1, 6, 2], ["stop", "stop", "length", "stop"], seed=1),
        _group(1, 2, [4, 4, 0, 7], ["stop", "length", "stop", "stop"], seed=2),
    ]
    full = build_actor_batch(groups, algo, pad_token_id=0)
    owners = {f"{k}:1": g for k, g in enumerate(groups)}  # each group stays on the rank that generated it
    summaries = [g.summary(k, f"{k}:1") for k, g in enumerate(groups)]
    for s in summaries:  # the summary holds no token ids
        assert not any(isinstance(getattr(s, f), Rollout) for f in s.__slots__)
    assert row_lengths(summaries) == sequence_lengths(full.response_mask).tolist()
    plan = RowPlan.build(row_lengths(summaries), dp_size=2, mini_batch_size=4)
    index = row_index(summaries)
    adv, keep = batch_advantages(summaries, algo)
    torch.testing.assert_close(adv, full.advantages, rtol=0, atol=0)
    assert keep.tolist() == [1, 1, 0, 1, 1, 0, 1, 1]  # overlong filtering: the "length" rows
    assert full.group_ids.tolist() == [0] * 4 + [1] * 4 and full.prompt_lengths.tolist() == [5] * 4 + [2] * 4
    for d in range(2):
        mine = plan.rows_of(d)
        rows = [(owners[summaries[index[r][0]].key].rollouts[index[r][1]], index[r][0]) for r in mine]
        local = rows_to_batch(rows, adv[torch.tensor(mine)], keep[torch.tensor(mine)], pad_token_id=0)
        ref = full.select(torch.tensor(mine))
        width = local.tokens.shape[1]
        assert width <= full.tokens.shape[1] and (ref.response_mask[:, width:] == 0).all()
        for name in ("tokens", "loss_mask", "response_mask", "engine_logp"):
            torch.testing.assert_close(getattr(local, name), getattr(ref, name)[:, :width], rtol=0, atol=0)
        for name in ("advantages", "group_ids", "prompt_lengths"):
            torch.testing.assert_close(getattr(local, name), getattr(ref, name), rtol=0, atol=0)


def test_empty_local_batch_keeps_its_shape():
    batch = rows_to_batch([], torch.zeros(0), torch.zeros(0), pad_token_id=0)
    assert batch.tokens.shape == (0, 1) and batch.engine_logp is not None and len(batch) == 0


@pytest.mark.parametrize("mode,level", [("mis", "token"), ("mis", "sequence"), ("tis", "token"), ("none", "token")])
def test_rollout_correction_on_dp_shards_equals_the_whole_batch(mode, level):
    algo = AlgorithmConfig(
        group_size=4, rollout_correction=mode, rollout_correction_level=level, rollout_mis_low=0.9, rollout_mis_high=1.1
    )
    groups = [_group(k, 3 + k, [3 + k, 1, 5, 2], ["stop"] * 4, seed=10 + k) for k in range(3)]
    whole = build_actor_batch(groups, algo, pad_token_id=0)
    whole.old_logp = whole.engine_logp + 0.2 * torch.randn(whole.engine_logp.shape) * whole.response_mask
    shards = [whole.select(torch.tensor(rows)) for rows in ([0, 3, 4, 9, 11], [1, 2, 5, 6, 7, 8, 10])]
    expected = apply_rollout_correction(whole, algo)
    parts = [rollout_correction_parts(shard, algo) for shard in shards]
    got = finalize(merge_stats(parts))
    assert got.keys() == expected.keys() and len(got) >= 4
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for shard, rows in zip(shards, ([0, 3, 4, 9, 11], [1, 2, 5, 6, 7, 8, 10]), strict=True):  # per-row masks/weights
        torch.testing.assert_close(shard.loss_mask, whole.loss_mask[torch.tensor(rows)], rtol=0, atol=0)
        if whole.is_weight is not None:
            torch.testing.assert_close(shard.is_weight, whole.is_weight[torch.tensor(rows)], rtol=0, atol=0)


def test_a_carried_response_is_corrected_with_each_segments_engine_logprobs():
    """A response generated over two steps (weight versions 3 then 4) keeps each segment's engine log-probs in the
    batch, and TIS weighs every token by its own segment's ratio old / engine (docs/rollout_correction.md)."""
    algo = AlgorithmConfig(group_size=2, rollout_correction="tis", rollout_is_threshold=2.0)
    prompt = torch.tensor([5, 6, 7])
    first = Rollout(prompt, [11, 12], [-1.0, -2.0], FinishReason.ABORT, ((0, 3),))
    carried = first.extend([13, 2], [-0.5, -0.25], version=4)
    carried.finish = FinishReason.STOP
    fresh = Rollout(prompt, [14, 2], [-0.7, -0.1], FinishReason.STOP, ((0, 4),))
    group = RolloutGroup(
        0, 0, "1", [carried, fresh], torch.tensor([True, False]), torch.tensor([1.0, -1.0]), torch.zeros(2)
    )
    batch = build_actor_batch([group], algo, pad_token_id=0)
    assert carried.segments == ((0, 3), (2, 4))
    assert batch.engine_logp[0, 3:7].tolist() == [-1.0, -2.0, -0.5, -0.25]  # both segments, as generated
    old = torch.zeros_like(batch.engine_logp)
    old[0, 3:7] = torch.tensor([-1.5, -1.0, -0.5, -0.5])
    old[1, 3:5] = torch.tensor([-0.7, -0.1])
    batch.old_logp = old
    apply_rollout_correction(batch, algo)
    want = torch.tensor([-1.5 + 1.0, -1.0 + 2.0, 0.0, -0.5 + 0.25]).exp().clamp(max=2.0)
    torch.testing.assert_close(batch.is_weight[0, 3:7], want)
