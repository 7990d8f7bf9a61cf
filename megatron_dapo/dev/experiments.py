"""The CPU experiments' arms, shared by tools/experiments/ (compare_trl, paper_ablations, rollout_mismatch_experiment,
loss_comparison, routing_replay_experiment, async_experiment) and tools/bench/rollout_stream.py: run the main job
(examples/run_smollm2_cpu.sh) once per arm with the same seed and number of steps, read each arm's metrics.jsonl,
summarize and draw one overlay plot per curve.

An arm is a name and the config overrides that make it differ from the main job. Every arm gets the same schedule:
trainer.total_steps, trainer.seed, a held-out evaluation at step 0 and at the last step (trainer.eval_every = steps)
and one checkpoint at the end. An arm whose metrics.jsonl already holds the last step is skipped, so an interrupted
session resumes where it stopped.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.metrics import read_metrics as read_metrics_file
from megatron_dapo.metrics import save_step_plot

MAIN_JOB = REPO_ROOT / "examples" / "run_smollm2_cpu.sh"


def main_job_command(run_dir: Path, steps: int, seed: int, overrides: Sequence[str]) -> list[str]:
    """The main job's launcher with an arm's overrides and the shared schedule (later overrides win)."""
    return [
        "bash",
        str(MAIN_JOB),
        f"--trainer.run_dir={run_dir}",
        f"--trainer.total_steps={steps}",
        f"--trainer.seed={seed}",
        f"--trainer.eval_every={steps}",
        f"--checkpoint.save_every={steps}",
        *overrides,
    ]


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of run_dir/metrics.jsonl ([] when the arm has not run)."""
    return read_metrics_file(run_dir) if (Path(run_dir) / "metrics.jsonl").exists() else []


def finished(run_dir: Path, steps: int) -> bool:
    return any(r.get("step") == steps for r in read_metrics(run_dir))


def run_arms(
    arms: Mapping[str, Sequence[str]], names: Iterable[str], out: Path, steps: int, seed: int, *, dry_run: bool = False
) -> int:
    """Run the named arms one after another (the main job, torchrun with 2 ranks); stops at the first failure."""
    for name in names:
        cmd = main_job_command(out / name, steps, seed, arms[name])
        if dry_run:
            print(" ".join(cmd))
            continue
        if finished(out / name, steps):
            print(f"[{name}] already has step {steps}: skipped", flush=True)
            continue
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO_ROOT).returncode
        if rc != 0:
            print(f"[{name}] exited {rc}; stopping", file=sys.stderr)
            return rc
    return 0


def mean(values: Iterable[float | None]) -> float:
    """Mean of the finite values (nan when there are none)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def train_rows(rows: list[dict]) -> list[dict]:
    """The training steps' rows (step >= 1 with training metrics), without the step-0 evaluation row."""
    return [r for r in rows if r.get("step", 0) >= 1 and "reward/acc" in r]


def last_eval(rows: list[dict]) -> tuple[str | None, float]:
    """(avg@k key, value) of the last held-out evaluation in rows, (None, nan) when there is none."""
    evals = [r for r in rows if any(k.startswith("eval/avg@") for k in r)]
    if not evals:
        return None, float("nan")
    key = next(k for k in evals[-1] if k.startswith("eval/avg@"))
    return key, float(evals[-1][key])


def overlay_plots(
    runs: Mapping[str, Path], curves: Mapping[str, tuple[str, str]], img: Path, prefix: str
) -> list[Path]:
    """One PNG per curve (name -> (metric key, title)) with every arm's per-step values overlaid; returns the paths
    written (a curve no arm logged is skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written = []
    rows = {arm: read_metrics(path) for arm, path in runs.items()}
    for name, (key, title) in curves.items():
        fig, ax = plt.subplots(figsize=(5, 3.2))
        drawn = False
        for arm, arm_rows in rows.items():
            points = [(r["step"], r[key]) for r in arm_rows if r.get(key) is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=arm)
                drawn = True
        if drawn:
            written.append(save_step_plot(fig, ax, title, img / f"{prefix}_{name}.png", title_size=9))
        plt.close(fig)
    return written


def heldout(rows: list[dict]) -> dict[str, object]:
    """The held-out avg@k at step 0 and at the last evaluation: {"heldout_key", "heldout_0", "heldout_n"}."""
    key, value = last_eval(rows)
    first = [r for r in rows if r.get("step") == 0 and key in r]
    return {"heldout_key": key, "heldout_0": float(first[0][key]) if first else float("nan"), "heldout_n": value}


def make_parser(doc: str, arms: Iterable[str], steps: int, out: Path, img: bool = True):
    """The experiment tools' command line: `run` (--steps, --seed, --arms, --dry-run) and `report` (--img when the
    tool draws plots), both with --out. Returns (parser, subparsers) so a tool can add its own commands."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--steps", type=int, default=steps)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--arms", nargs="+", default=list(arms), choices=list(arms))
    r.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("report")
    if img:
        p.add_argument("--img", type=Path, default=REPO_ROOT / "docs" / "img")
    for s in (r, p):
        s.add_argument("--out", type=Path, default=out)
    return parser, sub


def parse_with_overrides(parser, argv: list[str] | None):
    """parser.parse_args on the arguments before "--"; what follows "--" (config overrides for every arm, e.g. a
    smaller job for a smoke test) becomes args.extra."""
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    args = parser.parse_args(argv)
    args.extra = extra
    return args


def print_report(out: Path, table: list[dict], markdown: str, plots: Iterable[Path] = ()) -> int:
    """Print a report's markdown table and the plots written; 1 when no arm has metrics under out."""
    if not table:
        print(f"no arm has metrics under {out}", file=sys.stderr)
        return 1
    print(markdown)
    for path in plots:
        print(path)
    return 0


def report_overlays(
    out: Path,
    img: Path,
    table: list[dict],
    markdown: Any,
    arms: Iterable[str],
    curves: Mapping[str, tuple[str, str]],
    prefix: str,
) -> int:
    """The `report` command of a tool whose plots are its arms' curves overlaid: print markdown(table) and draw
    `overlay_plots` of every arm under out into img (nothing drawn when no arm has metrics)."""
    if not table:
        return print_report(out, table, "")
    return print_report(
        out, table, markdown(table), overlay_plots({arm: out / arm for arm in arms}, curves, img, prefix)
    )
