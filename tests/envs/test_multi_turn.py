"""Multi-turn trajectories through the rollout stream (issue 40 item 2): token in / token out.

The trajectory the actor trains on is exactly the engine's sampled ids of each turn, in order, plus the observation
ids the environment produced; observation tokens are masked out of the loss and carry engine log-prob 0; the
python_tool environment runs a real sandboxed call between turns; the cap bounds the whole trajectory."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from megatron_dapo import wire
from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import ConfigError
from megatron_dapo.config import RewardConfig
from megatron_dapo.config import RolloutConfig
from megatron_dapo.config import RunConfig
from megatron_dapo.envs.base import Turn
from megatron_dapo.envs.base import environment_for_run
from megatron_dapo.envs.python_tool import observation_text
from megatron_dapo.experience import GroupScorer
from megatron_dapo.experience import rows_to_batch
from megatron_dapo.experience import sampled_response_metrics
from megatron_dapo.reward import make_verifier
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout.base import request_result
from tests.rollout._streams import make_stream
from tests.rollout.conftest import EOS
from tests.rollout.conftest import tiny_model


def test_observation_spans_on_a_rollout():
    r = Rollout([1, 2], [5, 6], [-0.5, -0.25], FinishReason.STOP, ((0, 3),))
    t = r.observe([40, 41, 42], version=4)
    assert t.response_ids.tolist() == [5, 6, 40, 41, 42] and t.observations == ((2, 5),) and t.turn_start == 5
    assert t.engine_logp.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0] and t.finish is FinishReason.ABORT
    assert t.segments == ((0, 3), (2, 4)) and t.model_tokens == 2
    t = t.extend([7, 8], [-1.0, -2.0], 4)
    assert t.observations == ((2, 5),) and t.model_mask().tolist() == [True, True, False, False, False, True, True]
    assert Rollout.from_state(t.to_state()).observations == t.observations
    assert wire.loads(wire.dumps(t)).observations == t.observations
    assert t.routing_layers(None).observations == t.observations
    assert Rollout.from_state({**r.to_state()}).observations == ()  # a checkpoint from before multi-turn
    for bad in (((1, 1),), ((2, 9),), ((3, 4), (1, 2))):
        with pytest.raises(ValueError, match="Rollout.observations"):
            Rollout([1], [5, 6, 7, 8], None, FinishReason.STOP, observations=bad)


class _OneThread:
    """The stream's exchange on one rank."""

    world_size = 1

    def all_gather(self, items, what=""):
        return list(items)


def records_of(prompts):
    """The stream's episode hook over `prompts` ((index, truth, ids) each): each episode starts from its prompt's
    record, as the trainer's does (RunInputs.record)."""
    by_index = {index: {"index": index, "ground_truth": truth} for index, truth, _ in prompts}
    return lambda episode: lambda index, truth: episode(truth, by_index[index])


def run_stream(engine, episode, scorer, params, *, prompts, group_size, target):
    stream = make_stream(
        engine, 0, _OneThread(), dist.HashStore(), group_size=group_size, window=8, cap=0, partial=False,
        timeout_s=60, score=scorer, episode=records_of(prompts)(episode),
    )  # fmt: skip
    sampling = DynamicSampler(target_prompts=target, enabled=False, max_sampled_prompts=0).start()
    fresh = lambda offset: prompts[offset % len(prompts)]
    result = stream.run(1, sampling, params, 7, fresh, [], {})
    stream.close()
    return result


