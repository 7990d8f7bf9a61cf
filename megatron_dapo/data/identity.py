"""The identity of a run's training data, recorded in checkpoints so that a resume on changed data is refused.

A checkpoint saves the data iterator's (epoch, position): it means the same thing only over the same examples in the
same order. The identity is a sha256 over the examples' content (prompt messages and ground truth, in order), once
per file over every row read and once over the examples kept after duplicate removal and the length filter; file
paths, mtimes and formats do not enter it (a jsonl file rewritten as the same rows keeps its identity). Hashing costs
one pass over the rows when the data is read (the prompt cache, cache.py, stores the result).

    {"sha256": <kept examples>, "num_examples": <kept>,
     "files": [{"path": str, "rows": int, "sha256": <every row of the file>}, ...]}   plain containers (weights_only)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

__all__ = ["data_identity", "example_line", "examples_sha256", "identity_change"]


def example_line(example: Any) -> bytes:
    """The bytes an example contributes to its dataset's sha256 (and the key duplicates are found by): its prompt
    messages and ground truth as one JSON line."""
    line = json.dumps([example.prompt_messages, example.ground_truth], ensure_ascii=False, sort_keys=True)
    return line.encode("utf-8") + b"\n"


def examples_sha256(examples: Iterable[Any]) -> str:
    """sha256 (hex) over the examples' prompt messages and ground truth, in order (one JSON line each)."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(example_line(ex))
    return h.hexdigest()


def data_identity(files: Sequence[dict[str, Any]], kept: Sequence[Any]) -> dict[str, Any]:
    """The identity of a dataset: each file's entry ({"path", "rows", "sha256" over every row read}, as
    dataset.read_examples gives them) and the examples kept (what the iterator walks)."""
    return {"sha256": examples_sha256(kept), "num_examples": len(kept), "files": [dict(f) for f in files]}


def identity_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's data identity and this run's, in words (None: the same data).

    Names each changed file (by this run's path) with its row counts; when every file is unchanged but the kept
    examples differ, the length filter (data.filter_overlong_prompts) or duplicate removal (data.drop_duplicates)
    kept other rows."""
    old, new = saved.get("files", []), current["files"]
    if len(old) != len(new):
        return f"the checkpoint was saved with {len(old)} data file(s), this run has {len(new)}"
    changed = []
    for was, now in zip(old, new, strict=True):
        if was.get("rows") != now["rows"]:
            changed.append(f"{now['path']} has {now['rows']} rows, {was.get('rows')} when the checkpoint was saved")
        elif was.get("sha256") != now["sha256"]:
            changed.append(f"{now['path']}: the content of its {now['rows']} rows changed")
    if changed:
        return "; ".join(changed)
    if saved.get("sha256") != current["sha256"]:
        return (
            f"the files are unchanged but the length filter and duplicate removal kept {current['num_examples']} "
            f"prompts, {saved.get('num_examples')} when the checkpoint was saved (data.max_prompt_length, "
            f"data.drop_duplicates, rollout.max_response_length or the model's max_position_embeddings changed)"
        )
    return None
