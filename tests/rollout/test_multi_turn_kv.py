"""The embedded engine keeps a stopped turn's KV cache for the trajectory's next turn (SamplingParams.multi_turn):
the next turn prefills only what is new, its logits match an fp64 forward of the whole context (an oracle this engine
did not write), its tokens do not depend on what shares the engine, and the kept caches go with a weight update."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.envs.base import Turn
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import GenerationRequest
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout.turns import run_trajectories
from tests.rollout.test_continuous_batching import wider_llama

OBSERVATION = (7, 8, 9, 10, 11)
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 4, 8, 20, 40, 33]]
PARAMS = SamplingParams(n=3, max_new_tokens=40, temperature=1.0, seed=11, stop_token_ids=(3, 4, 5, 6))
"""Stop tokens common under the random model, so turns end on their own."""


class _Episode:
    """Three turns: a fixed observation after each of the first two."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, turn_ids) -> Turn:
        self.turns += 1
        return Turn(False, observation_ids=OBSERVATION) if self.turns < 3 else Turn(True, reward=1.0)

    def finish(self, stop: str) -> Turn:
        return Turn(True, reward=0.0, details={"stop": stop})


def _engine(model, **kw) -> TransformersEngine:
    return TransformersEngine(model, max_running=8, max_context=128, **kw)


def _trajectories(engine, prompts=PROMPTS, params=PARAMS):
    return run_trajectories(engine, prompts, lambda i: _Episode(), params)


def test_a_next_turn_prefills_only_what_is_new_and_its_tokens_do_not_depend_on_the_batch():
    model = wider_llama()
    engine = _engine(model)
    together = _trajectories(engine)
    turns = sum(len(r.observations) for r in together)
    assert turns >= 3  # the trajectories did continue
    context = sum(len(p) for p in PROMPTS) * PARAMS.n
    # Turn 1: each prompt once (shared by its n requests); later turns: the last token and the observation only.
    assert engine.prefilled_tokens == sum(len(p) for p in PROMPTS) + turns * (1 + len(OBSERVATION)) < context + turns
    alone = _trajectories(_engine(model), PROMPTS[:1])  # the first prompt's trajectories alone: the same bits
    for a, b in zip(together[: PARAMS.n], alone, strict=True):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.engine_logp, b.engine_logp)
        assert a.observations == b.observations


def test_a_kept_turn_continues_with_the_logits_of_an_fp64_forward_of_the_whole_context():
    model = wider_llama()
    engine = _engine(model)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(3, 4, 5, 6), multi_turn=True)
    engine.submit([GenerationRequest("t", PROMPTS[2], 5)], params)
    first = []
    while engine.num_unfinished():
        first += engine.step()
    rollout = first[0][1]
    assert engine._kept  # the stopped row's KV was kept
    trajectory = rollout.observe(OBSERVATION, engine.weight_version)
    context = PROMPTS[2] + trajectory.response_ids.tolist()
    before = engine.prefilled_tokens
    keys, values, logits, _ = engine._prefill(tuple(context))
    assert engine.prefilled_tokens - before == 1 + len(OBSERVATION) and not engine._kept
    exact = model.double()(torch.tensor([context])).logits[0, -1]
    model.float()
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=1e-4)
    # the cache it built is the whole context's: its KV also matches a full prefill's
    fresh = _engine(model)
    full_keys, _, full_logits, _ = fresh._prefill(tuple(context))
    assert keys[0].shape == full_keys[0].shape
    torch.testing.assert_close(keys[-1], full_keys[-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("drop", ["weights", "abort", "single_turn"])
def test_a_weight_update_or_an_abort_drops_the_kept_turns_and_single_turn_keeps_none(drop):
    model = wider_llama()
    engine = _engine(model)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(3, 4, 5, 6), multi_turn=drop != "single_turn")
    engine.submit([GenerationRequest(("p", k), PROMPTS[0], 20 + k) for k in range(6)], params)
    while engine.num_unfinished():
        engine.step()
    if drop == "single_turn":
        assert not engine._kept
        return
    assert 0 < len(engine._kept) <= engine.max_running
    if drop == "weights":
        engine.load_weights(list(model.state_dict().items()))
    else:
        engine.abort()
    assert not engine._kept


def test_at_most_max_running_turns_are_kept_the_oldest_go_first():
    model = wider_llama()
    engine = TransformersEngine(model, max_running=4, max_context=128)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=(3, 4, 5, 6), multi_turn=True)
    order = []
    for k in range(30):
        engine.submit([GenerationRequest(("p", k), PROMPTS[k % 3], 50 + k)], params)
        while engine.num_unfinished():
            for _, r in engine.step():
                if r.finish is FinishReason.STOP:  # a response cut at the cap has no next turn: nothing kept
                    order.append(tuple(PROMPTS[k % 3] + r.response_ids.tolist()[:-1]))
    assert len(order) > 4 and list(engine._kept) == order[-4:]
