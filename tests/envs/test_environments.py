"""The environment interface: the verifier as the single-turn environment, and the python_tool environment over
several turns: tool calls run in the sandbox, observations tokenised once with the chat template's markers, the
answer verified, budgets stop the episode and say which."""

from __future__ import annotations

import pytest

from megatron_dapo.envs.base import ENVIRONMENTS
from megatron_dapo.envs.base import make_environment
from megatron_dapo.envs.python_tool import observation_text
from megatron_dapo.envs.sandbox import SandboxResult
from megatron_dapo.reward import make_verifier


class _Recorder:
    """A sandbox stand-in that records the code and answers with fixed stdout (the real one is tested apart)."""

    def __init__(self, stdout: str = "408\n") -> None:
        self.codes: list[str] = []
        self.stdout = stdout

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        self.codes.append(code)
        return SandboxResult("ok", self.stdout, "", 0, 0.01)


def _turn(tok, text: str, stop: bool = True) -> list[int]:
    """A model turn as the engine returns it: sampled ids, ending with the stop token (EOS) when it stopped there."""
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if stop else [])


def test_single_turn_is_the_verifier(byte_tokenizer):
    env = make_environment("single_turn", tokenizer=byte_tokenizer, verifier=make_verifier("answer_line"))
    turn = env.episode("408").step(_turn(byte_tokenizer, "12 * 34 = 408\nAnswer: 408"))
    assert turn.done and turn.reward == 1.0 and turn.details["turns"] == 1
    assert env.episode("407").step(_turn(byte_tokenizer, "Answer: 408")).reward == -1.0
    choices = r"\['python_tool', 'single_turn'\]"
    with pytest.raises(ValueError, match=rf"environment: unknown 'chess'; choose one of {choices}"):
        make_environment("chess")


def test_a_tool_call_then_an_answer_over_token_ids(byte_tokenizer):
    tok, sandbox = byte_tokenizer, _Recorder()
    env = make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"), sandbox=sandbox)
    assert "python_tool" in ENVIRONMENTS
    episode = env.episode("408")
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12 * 34)"}}</tool_call>'
    first = _turn(tok, f"Let me check.\n{call}")
    turn = episode.step(first)
    assert not turn.done and sandbox.codes == ["print(12 * 34)"]
    # The model's turn ended with its stop token (<|im_end|>): the observation opens the tool turn after it.
    assert tok.decode(list(turn.observation_ids)) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    trajectory = first + list(turn.observation_ids) + _turn(tok, "12 * 34 = 408\nAnswer: 408")
    final = episode.step(trajectory[len(first) + len(turn.observation_ids) :])
    assert final.done and final.reward == 1.0
    assert {k: final.details[k] for k in ("turns", "tool_calls", "tool_errors", "stop")} == {
        "turns": 2, "tool_calls": 1, "tool_errors": 0, "stop": "answer"}  # fmt: skip
    # Token in / token out: the model's ids are the trajectory's, untouched; only observation ids were added.
    assert trajectory[: len(first)] == first


def test_a_turn_without_its_stop_token_gets_the_end_marker_first(byte_tokenizer):
    text = observation_text(byte_tokenizer, "408", closed=False)
    assert text == "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"


def test_malformed_calls_and_budgets_are_observations_and_stops(byte_tokenizer):
    tok, sandbox = byte_tokenizer, _Recorder()
    env = make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"), sandbox=sandbox,
                           max_turns=3, max_tool_calls=2)  # fmt: skip
    episode = env.episode("5")
    bad = episode.step(_turn(tok, "<tool_call>{not json}</tool_call>"))
    assert "error: tool call 1: not JSON" in tok.decode(list(bad.observation_ids)) and sandbox.codes == []
    calls = "```python\nprint(1)\n```\n```python\nprint(2)\n```"
    spent = tok.decode(list(episode.step(_turn(tok, calls)).observation_ids))
    assert sandbox.codes == ["print(1)\n"] and "error: the episode's 2 tool calls are spent" in spent
    last = episode.step(_turn(tok, "```python\nprint(3)\n```"))
    assert last.done and last.details["stop"] == "max_turns" and last.reward == -1.0
    assert (last.details["tool_calls"], last.details["tool_errors"]) == (2, 1)
    short = make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"), sandbox=sandbox,
                             max_tokens=8).episode("5")  # fmt: skip
    assert short.step(_turn(tok, "```python\nprint(1)\n```")).details["stop"] == "max_tokens"
    with pytest.raises(ValueError, match=r"python_tool\.max_turns: must be an integer >= 1, got 0"):
        make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"), max_turns=0)


def test_the_real_sandbox_behind_the_environment(byte_tokenizer):
    tok = byte_tokenizer
    env = make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"))
    turn = env.episode("1024").step(_turn(tok, "```python\nprint(2 ** 10)\nprint(open('/etc/passwd').read())\n```"))
    shown = tok.decode(list(turn.observation_ids))
    assert "1024" in shown and "PermissionError: sandbox: open '/etc/passwd' is outside the sandbox" in shown


class _Broken:
    """A sandbox with a bug of its own: it raises instead of returning an outcome."""

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        raise RuntimeError("sandbox bug")


def test_a_sandbox_that_raises_is_an_unavailable_observation_not_a_crash(byte_tokenizer, caplog):
    tok = byte_tokenizer
    env = make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"), sandbox=_Broken())
    episode = env.episode("2")
    turn = episode.step(_turn(tok, "```python\nprint(1 + 1)\n```"))
    shown = tok.decode(list(turn.observation_ids))
    assert not turn.done and "[the sandbox is unavailable; the code did not run]" in shown
    assert "the sandbox raised on a call" in caplog.text
    final = episode.step(_turn(tok, "Answer: 2"))
    assert final.done and final.reward == 1.0 and (final.details["tool_calls"], final.details["tool_errors"]) == (1, 1)


def test_calls_past_the_budget_are_counted_and_an_older_carry_restores(byte_tokenizer):
    tok, sandbox = byte_tokenizer, _Recorder()
    env = make_environment("python_tool", tokenizer=tok, verifier=make_verifier("answer_line"), sandbox=sandbox,
                           max_tool_calls=1)  # fmt: skip
    episode = env.episode("5")
    calls = "".join(f"```python\nprint({i})\n```\n" for i in range(3))
    episode.step(_turn(tok, calls))
    state = episode.state()
    assert sandbox.codes == ["print(0)\n"] and state["tool_calls_over_budget"] == 2
    restored = env.episode("5")
    restored.restore(state)
    assert restored.step(_turn(tok, "Answer: 5")).details["tool_calls_over_budget"] == 2
    older = {k: v for k, v in state.items() if k != "tool_calls_over_budget"}  # a carry checkpointed before the count
    from_older = env.episode("5")
    from_older.restore(older)
    done = from_older.step(_turn(tok, "Answer: 5"))
    assert done.details["tool_calls_over_budget"] == 0 and done.details["tool_calls"] == 1
    with pytest.raises(KeyError):
        env.episode("5").restore({k: v for k, v in state.items() if k != "turns"})  # anything else is required