class ScriptedEngine:
    """A streaming engine whose "model" writes a scripted text per turn (turn = observations so far): the ids it
    returns are recorded per request, so the test knows exactly what was sampled."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tok, self.turns, self.weight_version = tok, turns, 3
        self.pending: list = []
        self.sampled: dict = {}  # key -> [ids of each turn, as returned]

    def submit(self, requests, params):
        self.pending.extend(requests)

    def free_slots(self):
        return 8 - len(self.pending)

    def num_unfinished(self):
        return len(self.pending)

    def step(self):
        out = []
        for req in self.pending:
            turn = 0 if req.prefix is None else len(req.prefix.observations)
            ids = self.tok.encode(self.turns[turn], add_special_tokens=False) + [self.tok.eos_token_id]
            self.sampled.setdefault(req.key, []).append(ids)
            logps = [-0.01 * (i + 1) for i in range(len(ids))]
            out.append((req.key, request_result(req, ids, logps, FinishReason.STOP, self.weight_version)))
        self.pending = []
        return out

    def abort(self):
        return []


def test_python_tool_trajectories_through_the_stream_are_the_sampled_ids(byte_tokenizer):
    tok = byte_tokenizer
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12 * 34)"}}</tool_call>'
    engine = ScriptedEngine(tok, [f"Let me compute.\n{call}", "12 * 34 = 408\nAnswer: 408"])
    reward = RewardConfig(environment="python_tool", tool_timeout_s=20)
    env = environment_for_run(reward, tokenizer=tok, verifier=make_verifier("answer_line"), max_tokens=400)
    scorer = GroupScorer(tok, None, AlgorithmConfig(overlong_penalty=False), 400, env)
    prompts = [(10, "408", [5, 6, 7]), (11, "409", [5, 6, 8])]
    params = SamplingParams(max_new_tokens=400)
    result = run_stream(engine, env.episode, scorer, params, prompts=prompts, group_size=2, target=2)

    obs = tok.encode(observation_text(tok, "408"), add_special_tokens=False)  # the tool's stdout, one tool message
    groups = [result.groups[s.key] for s in result.decided]
    assert [g.index for g in groups] == [10, 11]
    rows = []
    for g in groups:
        assert g.rewards.tolist() == ([1.0, 1.0] if g.truth == "408" else [-1.0, -1.0])
        assert g.episodes["turns"].tolist() == [2.0, 2.0] and g.episodes["tool_calls"].tolist() == [1.0, 1.0]
        assert g.episodes["observation_tokens"].tolist() == [float(len(obs))] * 2
        for k, r in enumerate(g.rollouts):
            first, second = engine.sampled[(g.position, k)]
            assert r.response_ids.tolist() == first + obs + second  # byte for byte: sampled, observed, sampled
            assert r.observations == ((len(first), len(first) + len(obs)),) and r.finish is FinishReason.STOP
            expected_logp = [-0.01 * (i + 1) for i in range(len(first))] + [0.0] * len(obs)
            expected_logp += [-0.01 * (i + 1) for i in range(len(second))]
            torch.testing.assert_close(r.engine_logp, torch.tensor(expected_logp), rtol=0, atol=0)
            rows.append((r, g.position))
    batch = rows_to_batch(rows, torch.ones(len(rows)), torch.ones(len(rows)), pad_token_id=0)
    for b, (r, _) in enumerate(rows):
        p, n = len(r.prompt_ids), len(r)
        assert batch.tokens[b, p : p + n].tolist() == r.response_ids.tolist()
        assert batch.loss_mask[b, p : p + n].bool().tolist() == r.model_mask().tolist()
    assert int(batch.loss_mask.sum()) == sum(r.model_tokens for r, _ in rows)  # the token-level loss's count
    metrics = sampled_response_metrics(result.decided)
    assert metrics["episode/tool_calls"] == 1.0 and metrics["episode/reward_by_tool_calls/1"] == 0.0
    assert metrics["episode/stop/answer"] == 1.0 and metrics["episode/stop/length"] == 0.0


def assert_trained_as_sampled(rollouts, expected: list[tuple[list[int], list[bool]]]) -> None:
    """Token in / token out up to the loss (issue 40 item 2): the actor's batch of these rollouts (rows_to_batch, the
    rows the update trains on) holds each row's prompt, then exactly expected[i][0] (the engine's sampled ids of every
    turn with the observation ids between them, recorded apart from the rollout), then padding; its loss mask is
    expected[i][1] (the sampled ids only) and 0 elsewhere."""
    rows = [(r, 0) for r in rollouts]
    batch = rows_to_batch(rows, torch.ones(len(rows)), torch.ones(len(rows)), pad_token_id=0)
    for b, (r, (ids, mask)) in enumerate(zip(rollouts, expected, strict=True)):
        p, n = len(r.prompt_ids), len(ids)
        assert batch.tokens[b, :p].tolist() == r.prompt_ids.tolist()
        assert batch.tokens[b, p : p + n].tolist() == ids, b
        assert batch.loss_mask[b, p : p + n].bool().tolist() == mask, b
        assert not batch.loss_mask[b, :p].any() and not batch.loss_mask[b, p + n :].any()
    assert int(batch.loss_mask.sum()) == sum(sum(mask) for _, mask in expected)  # the token-level loss's count


class ThreeTurns:
    """A scripted multi-turn environment: observations (60 + turn, 61, 62) after the first two turns, done after the
    third; records every turn it was given."""

    multi_turn = True

    def __init__(self) -> None:
        self.seen: list[list[list[int]]] = []
        self.records: list[tuple[str, dict | None]] = []
        self.lock = threading.Lock()

    def episode(self, truth: str, record: dict | None = None):
        turns = []
        with self.lock:
            self.seen.append(turns)
            self.records.append((truth, record))

        class _Episode:
            def step(self, turn_ids):
                turns.append(turn_ids.tolist())
                if len(turns) < 3:
                    return Turn(False, observation_ids=(60 + len(turns), 61, 62))
                return self.finish("answer")

            def finish(self, stop):
                acc = sum(map(sum, turns)) % 2 == 0
                details = {"score": 1.0 if acc else -1.0, "acc": acc, "turns": len(turns), "tool_calls": 0,
                           "stop": stop}  # fmt: skip
                return Turn(True, reward=details["score"], details=details)

            def state(self):
                return {"turns": [list(t) for t in turns]}

            def restore(self, state):
                turns[:] = [list(t) for t in state["turns"]]

        return _Episode()


class Recording:
    """Wraps an engine; records every finished result's newly sampled ids (what the engine generated this turn)."""

    def __init__(self, engine) -> None:
        self.engine, self.sampled, self.requests = engine, {}, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests, params):
        for r in requests:
            self.requests[r.key] = 0 if r.prefix is None else len(r.prefix)
        self.engine.submit(requests, params)

    def step(self):
        out = self.engine.step()
        for key, r in out:
            done = self.requests[key]
            self.sampled.setdefault(key, []).append((r.response_ids[done:].tolist(), r.engine_logp[done:].clone()))
        return out


