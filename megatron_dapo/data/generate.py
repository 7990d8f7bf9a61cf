"""Write train/test files of reasoning-gym problems in the DAPO-Math-17k row schema.

```
 seed + 200M --> few-shot examples (only for templates that want them)
 seed + 100M --> test items   (excluding shot questions)            --> test.jsonl / test.parquet
 seed        --> train items  (excluding shot and test questions)   --> train.jsonl / train.parquet
                                                                     + manifest.json (arguments, versions)
```
reasoning-gym seeds item i with ``seed + i``, so nearby seeds share items; the large split offsets keep the draws
apart and the explicit exclusion (dedupe) guarantees that no question appears in two splits. The same arguments
give byte-identical files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from megatron_dapo.data.files import FORMATS
from megatron_dapo.data.files import write_rows
from megatron_dapo.data.reasoning_gym_tasks import TaskItem
from megatron_dapo.data.reasoning_gym_tasks import generate_items
from megatron_dapo.data.reasoning_gym_tasks import validate_task_kwargs
from megatron_dapo.data.templates import Shot
from megatron_dapo.data.templates import get_template

__all__ = ["SPLIT_SEED_OFFSETS", "build_rows", "make_dataset"]

SPLIT_SEED_OFFSETS = {"train": 0, "test": 100_000_000, "shots": 200_000_000}


def build_rows(
    items: Sequence[TaskItem], *, task: str, template: str, shots: Sequence[Shot] = (), split: str, seed: int
) -> list[dict[str, Any]]:
    """Rows in the DAPO-Math-17k schema (prompt, reward_model, data_source, ability, extra_info) for ``items``."""
    tmpl = get_template(template)
    rows = []
    for i, item in enumerate(items):
        rows.append(
            {
                "data_source": f"reasoning_gym/{task}",
                "prompt": tmpl.build(item.question, shots),
                "ability": "math",
                "reward_model": {"ground_truth": item.answer, "style": "rule"},
                "extra_info": {
                    "index": i,
                    "split": split,
                    "task": task,
                    "seed": seed,
                    "source_index": item.source_index,
                    "question": item.question,
                },
            }
        )
    return rows


def _draw_splits(
    task: str, num_train: int, num_test: int, num_shots: int, seed: int, kwargs: Mapping[str, Any]
) -> tuple[list[TaskItem], list[TaskItem], list[TaskItem]]:
    """(shots, test, train) items, pairwise disjoint in question text."""
    seeds = {k: seed + off for k, off in SPLIT_SEED_OFFSETS.items()}
    shots = generate_items(task, num_shots, seed=seeds["shots"], task_kwargs=kwargs)
    shot_q = {it.question for it in shots}
    test = generate_items(task, num_test, seed=seeds["test"], task_kwargs=kwargs, exclude=shot_q)
    test_q = {it.question for it in test}
    train = generate_items(task, num_train, seed=seeds["train"], task_kwargs=kwargs, exclude=shot_q | test_q)
    train_q = {it.question for it in train}
    # generate_items excludes by construction; this guards the invariant the eval numbers rely on.
    if (train_q & test_q) or (train_q & shot_q) or (test_q & shot_q):
        raise RuntimeError(f"{task}: splits share questions; this is a bug in generate_items")
    return shots, test, train


def make_dataset(
    task: str,
    *,
    num_train: int,
    num_test: int,
    out_dir: str | os.PathLike,
    seed: int = 0,
    template: str = "dapo",
    formats: Sequence[str] = ("jsonl",),
    task_kwargs: Mapping[str, Any] | None = None,
    num_shots: int | None = None,
) -> dict[str, list[str]]:
    """Generate disjoint train/test splits of ``task`` and write them under ``out_dir``.

    Writes ``train.<fmt>`` and ``test.<fmt>`` for each format in ``formats`` (a split with 0 items is skipped) and
    ``manifest.json``. ``num_shots`` overrides the template's number of worked examples. Returns
    ``{"train": [paths], "test": [paths], "manifest": [path]}``.
    """
    tmpl = get_template(template)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"unknown formats {bad or list(formats)}; expected a non-empty subset of {list(FORMATS)}")
    if num_train < 0 or num_test < 0 or num_train + num_test == 0:
        raise ValueError(f"need num_train >= 0, num_test >= 0 and at least one > 0; got {num_train}, {num_test}")
    kwargs = validate_task_kwargs(task, task_kwargs)
    n_shots = tmpl.num_shots if num_shots is None else num_shots
    if n_shots < 0 or (tmpl.num_shots > 0 and n_shots == 0):
        raise ValueError(f"template {template!r} needs num_shots >= 1, got {n_shots}")
    if tmpl.num_shots == 0:
        n_shots = 0
    shot_items, test, train = _draw_splits(task, num_train, num_test, n_shots, seed, kwargs)
    shots = [Shot(it.question, it.answer, it.solution) for it in shot_items]
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths: dict[str, list[str]] = {"train": [], "test": [], "manifest": []}
    for split, items in (("train", train), ("test", test)):
        if not items:
            continue
        split_seed = seed + SPLIT_SEED_OFFSETS[split]
        rows = build_rows(items, task=task, template=template, shots=shots, split=split, seed=split_seed)
        for fmt in formats:
            paths[split].append(write_rows(rows, os.path.join(out_dir, f"{split}.{fmt}"), fmt))
    paths["manifest"].append(_write_manifest(out_dir, task, kwargs, seed, template, len(train), len(test), shots))
    return paths


def _write_manifest(
    out_dir: str,
    task: str,
    kwargs: Mapping[str, Any],
    seed: int,
    template: str,
    num_train: int,
    num_test: int,
    shots: Sequence[Shot],
) -> str:
    from importlib.metadata import version

    manifest = {
        "task": task,
        "task_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "seed": seed,
        "split_seeds": {k: seed + off for k, off in SPLIT_SEED_OFFSETS.items()},
        "template": template,
        "num_train": num_train,
        "num_test": num_test,
        "shot_questions": [s.question for s in shots],
        "reasoning_gym_version": version("reasoning-gym"),
    }
    path = os.path.join(out_dir, "manifest.json")
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return path
