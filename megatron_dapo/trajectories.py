"""A per-step sample of the trained trajectories, readable by a person (logging.trajectory_samples, issue 40 item 6).

    run_dir/trajectories/step_00000007.jsonl   one JSON object per sampled response: example, truth, reward, accuracy,
                                               finish, token counts, the episode's counts (multi-turn), the prompt,
                                               and the response in parts: model turns and observations, in order
    run_dir/trajectories/index.html            every step file of the run as one page (rebuilt after each step)

The text is decoded for reading only (special tokens kept, so turn markers show); training never reads it back.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_dapo.rollout.types import RolloutGroup

DIRECTORY = "trajectories"
"""The samples' folder in the run directory."""


def response_parts(rollout: Any) -> list[tuple[str, slice]]:
    """The response as ("model" | "observation", token slice) parts in order (Rollout.observations)."""
    parts, at = [], 0
    for start, end in rollout.observations:
        if start > at:
            parts.append(("model", slice(at, start)))
        parts.append(("observation", slice(start, end)))
        at = end
    if at < len(rollout):
        parts.append(("model", slice(at, len(rollout))))
    return parts


def trajectory_record(group: RolloutGroup, k: int, tokenizer: Any) -> dict[str, Any]:
    """Response k of `group` as a plain record (see the module docstring)."""
    r = group.rollouts[k]
    ids = r.response_ids.tolist()
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=False)
    return {
        "index": group.index,
        "truth": group.truth,
        "sample": k,
        "reward": float(group.rewards[k]),
        "acc": bool(group.accs[k]),
        "finish": r.finish.value,
        "tokens": len(r),
        "model_tokens": r.model_tokens,
        "episode": {name: float(values[k]) for name, values in group.episodes.items()},
        "prompt": decode(r.prompt_ids.tolist()),
        "parts": [{"role": role, "text": decode(ids[part])} for role, part in response_parts(r)],
    }


def sample_records(groups: Iterable[RolloutGroup], tokenizer: Any, count: int) -> list[dict[str, Any]]:
    """Up to `count` responses of `groups` as records, one per group in turn (group 0's first, group 1's first, ...,
    then each group's second)."""
    groups = list(groups)
    depth = max((len(g.rollouts) for g in groups), default=0)
    chosen = [(g, k) for k in range(depth) for g in groups if k < len(g.rollouts)][:count]
    return [trajectory_record(g, k, tokenizer) for g, k in chosen]


def gather_samples(exchange: Any, rank: int, run_dir: str | Path, step: int, groups: Iterable[RolloutGroup],
                   tokenizer: Any, count: int) -> None:  # fmt: skip
    """Collective over `exchange` (every rank calls it): each rank's `sample_records` of the kept groups it
    generated, gathered; rank 0 writes the first `count` by sample then example (`write_samples`)."""
    records = exchange.all_gather(sample_records(groups, tokenizer, count), "trajectory samples")
    if rank == 0:
        write_samples(run_dir, step, first_samples(records, count))


def first_samples(records: Iterable[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The `count` records a step's file holds: by sample, then example index."""
    return sorted(records, key=lambda rec: (rec["sample"], rec["index"]))[:count]


def write_samples(run_dir: str | Path, step: int, records: Iterable[dict[str, Any]]) -> Path:
    """Write `records` as run_dir/trajectories/step_<step>.jsonl (replacing it whole), rebuild index.html; returns
    the step's file."""
    folder = Path(run_dir) / DIRECTORY
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:08d}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    tmp.replace(path)
    write_index(folder)
    return path


_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:70em}pre{white-space:pre-wrap;margin:0}"
    ".model{background:#eef6ff;border-left:4px solid #4a90d9;padding:.3em .6em;margin:.2em 0}"
    ".observation{background:#f3f3f3;border-left:4px solid #999;padding:.3em .6em;margin:.2em 0}"
    ".prompt{color:#555}.good{color:#1a7f37}.bad{color:#cf222e}details{margin:.6em 0}"
)


def write_index(folder: str | Path) -> Path:
    """folder/index.html: every step_*.jsonl of the folder, newest step first, one collapsible block per response
    (model turns blue, observations grey). Unreadable lines are shown as such, not skipped silently."""
    folder = Path(folder)
    blocks = []
    for path in sorted(folder.glob("step_*.jsonl"), reverse=True):
        blocks.append(f"<h2>{html.escape(path.stem)}</h2>")
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            try:
                blocks.append(_response_html(json.loads(line)))
            except (ValueError, KeyError, TypeError) as err:
                why = html.escape(f"{path.name} line {n}: unreadable ({err})")
                blocks.append(f"<p class='bad'>{why}</p>")
    page = (
        f"<!doctype html><meta charset='utf-8'><title>trajectories</title><style>{_STYLE}</style>"
        f"<h1>Trajectories</h1>{''.join(blocks)}"
    )
    out = folder / "index.html"
    out.write_text(page)
    return out


def _response_html(rec: dict[str, Any]) -> str:
    esc = html.escape
    verdict = "good" if rec["acc"] else "bad"
    counts = ", ".join(f"{k} {v:g}" for k, v in rec.get("episode", {}).items() if not k.startswith("stop/"))
    head = (
        f"example {rec['index']} #{rec['sample']}: <span class='{verdict}'>reward {rec['reward']:+.3f}</span>, "
        f"truth {esc(str(rec['truth']))}, {rec['finish']}, {rec['model_tokens']} model / {rec['tokens']} tokens"
        + (f" ({esc(counts)})" if counts else "")
    )
    parts = "".join(f"<div class='{esc(p['role'])}'><pre>{esc(p['text'])}</pre></div>" for p in rec["parts"])
    return f"<details><summary>{head}</summary><pre class='prompt'>{esc(rec['prompt'])}</pre>{parts}</details>"
