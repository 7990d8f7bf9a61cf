"""DAPO-Math-17k style prompt rows -> typed, validated ``Example`` records.

A row (one jsonl line or parquet row) holds:
  prompt        list of chat messages [{"role": "system"|"user"|"assistant", "content": str}], last one "user"
  reward_model  {"ground_truth": str (an int is accepted and turned into str), "style": str (optional)}
  data_source   non-empty str
  extra_info    optional dict (e.g. {"index": ...}); kept as is
Other keys (e.g. DAPO's "ability") are ignored. A malformed row raises a one-line ValueError naming the file, the
row (0-based, plus the 1-based line for jsonl) and the field; rows are never dropped silently.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from megatron_dapo.data.files import iter_rows
from megatron_dapo.data.identity import example_line

__all__ = [
    "Example",
    "PromptLimit",
    "check_prompt_lengths",
    "load_examples",
    "parse_row",
    "prompt_token_ids",
]

_ROLES = ("system", "user", "assistant", "tool")
"""Message roles a prompt may hold ("tool": a tool's reply in few-shot turns for a multi-turn environment, rendered
by the chat template as its environment's observations are, envs/python_tool.observation_text)."""


@dataclass(slots=True)
class Example:
    """One training/eval prompt.

    index is the example's 0-based position in its ``PromptDataset`` (files concatenated in order), unique within
    the dataset; the row's own ``extra_info`` (which may carry a source index) is kept in ``extra_info``.
    """

    prompt_messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    index: int
    extra_info: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)
    """Where the row came from: "path row N (line M)" (for error messages; not part of equality)."""


def _where(path: str, row_number: int, line_number: int | None) -> str:
    return f"{path} row {row_number}" + (f" (line {line_number})" if line_number is not None else "")


def _check_messages(messages: Any, prompt_key: str) -> str | None:
    """Return an error text for a bad prompt field, or None when it is valid."""
    expected = f"field '{prompt_key}' must be a non-empty list of {{role, content}} messages"
    if not isinstance(messages, list) or not messages:
        return expected
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            return f"{expected} (message {i} is not a {{role, content}} dict)"
        if m["role"] not in _ROLES:
            return f"{expected} (message {i} has role {m['role']!r}, expected one of {list(_ROLES)})"
        if not isinstance(m["content"], str) or not m["content"].strip():
            return f"{expected} (message {i} has empty or non-string content)"
    if messages[-1]["role"] != "user":
        return f"{expected} (the last message must have role 'user')"
    return None


def _ground_truth(reward_model: Any) -> tuple[str | None, str | None]:
    """(ground_truth, None) or (None, error text) for the reward_model field."""
    if not isinstance(reward_model, dict):
        return None, "field 'reward_model' must be a dict with 'ground_truth'"
    if "ground_truth" not in reward_model:
        return None, "field 'reward_model.ground_truth' is missing"
    gt = reward_model["ground_truth"]
    if isinstance(gt, int) and not isinstance(gt, bool):
        gt = str(gt)
    if not isinstance(gt, str) or not gt.strip():
        return None, "field 'reward_model.ground_truth' must be a non-empty string"
    style = reward_model.get("style")
    if style is not None and not isinstance(style, str):
        return None, "field 'reward_model.style' must be a string"
    return gt, None


def parse_row(
    row: Any, *, path: str, row_number: int, line_number: int | None = None, index: int, prompt_key: str = "prompt"
) -> Example:
    """Validate one raw row and build an ``Example``; ValueError names file, row and field on bad input."""
    where = _where(path, row_number, line_number)
    if not isinstance(row, dict):
        raise ValueError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise ValueError(f"{where}: field '{prompt_key}' is missing")
    err = _check_messages(row[prompt_key], prompt_key)
    if err:
        raise ValueError(f"{where}: {err}")
    if "reward_model" not in row:
        raise ValueError(f"{where}: field 'reward_model' is missing")
    gt, err = _ground_truth(row["reward_model"])
    if err:
        raise ValueError(f"{where}: {err}")
    source = row.get("data_source")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{where}: field 'data_source' must be a non-empty string")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where}: field 'extra_info' must be a dict when present")
    messages = [{"role": m["role"], "content": m["content"]} for m in row[prompt_key]]
    return Example(
        prompt_messages=messages, ground_truth=gt, data_source=source, index=index, extra_info=extra, source=where
    )


def load_examples(
    files: str | os.PathLike | Sequence[str | os.PathLike], *, prompt_key: str = "prompt"
) -> list[Example]:
    """Read and validate every row of one or more jsonl/parquet files, in order.

    Raises FileNotFoundError for a missing file, ValueError for bad JSON, a malformed row or no rows at all.
    """
    return read_examples(_paths(files), prompt_key).examples


