"""Multi-turn trajectories on any engine of the streaming contract (rollout/base.py): one turn's rule, used by the
rollout stream (training) and by the blocking driver below (evaluation).

    turn finished --next_turn--> the episode reads it (the tokens after the last observation)
        not done, room for the observation and one more token -> the trajectory with the observation appended: the
                                                                 caller submits it as the next request's prefix
        done, or no room (cap: the whole trajectory)          -> None: the outcome is in rollout.episode
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.base import completion_seed
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout


def next_turn(episode: Any, rollout: Rollout, cap: int, version: int) -> Rollout | None:
    """The episode reads the turn `rollout` just finished. Returns the trajectory to continue (its observation
    appended with Rollout.observe, stamped `version`), or None when it ended: rollout.episode is then
    {"outcome": {"reward", "details"}}, and finish LENGTH when the observation and a next turn no longer fit under
    `cap` (SamplingParams.max_new_tokens, which counts the whole trajectory; episode.finish("length"))."""
    turn = episode.step(rollout.response_ids[rollout.turn_start :])
    if not turn.done:
        if rollout.finish is FinishReason.LENGTH or cap - len(rollout) - len(turn.observation_ids) < 1:
            turn = episode.finish("length")
            rollout.finish = FinishReason.LENGTH
        else:
            return rollout.observe(turn.observation_ids, version)
    rollout.episode = {"outcome": {"reward": float(turn.reward), "details": dict(turn.details)}}
    return None


def turn_seed(seed: int, index: int, sample: int, group_size: int, turn: int) -> int:
    """The generator seed of turn `turn` (0 = the first) of response `sample` of prompt `index`: completion_seed
    with sample + group_size * turn, so every turn of every response has its own seed and turn 0 keeps the
    single-turn one."""
    return completion_seed(seed, index, sample + group_size * turn)


def run_trajectories(
    engine: Any, prompts: Sequence[Sequence[int]], episode: Callable[[int], Any], params: SamplingParams
) -> list[Rollout]:
    """Blocking: params.n multi-turn trajectories per prompt on `engine`, each driven by its own episode
    (episode(i) -> a new episode for prompt i); rows i-major as RolloutEngine.generate. Each ends with its outcome
    in Rollout.episode."""
    if engine.num_unfinished():
        raise RuntimeError(f"{type(engine).__name__}: requests of a stream are still in flight")
    params = replace(params, multi_turn=True)
    base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())  # as requests_for
    episodes, done = {}, {}
    for i, prompt in enumerate(prompts):
        requests = []
        for k in range(params.n):
            episodes[(i, k)] = episode(i)
            requests.append(GenerationRequest((i, k), list(prompt), turn_seed(base, i, k, params.n, 0)))
        engine.submit(requests, params)
    while engine.num_unfinished():
        for (i, k), rollout in engine.step():
            trajectory = next_turn(episodes[(i, k)], rollout, params.max_new_tokens, engine.weight_version)
            if trajectory is None:
                done[(i, k)] = rollout
                continue
            seed = turn_seed(base, i, k, params.n, len(trajectory.observations))
            engine.submit([GenerationRequest((i, k), list(prompts[i]), seed, trajectory)], params)
    return [done[(i, k)] for i in range(len(prompts)) for k in range(params.n)]
