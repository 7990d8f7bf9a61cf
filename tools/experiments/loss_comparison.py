"""Issue 21 item 3: DAPO against GRPO and Dr. GRPO on the SmolLM2 CPU job, same data, steps and seeds per arm.

    python tools/experiments/loss_comparison.py run --steps 10 --seeds 0 1 [--out runs/loss_comparison] [--arms ...]
    python tools/experiments/loss_comparison.py report [--out runs/loss_comparison] [--img docs/img]

Arms (the main job, examples/smollm2_arith_cpu.yaml, plus the arm's switches):
    dapo      as shipped: clip 0.2/0.28, token-mean, dynamic sampling, soft overlong penalty
    grpo      algorithm.policy_loss=grpo (symmetric clip 0.2, seq-mean-token-mean, std-normalised advantages), no
              dynamic sampling (every sampled group trains), no overlong shaping
    dr_grpo   algorithm.policy_loss=dr_grpo (symmetric clip 0.2, token sums / generation cap, A = R - mean), no
              dynamic sampling, no overlong shaping

Runs go seed-major (every arm of seed 0, then seed 1, ...) into OUT/seed<S>/<arm>; an arm that already has its
last step is skipped. The report gives, per arm, the mean over seeds and its standard error (sample std / sqrt(n)) of
held-out accuracy at the last step, training accuracy, entropy, response length and clip fractions, overlays the
per-step curves (mean over seeds) and plots held-out accuracy at every evaluated step with its standard error.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import heldout
from megatron_dapo.dev.experiments import last_eval
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import mean
from megatron_dapo.dev.experiments import overlay_plots
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import print_report
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import run_arms
from megatron_dapo.dev.experiments import train_rows

NO_DAPO_DATA = ("--algorithm.dynamic_sampling=false", "--algorithm.overlong_penalty=false")
ARMS: dict[str, tuple[str, ...]] = {
    "dapo": (),
    "grpo": ("--algorithm.policy_loss=grpo", *NO_DAPO_DATA),
    "dr_grpo": ("--algorithm.policy_loss=dr_grpo", *NO_DAPO_DATA),
}
CURVES: dict[str, tuple[str, str]] = {
    "acc": ("reward/acc", "training accuracy (all sampled responses)"),
    "entropy": ("actor/entropy", "mean token entropy"),
    "length": ("response/length_mean", "mean response length (tokens)"),
    "clipfrac_high": ("actor/clipfrac_high", "share of tokens clipped high"),
    "clipfrac_low": ("actor/clipfrac_low", "share of tokens clipped low"),
}
COLUMNS: dict[str, str] = {  # table column -> metric key averaged over a run's training steps
    "train acc": "reward/acc",
    "entropy": "actor/entropy",
    "length": "response/length_mean",
    "clipfrac high": "actor/clipfrac_high",
    "clipfrac low": "actor/clipfrac_low",
    "prompts sampled / step": "sampling/prompts_sampled",
}


def seed_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("seed*") if p.is_dir())


def mean_se(values: list[float]) -> tuple[float, float, int]:
    """(mean, standard error, n) of the finite values; se is nan for n < 2."""
    kept = [v for v in values if math.isfinite(v)]
    n = len(kept)
    if n == 0:
        return float("nan"), float("nan"), 0
    m = sum(kept) / n
    if n < 2:
        return m, float("nan"), n
    var = sum((v - m) ** 2 for v in kept) / (n - 1)
    return m, math.sqrt(var / n), n


def per_run(run_dir: Path) -> dict[str, float] | None:
    rows = read_metrics(run_dir)
    train = train_rows(rows)
    if not train:
        return None
    out = {col: mean(r.get(key) for r in train) for col, key in COLUMNS.items()}
    held = heldout(rows)
    out["held-out last"] = held["heldout_n"]
    out["held-out step 0"] = held["heldout_0"]
    out["steps"] = float(len(train))
    return out


def summarize(out: Path) -> list[dict]:
    table = []
    for arm in ARMS:
        runs = [r for r in (per_run(d / arm) for d in seed_dirs(out)) if r is not None]
        if not runs:
            continue
        row: dict[str, object] = {"arm": arm, "seeds": len(runs), "steps": min(r["steps"] for r in runs)}
        for col in ("held-out step 0", "held-out last", *COLUMNS):
            row[col] = mean_se([r[col] for r in runs])
        table.append(row)
    return table


def markdown(table: list[dict]) -> str:
    cols = ("held-out step 0", "held-out last", *COLUMNS)
    lines = ["| arm | seeds | steps | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for t in table:
        cells = []
        for col in cols:
            m, se, _ = t[col]
            cells.append(f"{m:.4f} ± {se:.4f}" if math.isfinite(se) else f"{m:.4f}")
        lines.append(f"| {t['arm']} | {t['seeds']} | {int(t['steps'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(out: Path, img: Path) -> list[Path]:
    """Per-step curves, each arm's mean over the seeds that reached the step."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for arm in ARMS:
            by_step: dict[int, list[dict]] = {}
            for d in seed_dirs(out):
                for r in train_rows(read_metrics(d / arm)):
                    by_step.setdefault(r["step"], []).append(r)
            if not by_step:
                continue
            rows = [
                {"step": step, **{key: mean(r.get(key) for r in rs) for key, _ in CURVES.values()}}
                for step, rs in sorted(by_step.items())
            ]
            (Path(tmp) / arm).mkdir()
            (Path(tmp) / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs[arm] = Path(tmp) / arm
        return overlay_plots(runs, CURVES, img, "loss_comparison")


def plot_heldout(out: Path, img: Path) -> Path | None:
    """Held-out avg@k at every step a run evaluated: each arm's mean over seeds with its standard error as error bars
    (arms offset a little along x so the bars do not overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    key = None
    for i, arm in enumerate(ARMS):
        by_step: dict[int, list[float]] = {}
        for d in seed_dirs(out):
            rows = read_metrics(d / arm)
            key = key or last_eval(rows)[0]
            for r in rows:
                if key is not None and r.get(key) is not None:
                    by_step.setdefault(int(r["step"]), []).append(float(r[key]))
        if not by_step:
            continue
        steps = sorted(by_step)
        stats = [mean_se(by_step[s]) for s in steps]
        x = [s + (i - (len(ARMS) - 1) / 2) * 0.12 for s in steps]
        errors = [se if math.isfinite(se) else 0.0 for _, se, _ in stats]
        ax.errorbar(
            x, [m for m, _, _ in stats], yerr=errors, marker="o", markersize=4, capsize=3, linestyle="--", label=arm
        )
    if key is None:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_title(f"held-out {key.split('/')[-1]} (mean ± standard error over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    img.mkdir(parents=True, exist_ok=True)
    path = img / "loss_comparison_heldout.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser, sub = make_parser(__doc__, ARMS, steps=10, out=REPO_ROOT / "runs" / "loss_comparison")
    sub.choices["run"].add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parse_with_overrides(parser, argv)
    if args.command == "run":
        arms = {name: (*switches, *args.extra) for name, switches in ARMS.items()}
        for seed in args.seeds:
            rc = run_arms(arms, args.arms, args.out / f"seed{seed}", args.steps, seed, dry_run=args.dry_run)
            if rc != 0:
                return rc
        return 0
    table = summarize(args.out)
    plots = [*plot(args.out, args.img), *filter(None, [plot_heldout(args.out, args.img)])] if table else []
    return print_report(args.out, table, markdown(table) if table else "", plots)


if __name__ == "__main__":
    sys.exit(main())
