"""An engine rank's loop (EngineRank.fit, issue 24 items 2 and 8) under random latencies, in one process: the
real loop, RolloutStream, Mailbox (on a HashStore) and weight loading (placement.load_buckets), with a fake engine
whose steps take random time and that stamps each token with the weight version it holds, and an actor thread that
takes each step's generation, trains for a random time and pushes the next version after a random delay.

Whatever the timing: every kept token of step s was sampled under weights at most trainer.max_staleness versions
behind the update that trains on it (version >= s - 1 - k), carried partial responses included; each segment's
recorded version is the version the engine held when it sampled those tokens; the engine waits for weights only
when the bound requires it; at k >= 1 it does run ahead (some tokens older than s - 1)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.config import load_config
from megatron_dapo.engine_rank import EngineRank
from megatron_dapo.generation import RolloutContext
from megatron_dapo.placement import Mailbox
from megatron_dapo.placement import StepGeneration
from megatron_dapo.placement import load_buckets
from megatron_dapo.placement import relay_push
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout.base import request_result
from tests.rollout.test_stream import FakeEngine
from tests.rollout.test_stream import G
from tests.rollout.test_stream import ThreadExchange
from tests.rollout.test_stream import fresh
from tests.rollout.test_stream import score

STEPS = 6
WAIT_SLACK_S = 0.05
"""A wait for weights shorter than this is the loop's own polling, not a pause."""


class VersionedEngine(FakeEngine):
    """FakeEngine whose weights change between its steps (load_buckets): a request records a new segment start
    whenever the version changed since its last token, and every sampled token is logged with the version in force,
    by (prompt, the whole response up to that token): the seed of a carried response changes with the step, what it
    has sampled does not."""

    def __init__(self, slots: int, timing_seed: int, pause_s: float) -> None:
        super().__init__(slots, timing_seed, version=0)
        self.pause_s = pause_s
        self.starts: dict[int, list[tuple[int, int]]] = {}  # id(request) -> [(start in this run's ids, version)]
        self.sampled: dict[tuple[tuple[int, ...], tuple[int, ...]], set[int]] = {}
        self.updated_in_flight = 0  # results whose weights changed while they generated

    def begin_weight_update(self) -> None:
        pass

    def update_weights(self, bucket) -> None:
        pass

    def end_weight_update(self, full: bool) -> None:
        pass

    def step(self):
        before = {id(row[0]): len(row[1]) for row in self.live + self.waiting}
        out = super().step()  # at most one token per row; a row that finishes is stamped in _result
        for req, toks, _ in self.live:
            self._stamp(req, toks, before.get(id(req), 0))
        return out

    def _stamp(self, req, toks: list[int], before: int) -> None:
        if len(toks) <= before:
            return
        prompt = tuple(req.prompt_ids.tolist())
        done = [] if req.prefix is None else req.prefix.response_ids.tolist()
        for i in range(before, len(toks)):
            self.sampled.setdefault((prompt, tuple(done + toks[: i + 1])), set()).add(self.weight_version)
        starts = self.starts.setdefault(id(req), [])
        if not starts or starts[-1][1] != self.weight_version:
            starts.append((before, self.weight_version))

    def _result(self, req, toks, reason):
        if reason != FinishReason.ABORT:  # finished in this step: its last token is not stamped yet
            self._stamp(req, toks, len(toks) - 1)
        versions = self.starts.pop(id(req), [])
        self.updated_in_flight += len(versions) > 1
        return request_result(req, toks, [-0.1 * t for t in toks], reason, self.weight_version, versions=versions)


class PushedWeights:
    """StagedReceiver's contract without a channel: the actor thread stages one version at a time (the next push
    waits until that one is loaded), the engine's main thread applies it between engine steps."""

    def __init__(self) -> None:
        self.loaded: int | None = None
        self.received_s = self.loaded_s = 0.0
        self._staged: int | None = None
        self._applied = threading.Event()
        self._applied.set()

    def push(self, version: int) -> None:
        assert self._applied.wait(30), "the engine never loaded the previous push"
        self._applied.clear()
        self._staged = version

    def apply(self, engine) -> int | None:
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        load_buckets(engine, staged, [])
        self.loaded = staged
        self._applied.set()
        return staged

    def close(self) -> None:
        self._applied.set()