def _real_engine_run(max_running: int, cap: int):
    engine = Recording(TransformersEngine(tiny_model("qwen2", seed=3), eos_token_ids=(EOS,), max_running=max_running,
                                          max_context=64))  # fmt: skip
    env = ThreeTurns()
    scorer = GroupScorer(None, None, AlgorithmConfig(overlong_penalty=False), cap, env)
    params = SamplingParams(max_new_tokens=cap, stop_token_ids=tuple(range(3, 30)), seed=None)
    prompts = [(20 + i, "0", [1, 5 + i, 9]) for i in range(3)]
    result = run_stream(engine, env.episode, scorer, params, prompts=prompts, group_size=4, target=3)
    return result, engine, env


def test_each_episode_starts_from_its_prompts_record():
    """Issue 40 item 1: the stream hands the episode factory the example index of the trajectory's prompt, and the
    trainer's hook (RunInputs.record) turns it into that prompt's record: every episode of every group got the record
    of its own prompt, carried ones included."""
    result, _, env = _real_engine_run(max_running=8, cap=40)
    assert env.records and all(record is not None and record["ground_truth"] == truth for truth, record in env.records)
    indices = {record["index"] for _, record in env.records}
    assert {g.index for g in result.groups.values()} <= indices <= {20, 21, 22}


