"""Integer-answer math problems from the ``reasoning-gym`` package.

``generate_items(task, num, seed=..., task_kwargs=..., exclude=...)`` draws items 0, 1, 2, ... of
``reasoning_gym.create_dataset(task, size=cap, seed=seed, **task_kwargs)`` and keeps those whose answer is an integer
and whose question is new (not seen earlier in this draw and not in ``exclude``), until ``num`` are kept. The result
depends only on the arguments (reasoning-gym seeds item i with ``seed + i``).

Task kwargs are checked against the task's reasoning-gym config dataclass fields, so a typo is an error and not
a silently ignored difficulty setting.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SUPPORTED_TASKS", "TaskItem", "generate_items", "task_config_fields", "validate_task_kwargs"]

SUPPORTED_TASKS = ("gsm_symbolic", "basic_arithmetic", "chain_sum")
# Set by this module, never by task kwargs.
_RESERVED = ("seed", "size")
_INT_RE = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class TaskItem:
    """One problem: the question text, its integer answer as a string, a worked solution (may be empty)."""

    question: str
    answer: str
    solution: str
    source_index: int


def _config_class(task: str) -> type:
    if task not in SUPPORTED_TASKS:
        raise ValueError(f"unknown task {task!r}; supported: {list(SUPPORTED_TASKS)}")
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    return DATASETS[task][1]


def task_config_fields(task: str) -> dict[str, Any]:
    """The tunable config fields of ``task`` with their reasoning-gym defaults (seed and size excluded)."""
    fields = {}
    for f in dataclasses.fields(_config_class(task)):
        if f.name in _RESERVED:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        fields[f.name] = default
    return fields


def validate_task_kwargs(task: str, task_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check task kwargs against the task's config class: unknown names and failed config checks raise ValueError."""
    kwargs = dict(task_kwargs or {})
    reserved = sorted(set(kwargs) & set(_RESERVED))
    if reserved:
        raise ValueError(f"task kwargs {reserved} are set by the generator (use --seed / --num-train / --num-test)")
    known = task_config_fields(task)
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown {task} kwargs {unknown}; valid: {sorted(known)}")
    if "operators" in kwargs and isinstance(kwargs["operators"], list):
        kwargs["operators"] = tuple(kwargs["operators"])
    config = _config_class(task)(seed=0, size=1, **kwargs)
    try:
        config.validate()
    except (AssertionError, TypeError) as e:
        raise ValueError(f"invalid {task} kwargs {kwargs}: {str(e) or 'failed the config check'}") from None
    return kwargs


def _solution(item: Mapping[str, Any]) -> str:
    """A short worked solution from the item's metadata (chain of thought or the expression), or ''."""
    meta = item.get("metadata") or {}
    cot = meta.get("answer_cot")
    if isinstance(cot, str) and cot.strip():
        # gsm_symbolic ends its chain of thought with "#### <answer>": the answer line replaces it.
        return "\n".join(line for line in cot.strip().splitlines() if not line.startswith("####")).strip()
    expr = meta.get("expression")
    if isinstance(expr, str) and expr.strip():
        return f"{expr.strip()} = {item['answer']}"
    return ""


def generate_items(
    task: str,
    num: int,
    *,
    seed: int,
    task_kwargs: Mapping[str, Any] | None = None,
    exclude: Iterable[str] = (),
    max_draws: int | None = None,
) -> list[TaskItem]:
    """``num`` distinct integer-answer items of ``task`` not in ``exclude`` (a set of question strings).

    Draws at most ``max_draws`` items (default ``max(20 * num, 1000)``); raises ValueError if fewer than ``num``
    usable items turn up (a small problem space, e.g. 2 one-digit terms, has few distinct questions).
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    kwargs = validate_task_kwargs(task, task_kwargs)
    if num == 0:
        return []
    import reasoning_gym

    cap = max_draws if max_draws is not None else max(20 * num, 1000)
    dataset = reasoning_gym.create_dataset(task, size=cap, seed=seed, **kwargs)
    seen = set(exclude)
    items: list[TaskItem] = []
    for i in range(cap):
        raw = dataset[i]
        question, answer = str(raw["question"]).strip(), str(raw["answer"]).strip()
        if not _INT_RE.fullmatch(answer) or question in seen:
            continue
        seen.add(question)
        items.append(TaskItem(question=question, answer=answer, solution=_solution(raw), source_index=i))
        if len(items) == num:
            return items
    raise ValueError(
        f"{task} (seed {seed}, kwargs {kwargs}): only {len(items)} new integer-answer questions in {cap} draws, "
        f"need {num}; ask for fewer or widen the difficulty kwargs"
    )
