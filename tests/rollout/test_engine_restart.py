"""In-place engine restarts in the rollout stream: engines killed at seeded random points on random ranks (threads
sharing one store), restarted, re-synced, their lost requests re-queued; the step keeps exactly the groups of an
uninterrupted step, nothing lost or repeated; a prompt past its retry budget is given up and said; past the restart
budget the job ends with one line."""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.errors import JobError
from megatron_dapo.rollout import EngineDied
from tests.rollout._streams import make_stream
from tests.rollout.test_stream import PARAMS
from tests.rollout.test_stream import FakeEngine
from tests.rollout.test_stream import G
from tests.rollout.test_stream import ThreadExchange
from tests.rollout.test_stream import _seed
from tests.rollout.test_stream import fresh
from tests.rollout.test_stream import kept_tokens
from tests.rollout.test_stream import response_of
from tests.rollout.test_stream import run_ranks
from tests.rollout.test_stream import run_step
from tests.rollout.test_stream import score


class DyingEngine(FakeEngine):
    """A FakeEngine that dies in its `die_at`-th step() (None: never): it raises EngineDied and everything in flight
    is gone. A dead engine refuses every further call, and a restarted one refuses work until its weights are synced,
    so a stream that used either would fail the test."""

    def __init__(self, slots, timing_seed, die_at, version=0, synced=True) -> None:
        super().__init__(slots, timing_seed, version)
        self.die_at, self.steps, self.dead, self.synced = die_at, 0, False, synced

    def _alive(self) -> None:
        assert not self.dead, "a dead engine was used"
        assert self.synced, "a restarted engine was used before its weights were synced"

    def submit(self, requests, params):
        self._alive()
        super().submit(requests, params)

    def step(self):
        self._alive()
        self.steps += 1
        if self.die_at is not None and self.steps >= self.die_at:
            self.dead, self.live, self.waiting = True, [], []
            raise EngineDied("the engine process exited with code -9")
        return super().step()

    def abort(self):
        self._alive()
        return super().abort()


def run_with_deaths(world, trial, *, step=1, target=5, window=6, slots=8, deaths=2, max_restarts=10, retries=10,
                    partial=False, carry=None):  # fmt: skip
    """One stream step on `world` ranks whose engines die `deaths` times in all, at seeded random steps on seeded
    random ranks. Returns each rank's (result, last engine, log lines, resync calls)."""
    rng = random.Random(trial)
    plan = [[] for _ in range(world)]  # per rank: the step counts at which its successive engines die
    for _ in range(deaths):
        plan[rng.randrange(world)].append(rng.randint(1, 25))
    store, exchange = dist.HashStore(), ThreadExchange(world)
    carry = carry or [([], {}) for _ in range(world)]
    out: list = [None] * world

    def rank_main(rank: int) -> None:
        dies = list(plan[rank])
        engines = [DyingEngine(slots, trial * 100 + rank, dies.pop(0) if dies else None, version=step - 1)]
        lines: list[str] = []
        syncs: list[list[int]] = []

        def restart():
            engines.append(DyingEngine(slots, trial * 100 + rank + 50, dies.pop(0) if dies else None,
                                       version=-7, synced=False))  # fmt: skip
            return engines[-1]

        def resync(ranks):
            syncs.append(list(ranks))
            if rank in ranks:
                engines[-1].synced = True

        stream = make_stream(
            engines[0], rank, exchange.for_rank(rank), store,
            group_size=G, window=window, cap=60, partial=partial, timeout_s=20, score=score,
            restart=restart, resync=resync, max_restarts=max_restarts, prompt_retries=retries, log=lines.append,
        )  # fmt: skip
        stream._keys = 1000 * step
        rule = DynamicSampler(target_prompts=target, max_sampled_prompts=60, on_cap="partial")
        result = stream.run(step, rule.start(), PARAMS, 7, fresh, carry[rank][0], carry[rank][1])
        out[rank] = (result, engines[-1], lines, syncs)

    run_ranks(world, exchange, rank_main)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_engines_killed_at_random_points_keep_the_uninterrupted_steps_groups(world):
    """8 seeded trials per world size (24 in all): each kills 1-3 engines at random steps on random ranks."""
    expected = kept_tokens(run_step(world, timing_seed=0))
    restarts = planned = 0
    for trial in range(8):
        deaths = 1 + trial % 3
        planned += deaths
        out = run_with_deaths(world, 10 * world + trial, deaths=deaths)
        assert kept_tokens([(r, e) for r, e, *_ in out]) == expected, f"trial {trial}"
        result = out[0][0]
        # Nothing lost or repeated: every kept response is whole, made with its own seed, by the synced weights.
        for r, engine, lines, syncs in out:
            assert engine.num_unfinished() == 0
            for group in r.groups.values():
                for k, x in enumerate(group.rollouts):
                    assert x.response_ids.tolist() == response_of(_seed(group.index, k)) and x.finish.finished
                    assert x.segments == ((0, 0),)  # the version the dead engine had, not the restarted one's -7
            # Every rank met for every restart, with the same ranks, in the same order.
            assert syncs == out[0][3]
            assert all("restarting it in place" in line for line in lines)
        assert sum(len(s) for s in out[0][3]) == result.metrics["stream/engine_restarts"]
        assert result.metrics["sampling/prompts_given_up"] == 0
        keys = [k for r, *_ in out for k in r.groups]
        assert len(keys) == len(set(keys)) == 5
        restarts += result.metrics["stream/engine_restarts"]
    # Most of the planned deaths happen before the step ends (one planned past the engine's last step does not).
    assert restarts >= planned * 2 / 3, (restarts, planned)


