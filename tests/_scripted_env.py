"""A scripted multi-turn environment for end-to-end runs of a random model, which never writes a tool call:
"scripted_turns" appends a fixed tool message after each of the first two model turns that ended on their own (the
stop token), then verifies the third turn (or the last one, at the cap) with the run's verifier. Registered when
this module is imported (tests/_hooks_driver.py imports it, so `reward.environment=scripted_turns` works there)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_dapo.envs.base import Turn
from megatron_dapo.envs.base import register_environment
from megatron_dapo.envs.base import token_list
from megatron_dapo.envs.python_tool import observation_text

TURNS = 3


@register_environment("scripted_turns", multi_turn=True)
class ScriptedTurns:
    def __init__(self, *, tokenizer: Any, verifier: Any) -> None:
        self.tokenizer, self.verifier = tokenizer, verifier
        self.observation = tuple(tokenizer.encode(observation_text(tokenizer, "7"), add_special_tokens=False))

    def episode(self, ground_truth: str, record: dict | None = None) -> _Episode:
        if record is None or record["ground_truth"] != ground_truth:  # the trainer hands each episode its prompt's
            raise AssertionError(f"scripted_turns: episode of {ground_truth!r} without its prompt record: {record}")
        return _Episode(self, ground_truth)


class _Episode:
    def __init__(self, env: ScriptedTurns, truth: str) -> None:
        self.env, self.truth, self.turns, self.text = env, truth, 0, ""

    def step(self, turn_ids: Sequence[int]) -> Turn:
        self.turns += 1
        self.text = self.env.tokenizer.decode(token_list(turn_ids), skip_special_tokens=True)
        if self.turns < TURNS:
            return Turn(False, observation_ids=self.env.observation)
        return self.finish("answer")

    def finish(self, stop: str) -> Turn:
        result = self.env.verifier(self.text, self.truth)
        details = {**result, "turns": self.turns, "tool_calls": self.turns - 1, "stop": stop}
        return Turn(True, reward=float(result["score"]), details=details)

    def state(self) -> dict[str, Any]:
        return {"turns": self.turns, "text": self.text}

    def restore(self, state: dict[str, Any]) -> None:
        self.turns, self.text = state["turns"], state["text"]
