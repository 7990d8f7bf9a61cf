"""RolloutStream: queue-order determinism under shuffled completion, abort, partial carry, several ranks on one
store (threads), with a fake engine whose responses follow from their seeds and whose timing is random."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import RolloutGroup
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout.base import request_result
from tests.rollout._streams import make_stream

G = 4
PARAMS = SamplingParams(max_new_tokens=9)


def response_of(seed: int) -> list[int]:
    """The whole response a request with this seed generates: 1..9 tokens, the last 2 (EOS) unless at the cap."""
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    return [rng.randint(3, 50) for _ in range(n - 1)] + ([2] if n < 9 else [rng.randint(3, 50)])


class FakeEngine:
    """Streaming engine protocol; each step() advances a random subset of running rows by one token (so groups
    finish in an order that changes with `timing_seed`); tokens follow from the request seed and the prefix."""

    def __init__(self, slots: int, timing_seed: int, version: int = 0, slow: bool = False) -> None:
        self.slots, self.rng, self.weight_version = slots, random.Random(timing_seed), version
        self.pause_s = 0.01 if slow else 0.002
        self.live: list[list] = []  # [request, tokens generated this run, full response]
        self.waiting: list = []

    def submit(self, requests, params):
        for r in requests:
            done = 0 if r.prefix is None else len(r.prefix)
            full = response_of(r.seed)[: params.max_new_tokens - done]
            self.waiting.append([r, [], full])

    def free_slots(self):
        return self.slots - len(self.live) - len(self.waiting)

    def num_unfinished(self):
        return len(self.live) + len(self.waiting)

    def step(self):
        time.sleep(self.rng.random() * self.pause_s)
        while self.waiting and len(self.live) < self.slots:
            self.live.append(self.waiting.pop(0))
        out = []
        for row in list(self.live):
            if self.rng.random() < 0.5:
                continue
            req, toks, full = row
            toks.append(full[len(toks)])
            if len(toks) == len(full):
                self.live.remove(row)
                reason = FinishReason.STOP if toks[-1] == 2 else FinishReason.LENGTH
                out.append((req.key, self._result(req, toks, reason)))
        return out

    def _result(self, req, toks, reason):
        return request_result(req, toks, [-0.1 * t for t in toks], reason, self.weight_version)

    def abort(self):
        out = [(r.key, self._result(r, t, FinishReason.ABORT)) for r, t, _ in self.live + self.waiting]
        self.live, self.waiting = [], []
        return out


class ThreadExchange:
    """all_gather across threads (one per rank), in rank order."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world)

    def for_rank(self, rank: int):
        ex = self

        class _One:
            def all_gather(self, items, what=""):
                ex.slots[rank] = list(items)
                ex.barrier.wait(timeout=30)
                out = [x for part in ex.slots for x in part]
                ex.barrier.wait(timeout=30)
                return out

        return _One()


def score(position: int, index: int, truth: str, rollouts: list[Rollout]) -> RolloutGroup:
    accs = torch.tensor([bool(r.response_ids[0] % 3 == 0) for r in rollouts])
    return RolloutGroup(index, position, truth, rollouts, accs, accs.float() * 2 - 1, torch.zeros(len(rollouts)))


def fresh(offset: int) -> tuple[int, str, list[int]]:
    return 1000 + offset, str(offset), [1, 5 + offset % 7, 9]


def run_step(
    world,
    timing_seed,
    *,
    step=1,
    carry=None,
    target=5,
    window=6,
    cap=60,
    partial=False,
    slots=8,
    enabled=True,
    slow_rank=None,
    over_sampling=0.0,
    max_staleness=-1,
    on_stale="regenerate",
):
    """One stream step on `world` ranks (threads) sharing a HashStore; returns each rank's (result, engine)."""
    store, exchange = dist.HashStore(), ThreadExchange(world)
    carry = carry or [([], {}) for _ in range(world)]
    out: list = [None] * world

    def rank_main(rank: int) -> None:
        engine = FakeEngine(slots, timing_seed * 100 + rank, version=step - 1, slow=rank == slow_rank)
        stream = make_stream(
            engine, rank, exchange.for_rank(rank), store,
            group_size=G, window=window, cap=cap, partial=partial, timeout_s=20, score=score,
            over_sampling=over_sampling, expected_keep=0.5, max_staleness=max_staleness,
            on_stale=on_stale,
        )  # fmt: skip
        stream._keys = 1000 * step  # keys unique across the steps of a test
        rule = DynamicSampler(target_prompts=target, enabled=enabled, max_sampled_prompts=cap, on_cap="partial")
        sampling = rule.start()
        result = stream.run(step, sampling, PARAMS, 7, fresh, carry[rank][0], carry[rank][1])
        out[rank] = (result, engine)

    run_ranks(world, exchange, rank_main)
    return out