def test_partial_step_with_deaths_keeps_its_groups_and_carries_whole_prefixes():
    """rollout.partial: restarts re-queue the lost requests from the prefixes they were carried with; the kept groups
    (which depend only on each response's first token) are those of the uninterrupted step."""
    first = run_step(2, timing_seed=3, partial=True, slots=16)
    carry = [(r.carry, r.carry_rows) for r, _ in first]
    plain = run_step(2, timing_seed=4, step=2, partial=True, slots=16, carry=carry, target=5)
    for trial in range(4):
        out = run_with_deaths(2, 70 + trial, step=2, partial=True, slots=16, carry=carry, deaths=2)
        assert [s.index for s in out[0][0].kept] == [s.index for s in plain[0][0].kept]
        rows = {k: g for r, *_ in out for k, g in r.groups.items()}
        for e in carry[0][0]:
            if e.key not in rows:
                continue
            before = first[e.owner][0].carry_rows[e.key]
            for carried, new in zip(before, rows[e.key].rollouts):
                old = carried.response_ids.tolist()
                assert new.response_ids.tolist()[: len(old)] == old  # the carried tokens survive the restarts


def test_a_prompt_past_its_retries_is_given_up_and_said():
    # One rank, the engine dies at its first step every time: every prompt in flight is charged each time.
    out = run_with_deaths(1, 0, deaths=0, retries=1, max_restarts=10, target=2)  # warm-up: no deaths
    assert out[0][0].metrics["sampling/prompts_given_up"] == 0
    store, exchange = dist.HashStore(), ThreadExchange(1)
    lines: list[str] = []
    engines = [DyingEngine(8, 1, die_at=1)]

    def restart():
        engines.append(DyingEngine(8, 2, die_at=1 if len(engines) < 2 else None, synced=False))
        return engines[-1]

    def resync(ranks):
        engines[-1].synced = True

    stream = make_stream(
        engines[0], 0, exchange.for_rank(0), store, group_size=G, window=2, cap=60, partial=False, timeout_s=20,
        score=score, restart=restart, resync=resync, max_restarts=5, prompt_retries=1, log=lines.append,
    )  # fmt: skip
    rule = DynamicSampler(target_prompts=3, max_sampled_prompts=60, on_cap="partial")
    result = stream.run(1, rule.start(), PARAMS, 7, fresh, [], {})
    # Positions 0 and 1 were in flight through both deaths: given up, decided as such, never trained on.
    assert result.metrics["sampling/prompts_given_up"] == 2
    given_up = [line for line in lines if "given up after 2 engine failures" in line]
    assert len(given_up) == 2 and "rollout.prompt_retries=1" in given_up[0] and "queue position 0" in given_up[0]
    assert [s.position for s in result.kept] == [p for p in [s.position for s in result.kept] if p >= 2]
    assert all(s.position not in (0, 1) for s in result.decided)
    assert len(result.kept) == 3 and result.metrics["stream/engine_restarts"] == 2


def test_past_the_restart_budget_the_job_ends_with_one_line():
    store, exchange = dist.HashStore(), ThreadExchange(1)
    engines = [DyingEngine(8, 1, die_at=3)]

    def restart():
        engines.append(DyingEngine(8, 2, die_at=3, synced=False))
        return engines[-1]

    def resync(ranks):
        engines[-1].synced = True

    stream = make_stream(
        engines[0], 0, exchange.for_rank(0), store, group_size=G, window=4, cap=60, partial=False, timeout_s=20,
        score=score, restart=restart, resync=resync, max_restarts=2, prompt_retries=100,
    )  # fmt: skip
    rule = DynamicSampler(target_prompts=50, max_sampled_prompts=60, on_cap="partial")
    with pytest.raises(JobError) as info:
        stream.run(1, rule.start(), PARAMS, 7, fresh, [], {})
    message = str(info.value)
    assert "\n" not in message and info.value.retryable
    assert "the rollout engine died (the engine process exited with code -9) after 2 in-place restarts" in message
    assert "rollout.engine_restarts=2" in message


def test_an_engine_that_returns_nothing_is_declared_dead_and_restarted():
    class Silent(DyingEngine):
        def step(self):
            self._alive()
            return []  # requests in flight, nothing ever comes back

    store, exchange = dist.HashStore(), ThreadExchange(1)
    engines = [Silent(8, 1, die_at=None)]
    lines: list[str] = []

    def restart():
        engines.append(DyingEngine(8, 2, die_at=None, synced=False))
        return engines[-1]

    def resync(ranks):
        engines[-1].synced = True

    stream = make_stream(
        engines[0], 0, exchange.for_rank(0), store, group_size=G, window=4, cap=60, partial=False, timeout_s=20,
        score=score, restart=restart, resync=resync, max_restarts=1, prompt_retries=3, engine_stall_s=0.3,
        log=lines.append,
    )  # fmt: skip
    rule = DynamicSampler(target_prompts=3, max_sampled_prompts=60, on_cap="partial")
    result = stream.run(1, rule.start(), PARAMS, 7, fresh, [], {})
    assert len(result.kept) == 3 and result.metrics["stream/engine_restarts"] == 1
    assert "returned nothing for 0.005 min with 8 requests in flight (rollout.engine_stall_minutes)" in lines[0]
