"""Every wait of a split launch (rollout.engine_ranks > 0) under each fault of the peer it waits on, in one process
(issue 38 items 3 and 6: the wait family, not its cases).

The real loops (EngineRank.fit, RemoteGeneration's waits), the real Mailbox and heartbeats (placement.launch_watch,
PeerWatch) on a real TCPStore; the peer is a heartbeat that stops (what a SIGSTOP or a SIGKILL looks like from the
store: its beat stands still) and the waiting rank's preemption flag is what torchrun's SIGTERM sets. Each wait must
end, within a bound, in one of: JobError naming the silent peer and what was waited for; a clean return after a
signal. The waits:

    engine rank   the actor's start state | the weights of a step | the actor's stop after the last step
    actor rank 0  a step's generation     | a step's evaluation scores | the engine ranks' join of a weight push

At one engine rank and, for the actor's waits, a 2 x 2 split (the silent one of two engine ranks is named). (The
join is placement.WeightChannel._await_joins with the caller's poll: test_placement.py's
test_a_push_waits_for_the_engine_ranks_with_the_callers_liveness_and_preemption_checks; the whole-job versions of
the generation and weights waits, under torchrun, are test_hangs.py's split-launch cases).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_dapo import engine_rank as engine_rank_module
from megatron_dapo import placement as placement_module
from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.config import load_config
from megatron_dapo.engine_rank import EngineRank
from megatron_dapo.errors import JobError
from megatron_dapo.generation import RemoteGeneration
from megatron_dapo.generation import RolloutContext
from megatron_dapo.placement import Mailbox
from megatron_dapo.placement import Placement
from megatron_dapo.placement import StepGeneration
from megatron_dapo.placement import launch_watch
from megatron_dapo.rollout import stream as stream_module
from tests.rollout.test_stream import ThreadExchange
from tests.rollout.test_stream import score
from tests.test_async_serve import Inputs
from tests.test_async_serve import PushedWeights
from tests.test_async_serve import VersionedEngine

STALL_S = 0.6
"""distributed.timeout_minutes of the watches here, in seconds (a silent peer is named after this)."""
PATIENT_S = 60.0
"""The watch of a SIGTERM case: its peer is silent, but the signal, not the watch, must end the wait."""
BOUND_S = 8.0
"""Every wait here ends within this (a hang is a failure, not a stuck suite)."""
ACTOR, ENGINE = Placement(0, 2, 1), Placement(1, 2, 1)


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setattr(stream_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(placement_module, "STOP_ANSWER_S", 0.5)
    monkeypatch.setattr(engine_rank_module, "GONE_S", 0.3)
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    watches = []
    yield master, watches
    for w in watches:
        w.close()


def _silent_peer(store, placement: Placement, watches: list) -> None:
    """The peer's heartbeat, beaten once and then standing still (a stopped or killed process)."""
    peer = launch_watch(placement, store, 3600.0)
    time.sleep(0.1)
    peer.close()


def _live_peer(store, placement: Placement, watches: list) -> None:
    watches.append(launch_watch(placement, store, 3600.0))


def _bounded(fn):
    """fn() on a thread, within BOUND_S: (its result or exception, seconds)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # handed to the test
            out["error"] = err

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"the wait did not end within {BOUND_S} s"
    return out, time.monotonic() - start


def _assert_named(out: dict, seconds: float, silent: str, waiter: str, wait: str) -> None:
    """The wait ended after the watch's stall with one line naming the silent peer and what `waiter` waited for."""
    error = out.get("error")
    assert isinstance(error, JobError), out
    line = str(error)
    assert "\n" not in line and line.startswith(f"{silent} (host "), line
    assert f"made no progress for {STALL_S:g} s while {waiter} waited for {wait} (distributed.timeout_minutes)" in line
    assert seconds >= STALL_S - 0.2