def run_ranks(world: int, exchange: ThreadExchange, rank_main) -> None:
    """rank_main(rank) on `world` threads; the first error is raised after all joined (the others are released
    from the exchange's barrier)."""
    errors: list = []

    def guarded(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as err:
            errors.append(err)
            exchange.barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def kept_tokens(out) -> list[tuple[int, list[list[int]]]]:
    """(example index, each response's tokens) of the kept groups in queue order, read from their owners."""
    result = out[0][0]
    rows = {k: g for r, _ in out for k, g in r.groups.items()}
    return [(s.index, [x.response_ids.tolist() for x in rows[s.key].rollouts]) for s in result.kept]


def reference(target: int, step: int = 1) -> list[int]:
    """The example indices a one-rank in-order pass keeps: the first `target` positions with 0 < acc < 1."""
    from megatron_dapo.rollout.base import completion_seed
    from megatron_dapo.rollout.stream import step_seed

    kept, offset = [], 0
    while len(kept) < target:
        index = fresh(offset)[0]
        firsts = [response_of(completion_seed(step_seed(7, step), index, k))[0] for k in range(G)]
        acc = sum(f % 3 == 0 for f in firsts) / G
        if 0 < acc < 1:
            kept.append(index)
        offset += 1
    return kept


@pytest.mark.parametrize("world", [1, 3])
def test_kept_groups_do_not_depend_on_completion_order(world):
    # Random timing, and in each run another rank five times slower than the others.
    runs = [run_step(world, timing_seed, slow_rank=timing_seed % world) for timing_seed in range(4)]
    expected = kept_tokens(runs[0])
    assert [i for i, _ in expected] == reference(5)
    for out in runs[1:]:
        assert kept_tokens(out) == expected
        assert [r.kept[0].index for r, _ in out] == [expected[0][0]] * world  # every rank agrees
    # Different timing moved work between ranks (the queue is not a static shard): the slow rank generated fewer.
    if world > 1:
        owners = [tuple(s.owner for s in out[0][0].kept) for out in runs]
        assert len(set(owners)) > 1, owners


def test_every_response_is_generated_whole_and_abort_leaves_nothing_in_flight():
    out = run_step(3, timing_seed=5)
    for result, engine in out:
        assert engine.num_unfinished() == 0
        assert result.carry == [] and result.carry_rows == {}
        for group in result.groups.values():
            for k, r in enumerate(group.rollouts):
                seed_tokens = response_of(_seed(group.index, k))
                assert r.response_ids.tolist() == seed_tokens and r.finish.finished
    result = out[0][0]
    m = result.metrics
    assert result.consumed == m["sampling/prompts_sampled"]  # prompts past the cut return to the queue
    assert m["stream/prompts_started"] >= m["sampling/prompts_sampled"]
    assert m["sampling/prompts_kept"] == 5 and m["stream/groups_carried"] == 0
    busy = [m[f"stream/engine_busy_fraction/rank{r}"] for r in range(3)]
    assert all(0 <= b <= 1 for b in busy) and m["stream/engine_busy_fraction_min"] == min(busy) and max(busy) > 0


def _seed(index: int, k: int, step: int = 1) -> int:
    from megatron_dapo.rollout.base import completion_seed
    from megatron_dapo.rollout.stream import step_seed

    return completion_seed(step_seed(7, step), index, k)


def test_window_bounds_the_positions_in_flight():
    out = run_step(2, timing_seed=1, window=2, slots=64)
    m = out[0][0].metrics
    assert m["stream/prompts_started"] <= m["sampling/prompts_sampled"] + 2


def test_over_sampling_starts_only_what_dynamic_sampling_still_needs():
    """With room for everything (window 40, 64 slots) the queue starts every position it may; rollout.over_sampling
    holds back what the groups still missing do not need, so less work is aborted at the cut, and the kept groups
    are the same."""
    free = run_step(1, timing_seed=7, window=40, slots=64)
    lean = run_step(1, timing_seed=7, window=40, slots=64, over_sampling=1.0)
    assert kept_tokens(lean) == kept_tokens(free)
    m_free, m_lean = free[0][0].metrics, lean[0][0].metrics
    assert m_lean["stream/prompts_started"] < m_free["stream/prompts_started"]
    assert m_lean["stream/tokens_aborted"] < m_free["stream/tokens_aborted"]


def test_partial_carries_unfinished_work_and_continues_it_next_step():
    first = run_step(2, timing_seed=3, partial=True, slots=16)
    carry = first[0][0].carry
    assert carry and all(e.key in first[e.owner][0].carry_rows for e in carry)
    assert [[e.key for e in r.carry] for r, _ in first] == [[e.key for e in carry]] * 2  # every rank agrees
    # Every position taken is decided or carried (held ones carried unstarted): none is lost or repeated.
    assert first[0][0].consumed == first[0][0].metrics["sampling/prompts_sampled"] + len(carry)
    unfinished = [e for e in carry if e.summary is None]
    assert unfinished, "the fake engine's random timing left nothing in flight; pick another timing_seed"
    before = {e.key: first[e.owner][0].carry_rows[e.key] for e in unfinished}
    second = run_step(
        2,
        timing_seed=4,
        step=2,
        partial=True,
        slots=16,
        carry=[(r.carry, r.carry_rows) for r, _ in first],
        target=len(carry) + 2,
        enabled=False,  # every group kept: the carried ones are the first len(carry) of the batch
    )
    rows = {k: g for r, _ in second for k, g in r.groups.items()}
    assert [s.key for s in second[0][0].kept[: len(carry)]] == [e.key for e in carry]
    for e in unfinished:
        group = rows[e.key]
        for k, (carried, new) in enumerate(zip(before[e.key], group.rollouts)):
            old, ids = carried.response_ids.tolist(), new.response_ids.tolist()
            assert ids[: len(old)] == old  # the carried tokens are kept as generated
            if carried.finish.finished:
                assert new is carried
                continue
            tail = response_of(_seed(e.index, k, step=2))[: PARAMS.max_new_tokens - len(old)]
            assert ids[len(old) :] == tail  # continued with the new step's seed
            assert torch.equal(new.engine_logp[: len(old)], torch.tensor([-0.1 * t for t in old]))
            assert new.segments == (((0, 0), (len(old), 1)) if old else ((0, 1),))
    # Responses carried with tokens are one weight version old; carried ones never started (how many depends on the
    # machine's timing) are not.
    started = any(len(r) for e in unfinished for r in before[e.key])
    assert second[0][0].metrics["stream/response_age_max"] == (1.0 if started else 0.0)


def _ages(out, step: int) -> list[int]:
    """Weight versions behind the trained policy (step - 1) of each segment of the kept responses."""
    rows = {k: g for r, _ in out for k, g in r.groups.items()}
    return [step - 1 - v for x in out[0][0].kept for r in rows[x.key].rollouts for _, v in r.segments]


@pytest.mark.parametrize("bound,on_stale", [(-1, "regenerate"), (0, "regenerate"), (1, "regenerate"), (1, "drop")])
def test_max_staleness_bounds_every_trained_token_across_carried_steps(bound, on_stale):
    # Six steps with partial rollouts, 2 groups kept a step out of up to 10 in flight: most groups are carried, some
    # over several steps. Whatever the engine's timing, no kept token is older than the bound; without one, tokens
    # two or more versions old are trained (the bound is not vacuous here). Every position taken is trained,
    # dropped by sampling, dropped as stale or carried.
    carry, worst, stale, taken, accounted = None, 0, 0.0, 0, 0
    for step in range(1, 7):
        out = run_step(1, timing_seed=step, step=step, partial=True, slots=6, window=10, target=2, enabled=False,
                       carry=carry, max_staleness=bound, on_stale=on_stale)  # fmt: skip
        result, m = out[0][0], out[0][0].metrics
        ages = _ages(out, step)
        assert ages and min(ages) >= 0
        if bound >= 0:
            assert max(ages) <= bound, (step, ages)
        assert m["stream/response_age_max"] == max(ages)  # the oldest segment of a response is its first
        worst = max(worst, max(ages))
        stale += m["stream/stale_responses_restarted"] + m["stream/stale_groups_dropped"]
        if on_stale == "drop":
            assert m["stream/stale_responses_restarted"] == 0
        taken += result.consumed
        accounted += len(result.kept) + m["stream/stale_groups_dropped"]
        carry = [(result.carry, result.carry_rows)]
    assert taken == accounted + len(carry[0][0])  # no position lost or repeated (sampling keeps every group here)
    if bound < 0:
        assert worst >= 2 and stale == 0
    else:
        assert worst == bound and stale > 0


def test_cap_stops_the_step_and_no_position_past_it_is_started():
    out = run_step(2, timing_seed=2, target=50, cap=7)
    result = out[0][0]
    assert result.metrics["sampling/prompts_sampled"] == 7
    assert result.metrics["stream/prompts_started"] == 7
