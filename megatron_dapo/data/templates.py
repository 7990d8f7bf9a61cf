"""Prompt templates: one registry dict mapping a name to a template that turns a question into chat messages.

Every template returns a list of ``{"role": ..., "content": ...}`` messages whose last message is the user turn
holding the question. Few-shot templates also take worked examples ``Shot(question, answer, solution)`` that the
caller draws from the same task with a different seed (see ``reasoning_gym_tasks``), so a shot never equals an eval
or train item.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DAPO_TEMPLATE", "TEMPLATES", "PromptTemplate", "Shot", "get_template", "render_prompt"]

# DAPO-Math-17k's prompt format (arXiv 2503.14476): the reward reads the last "Answer:" line.
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

BOXED_TEMPLATE = (
    "Solve the following math problem step by step. Put your final answer within \\boxed{{}}.\n\n{question}"
)


@dataclass(frozen=True, slots=True)
class Shot:
    """One worked example for few-shot prompts."""

    question: str
    answer: str
    solution: str = ""
    """Reasoning text shown before the answer line; may be empty."""


@dataclass(frozen=True, slots=True)
class PromptTemplate:
    """A named prompt format.

    ``build(question, shots)`` returns the chat messages; ``num_shots`` is how many worked examples it wants
    (0 for zero-shot templates, which ignore ``shots``).
    """

    name: str
    description: str
    build: Callable[[str, Sequence[Shot]], list[dict[str, str]]]
    num_shots: int = 0


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _dapo(question: str, shots: Sequence[Shot]) -> list[dict[str, str]]:
    return [_user(DAPO_TEMPLATE.format(question=question))]


def _plain(question: str, shots: Sequence[Shot]) -> list[dict[str, str]]:
    return [_user(question)]


def _boxed(question: str, shots: Sequence[Shot]) -> list[dict[str, str]]:
    return [_user(BOXED_TEMPLATE.format(question=question))]


def _worked_examples(question: str, shots: Sequence[Shot], name: str, wrap: str) -> list[dict[str, str]]:
    """Worked examples as prior chat turns (each reply ends in an "Answer: N" line), then the question; `wrap`
    formats every user turn."""
    if not shots:
        raise ValueError(f"template '{name}' needs at least one worked example (shots)")
    messages: list[dict[str, str]] = []
    for shot in shots:
        reply = f"{shot.solution.strip()}\nAnswer: {shot.answer}" if shot.solution.strip() else f"Answer: {shot.answer}"
        messages.append(_user(wrap.format(question=shot.question)))
        messages.append({"role": "assistant", "content": reply})
    messages.append(_user(wrap.format(question=question)))
    return messages


def _few_shot(question: str, shots: Sequence[Shot]) -> list[dict[str, str]]:
    """Worked examples in DAPO's format: every user turn carries DAPO's instruction."""
    return _worked_examples(question, shots, "few_shot", DAPO_TEMPLATE)


def _few_shot_compact(question: str, shots: Sequence[Shot]) -> list[dict[str, str]]:
    """Worked examples with bare questions (no instruction text): about 40% of few_shot's tokens. The examples alone
    teach the answer-line format (docs/cpu_job.md: chosen for the SmolLM2 CPU job)."""
    return _worked_examples(question, shots, "few_shot_compact", "{question}")


TEMPLATES: dict[str, PromptTemplate] = {
    "dapo": PromptTemplate("dapo", "DAPO-Math-17k format: reason step by step, last line 'Answer: $Answer'", _dapo),
    "plain": PromptTemplate("plain", "the question only", _plain),
    "few_shot": PromptTemplate(
        "few_shot", "worked examples of the same task as chat turns, then the question in DAPO format", _few_shot, 3
    ),
    "few_shot_compact": PromptTemplate(
        "few_shot_compact",
        "worked examples as chat turns with bare questions, replies end in 'Answer: N'",
        _few_shot_compact,
        3,
    ),
    "boxed": PromptTemplate("boxed", "reason step by step, final answer within \\boxed{}", _boxed),
}


def get_template(name: str) -> PromptTemplate:
    """Look up a template by name; unknown names raise ValueError listing the known ones."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown prompt template {name!r}; known: {sorted(TEMPLATES)}") from None


def render_prompt(name: str, question: str, shots: Sequence[Shot] = ()) -> list[dict[str, str]]:
    """Chat messages for ``question`` under template ``name`` (a list of {role, content} dicts, last is user)."""
    return get_template(name).build(question, shots)