# ------------------------------------------------------------------------------------------------- engine rank
def _engine(store, watches, *, stall_s: float, signalled: bool, total_steps: int = 2) -> tuple[EngineRank, Mailbox]:
    cfg = load_config(None, [f"--trainer.total_steps={total_steps}", "--trainer.max_staleness=0",
                             "--trainer.eval_every=0", "--algorithm.group_size=2", "--rollout.over_sampling=0",
                             "--rollout.max_inflight_prompts=2"])  # fmt: skip
    sampler = DynamicSampler(target_prompts=1, enabled=False, max_sampled_prompts=4, on_cap="partial")
    preempt = SimpleNamespace(flag=signalled)
    ctx = RolloutContext(cfg, 0, 1, ThreadExchange(1).for_rank(0), Inputs(), sampler, score, lambda: preempt.flag,
                         lambda point: None, lambda line: None)  # fmt: skip
    beat = launch_watch(ENGINE, store, stall_s)
    watches.append(beat)
    box = Mailbox(store)
    return EngineRank(cfg, ctx, VersionedEngine(2, 0, pause_s=0.0), PushedWeights(), box, beat, preempt), box


ENGINE_WAITS = {
    "the actor's start state": None,  # nothing posted
    "the weights of step 1": {"step": 0, "data": {"position": 0}, "carry": []},  # started, no weights pushed
    "the actor's stop": {"step": 2, "data": {"position": 0}, "carry": []},  # resumed at the last step: the end wait
}


@pytest.mark.parametrize("wait", list(ENGINE_WAITS))
def test_an_engine_rank_names_a_silent_actor_in_every_wait(store, wait):
    """SIGSTOP or SIGKILL of actor rank 0 (its beat stands still) while the engine rank waits: one line naming it and
    the wait, after distributed.timeout_minutes. The end wait used to return after placement.GONE_S as if the run had
    finished: the engine exited 0 and the launcher then waited on the stopped actor for ever."""
    master, watches = store
    rank, box = _engine(master, watches, stall_s=STALL_S, signalled=False)
    _silent_peer(master, ACTOR, watches)
    if ENGINE_WAITS[wait] is not None:
        box.post("start", ENGINE_WAITS[wait])
    _assert_named(*_bounded(rank.fit), "actor rank 0", "rank 1", wait)


@pytest.mark.parametrize("wait", list(ENGINE_WAITS))
@pytest.mark.parametrize("actor", ["silent", "live"])
def test_an_engine_rank_honours_sigterm_in_every_wait(store, wait, actor):
    """torchrun's SIGTERM reached the engine rank while it waits: it leaves within placement.GONE_S when the actor is
    silent (it will not say stop), or as soon as a live actor says stop; a step it was to generate is answered as
    interrupted (the actor drops it). Never the distributed timeout's wait, never an error."""
    master, watches = store
    rank, box = _engine(master, watches, stall_s=PATIENT_S, signalled=True)
    (_silent_peer if actor == "silent" else _live_peer)(master, ACTOR, watches)
    if ENGINE_WAITS[wait] is not None:
        box.post("start", ENGINE_WAITS[wait])
    if actor == "live":  # the actor, signalled too, says stop once it has saved
        threading.Timer(0.5, box.post, args=("stop", True)).start()
    out, seconds = _bounded(rank.fit)
    assert out.get("value") == {}, out
    assert seconds < 3.0
    if wait == "the weights of step 1":
        answer = box.take("gen/1", 1, "the answer", "test")
        assert isinstance(answer, StepGeneration) and answer.interrupted


def test_an_engine_rank_after_its_last_step_leaves_when_the_actor_says_stop_and_loads_pushes_until_then(store):
    master, watches = store
    rank, box = _engine(master, watches, stall_s=STALL_S * 10, signalled=False)
    _live_peer(master, ACTOR, watches)
    box.post("start", ENGINE_WAITS["the actor's stop"])
    rank.receiver.push(2)  # the actor's last push, after the engine's last step
    threading.Timer(0.5, box.post, args=("stop", True)).start()
    out, _ = _bounded(rank.fit)
    assert out.get("value") == {} and rank.receiver.loaded == 2, out


