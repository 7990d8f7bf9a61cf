"""Tool calls parsed from a model's turn (Hermes / Qwen <tool_call> JSON and fenced python blocks), malformed ones
answered with a one-line observation, and the observation text of each sandbox outcome."""

from __future__ import annotations

import pytest

from megatron_dapo.envs.sandbox import SandboxResult
from megatron_dapo.envs.tool_calls import MalformedCall
from megatron_dapo.envs.tool_calls import ToolCall
from megatron_dapo.envs.tool_calls import observation
from megatron_dapo.envs.tool_calls import parse_tool_calls
from megatron_dapo.envs.tool_calls import python_code


def test_hermes_and_fenced_calls_in_the_order_written():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(12 * 34)"}}\n'
        "</tool_call>\nand also\n```python\nprint(2 ** 10)\n```\n"
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [python_code(c) for c in calls] == ["print(12 * 34)", "print(2 ** 10)\n", "print(1)"]
    assert all(isinstance(c, ToolCall) for c in calls) and calls[0].span[0] == text.index("<tool_call>")
    assert parse_tool_calls(text, formats=("fenced",)) == [calls[1]]
    assert parse_tool_calls("no calls here, 12 * 34 = 408") == []


@pytest.mark.parametrize(
    "text,reason",
    [
        ('<tool_call>{"name": "python", "arguments": {"code": "x"</tool_call>', "tool call 1: not JSON"),
        ("<tool_call>print(1)</tool_call>", "tool call 1: not JSON (Expecting value at line 1 column 1)"),
        ('<tool_call>{"arguments": {"code": "x"}}</tool_call>', 'tool call 1: expected {"name": "...", "arguments"'),
        ('<tool_call>["python"]</tool_call>', "tool call 1: expected"),
        ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', "arguments must be a JSON object, got list"),
        ('<tool_call>{"name": "python", "arguments": "x = 1"}</tool_call>', "a string that is not a JSON object"),
        ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}', "<tool_call> is not closed"),
        ("```python\nprint(1)\n", "the ```python block is not closed"),
        pytest.param(
            '<tool_call>{"name": "python", "n": ' + "9" * 5000 + "}</tool_call>",
            "JSON that cannot be read (ValueError)",
            id="int-past-max-digits",
        ),
        pytest.param(
            "<tool_call>" + "[" * 100_000 + "</tool_call>",
            "JSON that cannot be read (RecursionError)",
            id="nesting-past-the-stack",
        ),
        pytest.param(
            '<tool_call>{"name": "python", "arguments": "' + "[" * 100_000 + '"}</tool_call>',
            "is a string that is not",
            id="arguments-nesting-past-the-stack",
        ),
    ],
)
def test_malformed_calls_are_one_line_observations(text, reason):
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedCall) and reason in call.error, call
    assert observation(call).startswith("error: ") and "\n" not in observation(call)
    assert python_code(call) is call


def test_other_tools_and_missing_code_are_answered_not_run():
    web = ToolCall("web_search", {"query": "x"}, (0, 1))
    assert observation(python_code(web)) == "error: unknown tool 'web_search'; the tools are: python"
    long = observation(python_code(ToolCall("x" * 10_000, {}, (0, 1))))  # the model's name repeated, cut
    assert long == f"error: unknown tool '{'x' * 64}...'; the tools are: python"
    assert "needs a string argument" in observation(python_code(ToolCall("python", {"code": 3}, (0, 1))))
    with pytest.raises(ValueError, match="unknown formats"):
        parse_tool_calls("", formats=("xml",))


def _result(status, stdout="", stderr="", truncated=False):
    return SandboxResult(status, stdout, stderr, 0 if status == "ok" else None, 0.1, truncated)


def test_the_observation_of_each_outcome():
    assert observation(_result("ok", "408\n")) == "408"
    assert observation(_result("ok")) == "[no output]"
    trace = "Traceback (most recent call last):\n" + "".join(f'  File "main.py", line {i}\n' for i in range(9))
    failed = observation(_result("error", "partial\n", trace + "ZeroDivisionError: division by zero\n"))
    assert failed.splitlines()[0] == "partial" and failed.splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert len(failed.splitlines()) == 1 + 5  # stdout, then the error's last five lines
    assert observation(_result("timeout", "1\n")) == "1\n[stopped: wall-time limit]"
    cpu = observation(_result("cpu_limit", "", "sandbox: CPU time limit reached\n"))
    assert cpu == "sandbox: CPU time limit reached\n[stopped: CPU-time limit]"
    assert observation(_result("output_limit", "xxx", truncated=True)) == "xxx\n[stopped: too much output]"
    assert observation(_result("ok", "xxx", truncated=True)) == "xxx\n[output cut]"
    down = observation(_result("unavailable", "", "sandbox service http://10.0.0.5/run_code did not answer"))
    assert down == "[the sandbox is unavailable; the code did not run]"  # the service's address stays out