def _paths(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    return [os.fspath(files)] if isinstance(files, (str, os.PathLike)) else [os.fspath(p) for p in files]


@dataclass(slots=True)
class ReadResult:
    """What one streaming pass over the data files gives: the examples kept, each file's identity entry
    (identity.py: path, rows, sha256 over every row) and the notes to log (duplicates dropped)."""

    examples: list[Example]
    files: list[dict[str, Any]]
    notes: list[str]


def read_examples(paths: list[str], prompt_key: str = "prompt", drop_duplicates: bool = False) -> ReadResult:
    """Parse and validate every row of the files in one pass, hashing each file's rows as they go by; with
    drop_duplicates, a row whose prompt messages and ground truth equal an earlier row's (any file) is dropped and
    counted (DAPO-Math-17k as published repeats each of its 17,917 prompts ~100 times: 1.79 M rows). Only kept
    examples are held; indices count every row read, so a kept example keeps its row's index.

    ValueError (one line, naming file, row and field) on a bad row; ValueError when there are no rows at all."""
    if not paths:
        raise ValueError("no data files given")
    kept: list[Example] = []
    files: list[dict[str, Any]] = []
    seen: dict[bytes, str] = {}
    duplicates, first_duplicate, index = 0, "", 0
    for path in paths:
        digest, rows = hashlib.sha256(), 0
        for row_number, line_number, row in iter_rows(path):
            ex = parse_row(
                row, path=path, row_number=row_number, line_number=line_number, index=index, prompt_key=prompt_key
            )
            line = example_line(ex)
            digest.update(line)
            rows, index = rows + 1, index + 1
            if drop_duplicates:
                key = hashlib.sha256(line).digest()
                if key in seen:
                    duplicates += 1
                    first_duplicate = first_duplicate or f"{ex.source} repeats {seen[key]}"
                    continue
                seen[key] = ex.source
            kept.append(ex)
        files.append({"path": path, "rows": rows, "sha256": digest.hexdigest()})
    if index == 0:
        raise ValueError(f"no rows found in {paths}")
    notes = []
    if duplicates:
        notes.append(
            f"dropped {duplicates} duplicate rows of {index} (same prompt and ground truth as an earlier row; "
            f"data.drop_duplicates; first: {first_duplicate})"
        )
    return ReadResult(kept, files, notes)


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt as the engine receives it: the tokenizer's chat template with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The most prompt tokens (chat template applied) a row may have, and the rule that sets it, in words."""

    tokens: int
    rule: str
    """e.g. "data.max_prompt_length=2048 tokens" (reads after "more than" / "longer than")."""

    @classmethod
    def of(cls, max_prompt_length: int, max_positions: int | None = None, max_response_length: int = 0) -> PromptLimit:
        """The limit of data.max_prompt_length and, when the model's max_position_embeddings is known, of the room
        it leaves after rollout.max_response_length (a prompt plus a full response must fit the model's positions:
        the engine could not generate it nor the actor train on it); the smaller one wins.

        ValueError (naming both fields) when max_response_length leaves no room for any prompt."""
        if max_positions is None or max_prompt_length + max_response_length <= max_positions:
            return cls(max_prompt_length, f"data.max_prompt_length={max_prompt_length} tokens")
        room = max_positions - max_response_length
        if room <= 0:
            raise ValueError(
                f"rollout.max_response_length={max_response_length} leaves no room for a prompt in the model's "
                f"max_position_embeddings={max_positions} (config.json of actor.model_path)"
            )
        return cls(
            room,
            f"{room} tokens (the model's max_position_embeddings={max_positions} minus "
            f"rollout.max_response_length={max_response_length}; data.max_prompt_length={max_prompt_length})",
        )


def check_prompt_lengths(
    examples: list[Example],
    tokenizer: Any,
    limit: PromptLimit | int,
    *,
    filter_overlong: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[list[Example], int]:
    """(The examples whose templated prompt fits in the limit, the longest kept prompt in tokens).

    limit: a PromptLimit, or an int read as data.max_prompt_length. An over-long prompt raises a one-line
    ValueError naming its file and row, or (filter_overlong) is dropped; the drop count is logged. Run at load time so
    that the data order, and so the iterator state in checkpoints, never depends on a row found over-long in mid-run.
    Kept examples keep their ``index``.
    """
    lengths = [len(prompt_token_ids(tokenizer, ex.prompt_messages)) for ex in examples]
    kept, longest, notes = filter_prompt_lengths(examples, lengths, limit, filter_overlong=filter_overlong)
    for note in notes:
        log(note)
    return kept, longest


def filter_prompt_lengths(
    examples: Sequence[Example], lengths: Sequence[int], limit: PromptLimit | int, *, filter_overlong: bool = False
) -> tuple[list[Example], int, list[str]]:
    """check_prompt_lengths on known lengths (tokens of each example's templated prompt): (kept, the longest kept
    prompt, the notes to log)."""
    if isinstance(limit, int):
        limit = PromptLimit.of(limit)
    kept, dropped, longest = [], [], 0
    for ex, n in zip(examples, lengths, strict=True):
        if n <= limit.tokens:
            kept.append(ex)
            longest = max(longest, n)
        elif not filter_overlong:
            raise ValueError(
                f"{ex.source or f'row {ex.index}'}: prompt has {n} tokens with the chat template, more than "
                f"{limit.rule} (set data.filter_overlong_prompts=true to drop such rows)"
            )
        else:
            dropped.append((ex, n))
    notes = []
    if dropped:
        first, n = dropped[0]
        notes.append(
            f"dropped {len(dropped)} of {len(examples)} prompts longer than {limit.rule} "
            f"(data.filter_overlong_prompts; first: {first.source}, {n} tokens)"
        )
    if not kept:
        raise ValueError(f"no prompt fits in {limit.rule}")
    return kept, longest, notes
