"""The "python_tool" environment (issue 40 items 1, 3, 4): the model may call a Python tool between turns; the
trajectory ends at a turn without a call (its answer is verified) or at a budget.

    step(turn ids) --decode (to read it only)--> tool calls (envs/tool_calls.py)
        none                                   -> done: the verifier on this turn's text (the answer's last line)
        calls, budgets left                    -> each run in the sandbox (at most max_tool_calls in the episode;
                                                  further calls are answered "spent", tool_calls_over_budget),
                                                  their observations joined -> one tool message, tokenised with the
                                                  chat template's turn markers -> observation ids, not done
        max_turns reached / max_tokens passed  -> done: verified as it stands, details["stop"] says which budget
    finish(stop)                               -> done: the last turn verified as it stands (the stream calls it when
                                                  no further turn fits the engine's cap), details["stop"] = stop

Observation tokens: the chat template is rendered for [user, assistant (a sentinel), tool (the text)] with the
generation prompt, and what follows the sentinel is the observation: the assistant turn's end marker (dropped when
the model's own stop token already closed it), the tool turn, the next assistant header. Tokenised once, here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from megatron_dapo.envs.base import Turn
from megatron_dapo.envs.base import register_environment
from megatron_dapo.envs.base import token_list
from megatron_dapo.envs.sandbox import LocalSandbox
from megatron_dapo.envs.sandbox import RemoteSandbox
from megatron_dapo.envs.sandbox import SandboxLimits
from megatron_dapo.envs.sandbox import SandboxResult
from megatron_dapo.envs.tool_calls import FORMATS
from megatron_dapo.envs.tool_calls import MalformedCall
from megatron_dapo.envs.tool_calls import observation
from megatron_dapo.envs.tool_calls import parse_tool_calls
from megatron_dapo.envs.tool_calls import python_code

_SENTINEL = "\x00MDAPO_TURN\x00"
_log = logging.getLogger(__name__)


def observation_text(tokenizer: Any, text: str, *, role: str = "tool", closed: bool = True) -> str:
    """The chat-format text that follows a model turn to show it `text` as a `role` message and open the next
    assistant turn. closed: the model's turn already ends with the template's end-of-turn marker (its stop token)."""
    head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    full = tokenizer.apply_chat_template([*head, {"role": role, "content": text}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    tail = full[full.index(_SENTINEL) + len(_SENTINEL) :]
    end = tokenizer.eos_token or ""
    return tail[len(end) :] if closed and end and tail.startswith(end) else tail


@register_environment("python_tool", multi_turn=True)
class PythonTool:
    """Options: sandbox (LocalSandbox by default; a RemoteSandbox works alike), max_turns (model turns in an episode),
    max_tool_calls (in an episode), max_tokens (model + observation tokens of an episode, the prompt excluded),
    formats (the tool-call forms read: "hermes", "fenced"), role (the chat role of tool output)."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        verifier: Callable[[str, str], dict],
        sandbox: Any = None,
        max_turns: int = 4,
        max_tool_calls: int = 4,
        max_tokens: int = 4096,
        formats: tuple[str, ...] = FORMATS,
        role: str = "tool",
    ) -> None:
        for name, value in (("max_turns", max_turns), ("max_tool_calls", max_tool_calls), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"python_tool.{name}: must be an integer >= 1, got {value!r}")
        self.tokenizer, self.verifier = tokenizer, verifier
        self.sandbox = sandbox or LocalSandbox()
        self.max_turns, self.max_tool_calls, self.max_tokens = max_turns, max_tool_calls, max_tokens
        self.formats, self.role = formats, role

    @classmethod
    def from_config(cls, reward: Any, *, tokenizer: Any, verifier: Callable[[str, str], dict], max_tokens: int):
        """From the run's reward section (max_turns, max_tool_calls, tool_timeout_s, tool_memory_mb, sandbox_url);
        max_tokens: the trajectory's budget (rollout.max_response_length)."""
        cpu_s = max(1, math.ceil(reward.tool_timeout_s))
        limits = SandboxLimits(wall_s=reward.tool_timeout_s, cpu_s=cpu_s, memory_mb=reward.tool_memory_mb)
        sandbox = RemoteSandbox(reward.sandbox_url, limits) if reward.sandbox_url else LocalSandbox(limits)
        return cls(tokenizer=tokenizer, verifier=verifier, sandbox=sandbox, max_turns=reward.max_turns,
                   max_tool_calls=reward.max_tool_calls, max_tokens=max_tokens)  # fmt: skip

    def episode(self, ground_truth: str, record: Mapping[str, Any] | None = None) -> _ToolEpisode:
        return _ToolEpisode(self, ground_truth)