class Data:
    """The data iterator's position, advanced by what each step consumed."""

    def __init__(self) -> None:
        self.position = 0

    def skip(self, n: int) -> None:
        self.position += n

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class Inputs:
    """RunInputs' part the loop reads: the data position and each fresh prompt after it, stop ids, no evaluation."""

    def __init__(self) -> None:
        self.train_data, self.stop_ids, self.eval_examples, self.hook = Data(), [2], [], None

    def fresh(self, offset: int):
        return fresh(self.train_data.position + offset)


def _engine_rank(k: int, seed: int, box: Mailbox, weights: PushedWeights, engine: VersionedEngine) -> EngineRank:
    """One engine rank built from its parts: the fake engine and receiver, a mailbox on a HashStore."""
    cfg = load_config(None, [f"--trainer.total_steps={STEPS}", f"--trainer.max_staleness={k}", "--trainer.eval_every=0",
                             "--rollout.partial=true", "--trainer.on_stale=regenerate",
                             "--algorithm.rollout_correction=tis", f"--algorithm.group_size={G}",
                             "--rollout.max_inflight_prompts=6", "--rollout.over_sampling=0",
                             "--rollout.generation_timeout_minutes=0.5"])  # fmt: skip
    sampler = DynamicSampler(target_prompts=2, enabled=False, max_sampled_prompts=60, on_cap="partial")
    exchange = ThreadExchange(1).for_rank(0)
    ctx = RolloutContext(cfg, 0, 1, exchange, Inputs(), sampler, score, lambda: False, lambda point: None, print)
    preempt = SimpleNamespace(flag=False)
    beat = SimpleNamespace(check=lambda what: None, silent_s=lambda rank: 0.0, close=lambda: None)  # the actor lives
    rank = EngineRank(cfg, ctx, engine, weights, box, beat, preempt)
    assert cfg.trainer.max_staleness == k and cfg.rollout.partial and rank.stream.config.window == 6
    return rank


def _actor(box: Mailbox, weights: PushedWeights, seed: int, train_s: float, out: dict) -> None:
    """Actor rank 0 in short: start state and version 0, then per step take its generation, train for a random
    time, push the step's weights after a random delay; stop after the last push."""
    rng = random.Random(seed)
    box.post("start", {"step": 0, "data": {"position": 0}, "carry": []})
    weights.push(0)
    for step in range(1, STEPS + 1):
        out[step] = box.take(f"gen/{step}", 30, f"step {step}'s generation", "test")
        time.sleep(rng.random() * train_s)
        threading.Timer(rng.random() * train_s / 2, weights.push, args=(step,)).start()
    time.sleep(train_s)
    box.post("stop", True)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_serve_keeps_every_token_within_the_staleness_bound_under_random_latencies(k, seed):
    box, weights = Mailbox(dist.HashStore()), PushedWeights()
    engine = VersionedEngine(slots=6, timing_seed=seed, pause_s=0.004)
    trainer = _engine_rank(k, seed, box, weights, engine)
    # What the engine held when each step started and ended (to tell a wait the bound needed from one it did not).
    held: dict[int, tuple[int | None, int | None]] = {}
    run = trainer.stream.run

    def watched_run(step, *args):
        start = weights.loaded
        result = run(step, *args)
        held[step] = (start, weights.loaded)
        return result

    trainer.stream.run = watched_run
    generations: dict[int, StepGeneration] = {}
    actor = threading.Thread(target=_actor, args=(box, weights, seed, 0.05, generations))
    actor.start()
    trainer.fit()
    actor.join(30)
    assert sorted(generations) == list(range(1, STEPS + 1))

    ages, checked = [], 0
    for step, gen in generations.items():
        assert not gen.interrupted and gen.kept
        oldest = step - 1 - k
        assert held[step][0] is not None and held[step][0] >= oldest, (step, held[step])
        for summary in gen.kept:
            for rollout in gen.groups[summary.key].rollouts:
                prompt, ids = tuple(rollout.prompt_ids.tolist()), rollout.response_ids.tolist()
                starts = [start for start, _ in rollout.segments] + [len(ids)]
                for (start, version), end in zip(rollout.segments, starts[1:], strict=False):
                    assert oldest <= version <= step - 1, (step, version, rollout.segments)
                    ages.append(step - 1 - version)
                    for i in range(start, end):  # the version the engine held when it sampled token i
                        assert version in engine.sampled[(prompt, tuple(ids[: i + 1]))], (step, i, rollout.segments)
                        checked += 1
        # The loop paused only for the bound: when the weights held after the step before were recent enough,
        # this step started at once.
        previous = held.get(step - 1, (None, 0))[1]
        if step > 1 and previous is not None and previous >= oldest:
            assert gen.metrics["time/engine_wait_for_weights"] < WAIT_SLACK_S, (step, held, gen.metrics)
    assert checked > 0 and max(ages) <= k
    if k == 0:
        assert set(ages) == {0}
    else:
        assert max(ages) >= 1  # generation ran ahead of the update: the bound is not vacuous
        assert engine.updated_in_flight > 0  # and weights were loaded under requests in flight