# ------------------------------------------------------------------------------------------------- actor rank 0
def _actor(
    store, watches, *, stall_s: float, signalled: bool, placement: Placement = ACTOR
) -> tuple[RemoteGeneration, Mailbox]:
    cfg = load_config(None, ["--trainer.eval_every=2"])
    beat = launch_watch(placement, store, stall_s)
    watches.append(beat)
    box = Mailbox(store)
    ctx = SimpleNamespace(config=cfg, rank=0, stop=lambda: signalled, exchange=ThreadExchange(1).for_rank(0))
    generation = RemoteGeneration(
        ctx, placement=placement, mailbox=box, beat=beat, channel=None, export=lambda: iter(())
    )
    return generation, box


ACTOR_WAITS = {
    "step 1's generation": lambda g: g.generate(1),
    "step 2's evaluation": lambda g: g.eval_scores(2, []),
}


@pytest.mark.parametrize("wait", list(ACTOR_WAITS))
def test_the_actor_names_a_silent_engine_rank_in_every_wait(store, wait):
    master, watches = store
    generation, _ = _actor(master, watches, stall_s=STALL_S, signalled=False)
    _silent_peer(master, ENGINE, watches)
    _assert_named(*_bounded(lambda: ACTOR_WAITS[wait](generation)), "engine rank 1", "rank 0", wait)


@pytest.mark.parametrize("wait", list(ACTOR_WAITS))
def test_with_two_engine_ranks_the_actor_names_the_silent_one(store, wait):
    """Actor ranks 0-1, engine ranks 2-3 (a 2 x 2 split): engine rank 3 stops while engine rank 2 beats on; the actor
    names rank 3 alone (it watches every engine rank; the other actor rank is watched by megatron's collectives, whose
    gloo timeout is distributed.timeout_minutes: rel/test_actor_faults.py)."""
    master, watches = store
    layout = {r: Placement(r, 4, 2) for r in range(4)}
    generation, _ = _actor(master, watches, stall_s=STALL_S, signalled=False, placement=layout[0])
    _live_peer(master, layout[2], watches)
    _silent_peer(master, layout[3], watches)
    out, seconds = _bounded(lambda: ACTOR_WAITS[wait](generation))
    _assert_named(out, seconds, "engine rank 3", "rank 0", wait)
    assert "engine rank 2" not in str(out["error"])


@pytest.mark.parametrize("wait", list(ACTOR_WAITS))
def test_the_actor_honours_sigterm_in_every_wait_on_a_silent_engine_rank(store, wait):
    """The signal came while a stopped or dead engine rank was to answer: the actor gives up its answer after
    placement.STOP_ANSWER_S (the step is dropped; the evaluation is skipped, None) so that the save fits the grace.
    The evaluation wait used to ignore the signal and wait for distributed.timeout_minutes."""
    master, watches = store
    generation, box = _actor(master, watches, stall_s=PATIENT_S, signalled=True)
    _silent_peer(master, ENGINE, watches)
    out, seconds = _bounded(lambda: ACTOR_WAITS[wait](generation))
    assert "error" not in out, out
    if wait == "step 1's generation":
        assert out["value"].interrupted and box.has("stop")  # the engine ranks were asked to stop
    else:
        assert out["value"] is None
    assert placement_module.STOP_ANSWER_S <= seconds < 3.0


def test_the_actor_takes_the_evaluation_scores_every_engine_rank_posted(store):
    master, watches = store
    generation, box = _actor(master, watches, stall_s=STALL_S * 10, signalled=False)
    _live_peer(master, ENGINE, watches)
    box.post("eval/2/0", [[{"acc": 1.0}]])
    out, _ = _bounded(lambda: generation.eval_scores(2, []))
    assert out.get("value") == [[{"acc": 1.0}]], out