@pytest.mark.parametrize("cap", [40, 9])
def test_real_engine_three_turns_token_in_token_out(cap):
    result, engine, _ = _real_engine_run(max_running=8, cap=cap)
    turns_seen, trained, expected = [], [], []
    for s in result.decided:
        g = result.groups[s.key]
        for k, r in enumerate(g.rollouts):
            sampled = engine.sampled[(g.position, k)]
            ids, logps, mask = [], [], []
            for t, (turn, turn_logp) in enumerate(sampled):
                ids += turn
                logps.append(turn_logp)
                mask += [True] * len(turn)
                if t < len(r.observations):
                    obs = [60 + t + 1, 61, 62]
                    ids += obs
                    logps.append(torch.zeros(3))
                    mask += [False] * 3
            assert r.response_ids.tolist() == ids  # the engine's ids of every turn, in order, and the observations
            assert r.model_mask().tolist() == mask and r.model_mask()[-1]  # never ends on an observation
            torch.testing.assert_close(r.engine_logp, torch.cat(logps), rtol=0, atol=0)
            assert len(r) <= cap
            trained.append(r)
            expected.append((ids, mask))
            turns_seen.append(len(sampled))
            if r.finish is FinishReason.LENGTH:
                assert len(r) == cap or len(sampled) < 3  # cut mid-turn at the cap, or no room for a next turn
    assert_trained_as_sampled(trained, expected)
    if cap == 40:
        assert max(turns_seen) == 3 and all(n == 3 for n in turns_seen)
    else:
        assert min(turns_seen) < 3  # the cap ends some trajectories early
    again, _, _ = _real_engine_run(max_running=3, cap=cap)  # other batching: the same trajectories (batch-invariant)
    for s, t in zip(result.decided, again.decided, strict=True):
        for a, b in zip(result.groups[s.key].rollouts, again.groups[t.key].rollouts, strict=True):
            assert a.response_ids.tolist() == b.response_ids.tolist() and a.observations == b.observations


def test_multi_turn_config():
    carried = RunConfig(reward=RewardConfig(environment="python_tool"), rollout=RolloutConfig(partial=True))
    assert carried.rollout.partial and carried.reward.multi_turn  # trajectories may be carried across steps
    with pytest.raises(ConfigError, match=r"reward.environment: must be one of \['python_tool', 'single_turn'\]"):
        RewardConfig(environment="chess")
    with pytest.raises(ConfigError, match=r"reward.max_turns: must be in"):
        RewardConfig(max_turns=0)
    assert RewardConfig(environment="python_tool").multi_turn and not RewardConfig().multi_turn


def _multi_turn_step(deaths: list[int]):
    """One multi-turn stream step on one rank over tests/rollout's FakeEngine, whose engine dies at its step counts
    `deaths` (restarted in place, re-synced); returns (result, the engines, each final trajectory's episode turns)."""
    from tests.rollout.test_engine_restart import DyingEngine
    from tests.rollout.test_stream import fresh

    deaths = list(deaths)
    engines = [DyingEngine(8, 0, deaths.pop(0) if deaths else None)]

    def restart():
        engines.append(DyingEngine(8, len(engines), deaths.pop(0) if deaths else None, synced=False))
        return engines[-1]

    def resync(ranks):
        engines[-1].synced = True

    env = ThreeTurns()
    scorer = GroupScorer(None, None, AlgorithmConfig(overlong_penalty=False), 60, env)
    stream = make_stream(
        engines[0], 0, _OneThread(), dist.HashStore(), group_size=4, window=6, cap=60, partial=False, timeout_s=20,
        score=scorer, episode=lambda index, truth: env.episode(truth, {"index": index, "ground_truth": truth}),
        restart=restart, resync=resync, max_restarts=10, prompt_retries=10,
    )  # fmt: skip
    rule = DynamicSampler(target_prompts=4, max_sampled_prompts=60, on_cap="partial")
    result = stream.run(1, rule.start(), SamplingParams(max_new_tokens=60), 7, fresh, [], {})
    stream.close()
    return result, engines


def test_an_engine_restart_mid_trajectory_starts_it_again_with_a_new_episode():
    """Engines killed while trajectories are between turns: the lost trajectories restart from their first turn with
    a fresh episode (an episode kept across the restart would count the lost turns), and the step keeps the same
    trajectories as an uninterrupted one (seeds per turn)."""
    expected, _ = _multi_turn_step([])
    for deaths in ([3], [2, 9], [5, 6, 20]):
        result, engines = _multi_turn_step(deaths)
        assert result.metrics["stream/engine_restarts"] == len(engines) - 1 >= 1
        got = [[r.response_ids.tolist() for r in result.groups[s.key].rollouts] for s in result.kept]
        assert got == [[r.response_ids.tolist() for r in expected.groups[s.key].rollouts] for s in expected.kept]
        for s in result.kept:
            group = result.groups[s.key]
            # Each outcome's episode saw exactly the turns its trajectory holds (one more than its observations).
            assert group.episodes["turns"].tolist() == [1.0 + len(r.observations) for r in group.rollouts]
        assert sum(len(r.observations) for s in result.kept for r in result.groups[s.key].rollouts) > 0


