"""Tool calls in a model's turn, and what goes back to it (issue 40 item 3).

    parse_tool_calls(turn text) -> [ToolCall | MalformedCall], in the order they appear
      "hermes"   <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>   (Hermes / Qwen chat format;
                 "arguments" may also be a JSON string holding the object, as some models write it)
      "fenced"   ```python\\n...\\n```  (base models): a call of the "python" tool with that code
    python_code(call) -> the code of a call of the python tool, or the one-line error observation to answer with
    observation(SandboxResult) -> the text the environment feeds back: stdout, the error's last lines, the status

A call that cannot be understood (not JSON, no name, arguments of the wrong type, an unterminated block, an unknown
tool) is a MalformedCall with a one-line reason: the environment answers it as an observation, so the model sees
its mistake and the rank goes on. Tokenising the observation with the chat template's turn markers is the
environment's (token in / token out: nothing the model wrote is re-encoded).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from megatron_dapo.envs.sandbox import SandboxResult

FORMATS = ("hermes", "fenced")
PYTHON_TOOL = "python"
"""The one tool so far: run Python code (envs/sandbox.py)."""
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)(```|$)", re.S)
_NAME_CHARS = 64
"""Characters of an unknown tool's name an error observation repeats (the model may have written a long one)."""
_ERROR_LINES = 5
"""Lines of a failed call's stderr the observation keeps (the traceback's end: the error itself)."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call: its name, its arguments, and where it stands in the turn text (start, end)."""

    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]


@dataclass(frozen=True)
class MalformedCall:
    """Something meant as a tool call that cannot be run; `error` is the one-line observation that answers it."""

    error: str
    span: tuple[int, int]


def parse_tool_calls(text: str, formats: tuple[str, ...] = FORMATS) -> list[ToolCall | MalformedCall]:
    """The tool calls of one model turn, in order (module docstring)."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"parse_tool_calls: unknown formats {unknown}; choose from {list(FORMATS)}")
    calls: list[ToolCall | MalformedCall] = []
    if "hermes" in formats:
        for k, m in enumerate(_HERMES.finditer(text)):
            calls.append(_hermes(m.group(1), m.group(2), k + 1, m.span()))
    if "fenced" in formats:
        for m in _FENCED.finditer(text):
            if not m.group(2):
                calls.append(MalformedCall("the ```python block is not closed", m.span()))
            else:
                calls.append(ToolCall(PYTHON_TOOL, {"code": m.group(1)}, m.span()))
    return sorted(calls, key=lambda c: c.span)


def _hermes(body: str, end: str, k: int, span: tuple[int, int]) -> ToolCall | MalformedCall:
    where = f"tool call {k}"
    if not end:
        return MalformedCall(f"{where}: <tool_call> is not closed by </tool_call>", span)
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedCall(f"{where}: not JSON ({err.msg} at line {err.lineno} column {err.colno})", span)
    except (ValueError, RecursionError) as err:  # an integer past int_max_str_digits; nesting past the stack
        return MalformedCall(f"{where}: JSON that cannot be read ({type(err).__name__})", span)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return MalformedCall(f'{where}: expected {{"name": "...", "arguments": {{...}}}}', span)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return MalformedCall(f"{where}: arguments is a string that is not a JSON object", span)
    if not isinstance(arguments, dict):
        return MalformedCall(f"{where}: arguments must be a JSON object, got {type(arguments).__name__}", span)
    return ToolCall(call["name"], arguments, span)


def python_code(call: ToolCall | MalformedCall) -> str | MalformedCall:
    """The code a call asks the python tool to run, or the MalformedCall to answer instead (a malformed call, another
    tool's name, no string "code" argument)."""
    if isinstance(call, MalformedCall):
        return call
    if call.name != PYTHON_TOOL:
        name = call.name if len(call.name) <= _NAME_CHARS else call.name[:_NAME_CHARS] + "..."
        return MalformedCall(f"unknown tool {name!r}; the tools are: {PYTHON_TOOL}", call.span)
    code = call.arguments.get("code")
    if not isinstance(code, str):
        return MalformedCall(f'the {PYTHON_TOOL} tool needs a string argument "code"', call.span)
    return code


def observation(result: SandboxResult | MalformedCall) -> str:
    """The text a call's outcome shows the model: its stdout, then (failed) the last lines of its stderr, then a
    bracketed note for what stopped it; a malformed call's reason."""
    if isinstance(result, MalformedCall):
        return f"error: {result.error}"
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.status not in ("ok", "unavailable") and result.stderr.strip():  # the service's own message stays here
        parts.append("\n".join(result.stderr.rstrip("\n").splitlines()[-_ERROR_LINES:]))
    note = {
        "timeout": "[stopped: wall-time limit]",
        "cpu_limit": "[stopped: CPU-time limit]",
        "output_limit": "[stopped: too much output]",
        "unavailable": "[the sandbox is unavailable; the code did not run]",
    }.get(result.status)
    if result.truncated and result.status != "output_limit":
        note = "[output cut]" if note is None else note
    if note:
        parts.append(note)
    return "\n".join(parts) if parts else "[no output]"