class _PausingServers:
    """SGLangServerEngine's update surface as the relay drives it (placement.relay_push): a pause around the update,
    the version stamped at its end, a failure in the `fail_at`-th bucket; `calls` is shared with the stream's log."""

    def __init__(self, calls: list[str], fail_at: int | None = None) -> None:
        self.calls, self.buckets = calls, []
        self.weight_version, self.fail_at = 0, fail_at

    def paused_update(self, version: int):
        from contextlib import contextmanager

        @contextmanager
        def paused():
            self.calls.append("pause")
            try:
                yield
            finally:
                self.calls.append("continue")
            self.weight_version = version

        return paused()

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def update_weights(self, bucket) -> None:
        if len(self.buckets) == self.fail_at:
            raise RuntimeError("sglang server http://x/update_weights_from_distributed: HTTP 500")
        self.calls.append("bucket")
        self.buckets.append([name for name, _ in bucket])

    def end_weight_update(self, *, full: bool = True) -> None:
        self.calls.append("end")


class _Streamed:
    """DirectChannel.stream's surface: version 3's tensors (4 bytes each), logged as each is rebuilt and when the
    stream is closed (the receiving thread stops)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def stream(self):
        def rebuilt():
            try:
                for name in "abcde":
                    self.calls.append(f"rebuilt {name}")
                    yield name, torch.zeros(1)
            finally:
                self.calls.append("closed")

        return 3, rebuilt()


def test_the_relay_streams_into_servers_under_a_pause_and_a_failed_one_keeps_the_old_version():
    """The direct route's relay into SGLang servers (placement.relay_push): the servers pause only once the first
    tensor is rebuilt, each bucket goes as soon as its tensors are (never the whole push at once), the update stamps
    its version inside the pause; a bucket the server refuses continues the servers, closes the stream and raises,
    the version where it was (RelayReceiver's thread raises it on the main thread: the job ends, and the next push
    after the restart is full, a fresh DeltaDecoder holding no base)."""
    calls: list[str] = []
    servers = _PausingServers(calls)
    assert relay_push(_Streamed(calls), servers, bucket_bytes=8)[0] == 3
    assert calls[:3] == ["rebuilt a", "pause", "begin"]
    assert calls[3:] == ["rebuilt b", "rebuilt c", "bucket", "rebuilt d", "rebuilt e", "bucket", "closed", "bucket",
                         "end", "continue"]  # fmt: skip
    assert servers.buckets == [["a", "b"], ["c", "d"], ["e"]] and servers.weight_version == 3
    calls.clear()
    failing = _PausingServers(calls, fail_at=1)
    with pytest.raises(RuntimeError, match="HTTP 500"):
        relay_push(_Streamed(calls), failing, bucket_bytes=8)
    assert calls.count("bucket") == 1 and calls[-2:] == ["continue", "closed"] and failing.weight_version == 0
