"""The environment interface (issue 40 item 1): what a multi-turn rollout asks after each model turn.

    env = make_environment(name, tokenizer=..., verifier=..., **options)    registered by name, like the losses
    episode = env.episode(ground_truth, record)                              one trajectory's state, from its
                                                                             prompt's record (prompt_record)
    turn = episode.step(turn_ids)          the model's sampled token ids of one turn (its stop token included)
      -> Turn(done=False, observation_ids)   token ids to append after the turn (tokenised once, here, with the chat
                                             template's turn markers), then the model samples its next turn
      -> Turn(done=True, reward, details)    the trajectory's reward (+1 / -1 from the verifier) and what happened

Token in / token out: the trajectory is the engine's sampled ids and these observation ids, in order; nothing the
model wrote is decoded and re-encoded for training (an environment decodes a turn only to read it). "single_turn" is
the verifier as an environment (one turn, then its score); "python_tool" (envs/python_tool.py) runs the model's
Python tool calls in a sandbox between turns.

    turn = episode.finish(stop)            no further turn can follow (the engine's cap, the trajectory's token
                                           budget): done, verified as it stands, details["stop"] = stop
    episode.state() / restore(state)       plain values: an unfinished trajectory carried across steps
                                           (rollout.partial) continues its episode

Training: reward.environment names the environment (experience.GroupScorer builds it). A single-turn one scores each
finished response when its group completes; a multi-turn one (`multi_turn` True) is driven by the rollout stream
turn by turn (rollout/stream.py: each finished turn goes to its episode, an observation is appended to the
trajectory with Rollout.observe and the next turn continues it on the engine as a prefix).
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

from megatron_dapo.config import register_choices
from megatron_dapo.registry import Registry


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

    def finish(self, stop: str) -> Turn: ...

    def state(self) -> dict[str, Any]:
        """Plain values (a checkpoint holds them): everything the episode learnt from its turns so far."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a fresh episode of the same truth): a trajectory carried across steps."""
        ...


class Environment(Protocol):
    multi_turn: bool
    """Set by register_environment. False: one model turn, always done after it (nothing to drive turn by turn)."""

    def episode(self, ground_truth: str, record: Mapping[str, Any] | None = None) -> Episode:
        """One trajectory of the prompt whose answer is `ground_truth`. record: that prompt's record
        (`prompt_record`: its data row's messages, source, index and extra_info, plain values; a task's test cases or
        tool settings live in extra_info), None where no data row is at hand."""
        ...


def prompt_record(example: Any) -> dict[str, Any]:
    """A data row (data.Example) as an episode sees it: plain values, its own copy."""
    return {
        "index": int(example.index),
        "ground_truth": str(example.ground_truth),
        "data_source": str(example.data_source),
        "prompt_messages": [dict(m) for m in example.prompt_messages],
        "extra_info": dict(example.extra_info),
    }


EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "tool_calls_over_budget")
"""The counts a multi-turn episode reports in its done Turn's details (0 where it has none), one value per response
in RolloutGroup.episodes beside "observation_tokens" (counted on the trajectory); the step's "episode/*" metrics."""
STOPS = ("answer", "max_turns", "max_tokens", "length")
"""Why a multi-turn trajectory ended (its done Turn's details["stop"]): a turn without a tool call was verified, the
turn budget, the environment's token budget, or the cap (rollout.max_response_length: a turn cut there, or no room
for the observation and a next turn). Each is counted per response ("stop/<reason>" in RolloutGroup.episodes)."""


def token_list(turn_ids: Sequence[int]) -> list[int]:
    """A turn's ids as a list of ints (a Rollout's response_ids are an int32 tensor)."""
    return turn_ids.tolist() if hasattr(turn_ids, "tolist") else [int(t) for t in turn_ids]


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("reward.environment", "environment")
"""Environment name -> its factory (keyword arguments: tokenizer, verifier and its own options)."""


def register_environment(
    name: str, *, multi_turn: bool
) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Class or factory decorator: `make_environment(name, ...)` builds it, and reward.environment accepts `name`.
    multi_turn: whether the rollout stream drives its episodes turn by turn (set as the factory's `multi_turn`)."""

    def add(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        if name in BUILT_IN and BUILT_IN[name][1] != multi_turn:
            raise ValueError(f"environment {name!r}: multi_turn={multi_turn} disagrees with envs.base.BUILT_IN")
        factory.multi_turn = multi_turn
        ENVIRONMENTS.add(name, factory)
        if name not in BUILT_IN:  # a user's environment (the built-in names are declared by megatron_dapo.choices)
            register_choices("reward.environment", name, payload=multi_turn)
        return factory

    return add


BUILT_IN: dict[str, tuple[str, bool]] = {
    "single_turn": ("megatron_dapo.envs.base", False),
    "python_tool": ("megatron_dapo.envs.python_tool", True),
}
"""The package's environments: name -> (the module that registers it, loaded on first use; multi_turn)."""


def _factory(name: str) -> Callable[..., Environment]:
    if name not in ENVIRONMENTS and name in BUILT_IN:
        importlib.import_module(BUILT_IN[name][0])
    return ENVIRONMENTS.lookup(name, also=BUILT_IN)


def make_environment(name: str, **kwargs: Any) -> Environment:
    """The registered environment `name` (ValueError naming the choices otherwise)."""
    return _factory(name)(**kwargs)


def environment_for_run(reward: Any, *, tokenizer: Any, verifier: Callable[[str, str], dict], max_tokens: int):
    """The run's environment, reward.environment: built by its factory's `from_config(reward, tokenizer=,
    verifier=, max_tokens=)` when it has one (max_tokens: the trajectory's budget, rollout.max_response_length), by
    the factory with the tokenizer and verifier otherwise."""
    factory = _factory(reward.environment)
    if hasattr(factory, "from_config"):
        return factory.from_config(reward, tokenizer=tokenizer, verifier=verifier, max_tokens=max_tokens)
    return factory(tokenizer=tokenizer, verifier=verifier)


@register_environment("single_turn", multi_turn=False)
class SingleTurn:
    """The verifier as an environment: one model turn, then its score (what training does today)."""

    def __init__(self, *, tokenizer: Any, verifier: Callable[[str, str], dict]) -> None:
        self.tokenizer, self.verifier = tokenizer, verifier

    def episode(self, ground_truth: str, record: Mapping[str, Any] | None = None) -> _SingleTurnEpisode:
        return _SingleTurnEpisode(self, ground_truth)


class _SingleTurnEpisode:
    def __init__(self, env: SingleTurn, truth: str) -> None:
        self.env, self.truth = env, truth

    def step(self, turn_ids: Sequence[int], stop: str = "answer") -> Turn:
        text = self.env.tokenizer.decode(token_list(turn_ids), skip_special_tokens=True)
        result = self.env.verifier(text, self.truth)
        return Turn(True, reward=float(result["score"]), details={**result, "turns": 1, "stop": stop})

    def finish(self, stop: str) -> Turn:
        """No turn was taken (step is always done after one): an empty answer."""
        return self.step([], stop)

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        pass
