"""The environment interface (issue 40 item 1): what a multi-turn rollout asks after each model turn.

    env = make_environment(name, tokenizer=..., verifier=..., **options)    registered by name, like the losses
    episode = env.episode(ground_truth)                                      one trajectory's state
    turn = episode.step(turn_ids)          the model's sampled token ids of one turn (its stop token included)
      -> Turn(done=False, observation_ids)   token ids to append after the turn (tokenised once, here, with the chat
                                             template's turn markers), then the model samples its next turn
      -> Turn(done=True, reward, details)    the trajectory's reward (+1 / -1 from the verifier) and what happened

Token in / token out: the trajectory is the engine's sampled ids and these observation ids, in order; nothing the
model wrote is decoded and re-encoded for training (an environment decodes a turn only to read it). "single_turn" is
the verifier as an environment (one turn, then its score); "python_tool" (envs/python_tool.py) runs the model's
Python tool calls in a sandbox between turns.

Training scores every response through "single_turn" (experience.GroupScorer); multi-turn generation, which
"python_tool" needs, is not wired into the engines and the rollout stream yet (issue 40 items 2, 4-6).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol


@dataclass(frozen=True)
class Turn:
    """An environment's answer to one model turn."""

    done: bool
    observation_ids: tuple[int, ...] = ()
    """Not done: the tokens to append before the model's next turn (the tool's output in the chat format)."""
    reward: float = 0.0
    """Done: the trajectory's reward."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """Done: the verifier's result and the episode's counts (turns, tool calls, why it stopped)."""


class Episode(Protocol):
    def step(self, turn_ids: Sequence[int]) -> Turn: ...


class Environment(Protocol):
    def episode(self, ground_truth: str) -> Episode: ...


def token_list(turn_ids: Sequence[int]) -> list[int]:
    """A turn's ids as a list of ints (a Rollout's response_ids are an int32 tensor)."""
    return turn_ids.tolist() if hasattr(turn_ids, "tolist") else [int(t) for t in turn_ids]


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}
"""Environment name -> its factory (keyword arguments: tokenizer, verifier and its own options)."""


def register_environment(name: str) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Class or factory decorator: `make_environment(name, ...)` builds it."""

    def add(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is registered twice")
        ENVIRONMENTS[name] = factory
        return factory

    return add


BUILT_IN = {"single_turn": "megatron_dapo.envs.base", "python_tool": "megatron_dapo.envs.python_tool"}
"""The package's environments and the module that registers each (loaded on first use)."""


def make_environment(name: str, **kwargs: Any) -> Environment:
    """The registered environment `name` (ValueError naming the choices otherwise)."""
    if name not in ENVIRONMENTS and name in BUILT_IN:
        importlib.import_module(BUILT_IN[name])
    if name not in ENVIRONMENTS:
        raise ValueError(f"environment: unknown {name!r}; choose one of {sorted(set(ENVIRONMENTS) | set(BUILT_IN))}")
    return ENVIRONMENTS[name](**kwargs)


@register_environment("single_turn")
class SingleTurn:
    """The verifier as an environment: one model turn, then its score (what training does today)."""

    def __init__(self, *, tokenizer: Any, verifier: Callable[[str, str], dict]) -> None:
        self.tokenizer, self.verifier = tokenizer, verifier

    def episode(self, ground_truth: str) -> _SingleTurnEpisode:
        return _SingleTurnEpisode(self, ground_truth)


class _SingleTurnEpisode:
    def __init__(self, env: SingleTurn, truth: str) -> None:
        self.env, self.truth = env, truth

    def step(self, turn_ids: Sequence[int]) -> Turn:
        text = self.env.tokenizer.decode(token_list(turn_ids), skip_special_tokens=True)
        result = self.env.verifier(text, self.truth)
        return Turn(True, reward=float(result["score"]), details={**result, "turns": 1, "stop": "answer"})