def test_partial_rollouts_carry_trajectories_mid_turn_with_their_episodes():
    """rollout.partial: trajectories cut at a step's end are carried mid-turn with their episode's state
    (Rollout.episode["state"], through a checkpoint's plain containers), continue in the next step from the same
    tokens with the episode restored (its turns count on; not reset), and end with 3 turns as uninterrupted ones."""
    engine = TransformersEngine(tiny_model("qwen2", seed=3), eos_token_ids=(EOS,), max_running=4, max_context=64)
    env = ThreeTurns()
    scorer = GroupScorer(None, None, AlgorithmConfig(overlong_penalty=False), 40, env)
    prompts = [(20 + i, "0", [1, 5 + i, 9]) for i in range(8)]
    stream = make_stream(
        engine, 0, _OneThread(), dist.HashStore(), group_size=4, window=6, cap=0, partial=True, timeout_s=60,
        score=scorer, episode=records_of(prompts)(env.episode),
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=40, stop_token_ids=tuple(range(3, 30)))
    fresh = lambda offset: prompts[offset % len(prompts)]
    first = stream.run(1, DynamicSampler(target_prompts=1, enabled=False).start(), params, 7, fresh, [], {})
    carried = {key: [Rollout.from_state(r.to_state()) for r in rows] for key, rows in first.carry_rows.items()}
    unfinished = [r for rows in carried.values() for r in rows if not r.finish.finished and len(r)]
    assert unfinished, "the cut left no trajectory in flight"
    for r in unfinished:
        # Each turn the episode read was followed by an observation (the trajectory went on).
        assert len(r.episode["state"]["turns"]) == len(r.observations)
    engine.weight_version = 1
    second = stream.run(2, DynamicSampler(target_prompts=8, enabled=False).start(), params, 7, fresh, first.carry,
                        carried)  # fmt: skip
    stream.close()
    continued = 0
    for entry in first.carry:
        group = second.groups.get(entry.key)
        if group is None:
            continue
        for before, after in zip(carried[entry.key], group.rollouts, strict=True):
            # Continued, not restarted: the carried tokens stay, the episode's turns count on.
            assert after.response_ids[: len(before)].tolist() == before.response_ids.tolist()
            assert after.episode["outcome"]["details"]["turns"] == 1 + len(after.observations)
            if not before.finish.finished and len(before):
                continued += 1
                assert after.segments[-1][1] == 1
                assert after.observations[: len(before.observations)] == before.observations
    assert continued > 0


def test_evaluation_runs_multi_turn_trajectories():
    """The evaluation driver with a multi-turn environment (rollout/turns.run_trajectories): each response is a
    trajectory scored by its episode's outcome, the same trajectories whatever the engine's batching."""
    from megatron_dapo.evaluate import sample_scores
    from megatron_dapo.rollout.turns import run_trajectories

    prompts = [[1, 5, 9], [1, 6, 9], [1, 7]]
    params = SamplingParams(n=3, max_new_tokens=40, stop_token_ids=tuple(range(3, 30)), seed=11)
    runs = []
    for running in (8, 2):
        engine = TransformersEngine(tiny_model("qwen2", seed=3), eos_token_ids=(EOS,), max_running=running,
                                    max_context=64)  # fmt: skip
        env = ThreeTurns()
        runs.append(run_trajectories(engine, prompts, lambda i, env=env: env.episode("0"), params))
    for a, b in zip(*runs, strict=True):
        assert a.response_ids.tolist() == b.response_ids.tolist() and a.observations == b.observations
        assert a.episode["outcome"]["details"]["turns"] == 1 + len(a.observations)
    assert max(len(r.observations) for r in runs[0]) == 2  # three turns somewhere
    engine = TransformersEngine(tiny_model("qwen2", seed=3), eos_token_ids=(EOS,), max_running=8, max_context=64)
    scores = sample_scores(engine, prompts, ["0"] * 3, None, None, params, ThreeTurns())
    assert [[s["turns"] for s in group] for group in scores] == [
        [1 + len(r.observations) for r in runs[0][i * 3 : i * 3 + 3]] for i in range(3)
    ]