class _ToolEpisode:
    def __init__(self, env: PythonTool, truth: str) -> None:
        self.env, self.truth = env, truth
        self.turns = self.tool_calls = self.tool_errors = self.tool_timeouts = self.tokens = 0
        self.tool_calls_over_budget = 0
        self.tool_seconds = 0.0
        self.last_text = ""

    def step(self, turn_ids: Sequence[int]) -> Turn:
        env = self.env
        self.turns += 1
        self.tokens += len(turn_ids)
        turn_ids = token_list(turn_ids)
        text = self.last_text = env.tokenizer.decode(turn_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text, env.formats)
        stop = "answer" if not calls else "max_turns" if self.turns >= env.max_turns else None
        if stop is None and self.tokens >= env.max_tokens:
            stop = "max_tokens"
        if stop is not None:
            return self._done(text, stop)
        outputs = []
        for call in calls:
            if self.tool_calls >= env.max_tool_calls:
                self.tool_calls_over_budget += 1
                outputs.append(f"error: the episode's {env.max_tool_calls} tool calls are spent")
                continue
            self.tool_calls += 1
            code = python_code(call)
            if isinstance(code, MalformedCall):
                self.tool_errors += 1
                outputs.append(observation(code))
                continue
            result = self._run(code)
            self.tool_seconds += result.seconds
            self.tool_errors += result.status != "ok"
            self.tool_timeouts += result.status in ("timeout", "cpu_limit")
            outputs.append(observation(result))
        closed = bool(turn_ids) and turn_ids[-1] == env.tokenizer.eos_token_id
        obs = observation_text(env.tokenizer, "\n\n".join(outputs), role=env.role, closed=closed)
        ids = tuple(env.tokenizer.encode(obs, add_special_tokens=False))
        self.tokens += len(ids)
        return Turn(False, observation_ids=ids)

    def _run(self, code: str) -> SandboxResult:
        """One call in the sandbox. A sandbox that raises (a bug, a host failure it does not catch) is status
        "unavailable" for this call, logged here: the model sees that its code did not run, the rollout goes on."""
        start = time.monotonic()
        try:
            return self.env.sandbox.run(code)
        except Exception as err:
            _log.warning("python_tool: the sandbox raised on a call; answered as unavailable", exc_info=True)
            return SandboxResult("unavailable", "", f"{type(err).__name__}: {err}", None, time.monotonic() - start)

    def finish(self, stop: str) -> Turn:
        """No further turn: the last one verified as it stands (its observation, if any, was not appended)."""
        return self._done(self.last_text, stop)

    _STATE = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tokens", "tool_seconds", "last_text",
              "tool_calls_over_budget")  # fmt: skip
    _ADDED = {"tool_calls_over_budget": 0}
    """State names added after carries were first checkpointed, with the value a carry written before has."""

    def state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._STATE}

    def restore(self, state: dict[str, Any]) -> None:
        for name in self._STATE:
            value = state.get(name, self._ADDED[name]) if name in self._ADDED else state[name]
            setattr(self, name, value)

    def _done(self, text: str, stop: str) -> Turn:
        result = self.env.verifier(text, self.truth)
        details = {**result, "turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                   "tool_timeouts": self.tool_timeouts, "tool_seconds": self.tool_seconds,
                   "tool_calls_over_budget": self.tool_calls_over_budget, "stop": stop}  # fmt: skip
        return Turn(True, reward=float(result["score"]), details=details)
