"""Issue 14 item 3: the DAPO paper's mechanisms one at a time on the SmolLM2 CPU job (same seed and steps per arm).

    python tools/experiments/paper_ablations.py run --steps 4 [--out runs/side_by_side] [--arms ...]
    python tools/experiments/paper_ablations.py report [--out runs/side_by_side] [--img docs/img]

Arms (the main job, examples/smollm2_arith_cpu.yaml, plus the arm's switches):
    ours                 as shipped: clip-higher 0.2/0.28, dynamic sampling, token-mean, 2 mini-batches per step
    ours_no_ds           dynamic sampling off (every sampled group trains, all-correct / all-wrong ones too)
    seq_mean_token_mean  loss.loss_agg_mode seq-mean-token-mean (each response's mean, then the mean over responses)
    clip_higher_4mb      4 mini-batches per step (the later updates are off-policy, so the ratio leaves 1)
    symmetric_4mb        4 mini-batches and symmetric clipping 0.2/0.2 (loss.clip_higher=false)

Comparisons: clip_higher_4mb vs symmetric_4mb (entropy, clipfrac high/low, ratio max per step); ours vs ours_no_ds
(useful prompts per step: groups whose accuracy is strictly between 0 and 1; accuracy); ours vs
seq_mean_token_mean (response length, accuracy). "ours" and "ours_no_ds" are the same runs as
tools/experiments/compare_trl.py's arms of those names when both tools use the same --out, --steps and --seed: an arm
that already finished is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import heldout
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import mean
from megatron_dapo.dev.experiments import overlay_plots
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import print_report
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import run_arms
from megatron_dapo.dev.experiments import train_rows

ARMS: dict[str, tuple[str, ...]] = {
    "ours": (),
    "ours_no_ds": ("--algorithm.dynamic_sampling=false",),
    "seq_mean_token_mean": ("--loss.loss_agg_mode=seq-mean-token-mean",),
    "clip_higher_4mb": ("--trainer.mini_batch_prompts=2",),
    "symmetric_4mb": ("--trainer.mini_batch_prompts=2", "--loss.clip_higher=false"),
}
COMPARISONS: dict[str, tuple[tuple[str, ...], dict[str, tuple[str, str]]]] = {
    "clip": (
        ("clip_higher_4mb", "symmetric_4mb"),
        {
            "entropy": ("actor/entropy", "mean token entropy of the sampled responses"),
            "clipfrac_high": ("actor/clipfrac_high", "share of tokens clipped at 1 + eps_high"),
            "clipfrac_low": ("actor/clipfrac_low", "share of tokens clipped at 1 - eps_low"),
            "ratio_max": ("actor/ratio_max", "largest importance ratio"),
        },
    ),
    "dynamic_sampling": (
        ("ours", "ours_no_ds"),
        {
            "useful": ("useful_prompts", "prompts with 0 < accuracy < 1 in the trained batch"),
            "acc": ("reward/acc", "training reward accuracy (all sampled responses)"),
        },
    ),
    "loss_agg": (
        ("ours", "seq_mean_token_mean"),
        {
            "length": ("response/length_mean", "mean response length (tokens)"),
            "acc": ("reward/acc", "training reward accuracy"),
        },
    ),
}


def useful_prompts(row: dict) -> float | None:
    """Prompts of the trained batch whose group accuracy is strictly between 0 and 1. With dynamic sampling every
    kept prompt is such a prompt (sampling/prompts_kept); without it the batch is every sampled prompt, minus the
    all-correct and all-wrong groups."""
    if "sampling/prompts_kept" not in row:
        return None
    if "sampling/groups_all_correct" in row and row.get("sampling/prompts_kept") == row.get("sampling/prompts_sampled"):
        return row["sampling/prompts_sampled"] - row["sampling/groups_all_correct"] - row["sampling/groups_all_wrong"]
    return row["sampling/prompts_kept"]


def _with_derived(rows: list[dict]) -> list[dict]:
    return [{**r, "useful_prompts": useful_prompts(r)} if "reward/acc" in r else r for r in rows]


def summarize(out: Path) -> list[dict]:
    table = []
    for arm in ARMS:
        rows = _with_derived(read_metrics(out / arm))
        train = train_rows(rows)
        if not train:
            continue
        table.append(
            {
                "arm": arm,
                "steps": len(train),
                "entropy": mean(r.get("actor/entropy") for r in train),
                "clipfrac_high": mean(r.get("actor/clipfrac_high") for r in train),
                "clipfrac_low": mean(r.get("actor/clipfrac_low") for r in train),
                "ratio_max": max((r.get("actor/ratio_max", float("nan")) for r in train), default=float("nan")),
                "useful": mean(r.get("useful_prompts") for r in train),
                "sampled": mean(r.get("sampling/prompts_sampled") for r in train),
                "length": mean(r.get("response/length_mean") for r in train),
                "acc": mean(r.get("reward/acc") for r in train),
                **heldout(rows),
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| arm | steps | entropy | clipfrac high | clipfrac low | ratio max | useful prompts / step | prompts sampled "
        "/ step | response length | train acc | held-out step 0 -> N |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['arm']} | {t['steps']} | {t['entropy']:.3f} | {t['clipfrac_high']:.4f} | {t['clipfrac_low']:.4f} | "
            f"{t['ratio_max']:.2f} | {t['useful']:.1f} | {t['sampled']:.1f} | {t['length']:.1f} | {t['acc']:.3f} | "
            f"{t['heldout_key'] or '-'} {t['heldout_0']:.3f} -> {t['heldout_n']:.3f} |"
        )
    return "\n".join(lines)


def plot(out: Path, img: Path) -> list[Path]:
    import json
    import tempfile

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for arm in ARMS:  # the derived per-step metric goes through the same overlay code as the logged ones
            rows = _with_derived(read_metrics(out / arm))
            (Path(tmp) / arm).mkdir()
            (Path(tmp) / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs[arm] = Path(tmp) / arm
        for name, (arms, curves) in COMPARISONS.items():
            written += overlay_plots({a: runs[a] for a in arms}, curves, img, f"ablation_{name}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser, _ = make_parser(__doc__, ARMS, steps=4, out=REPO_ROOT / "runs" / "side_by_side")
    args = parse_with_overrides(parser, argv)
    if args.command == "run":
        arms = {name: (*switches, *args.extra) for name, switches in ARMS.items()}
        return run_arms(arms, args.arms, args.out, args.steps, args.seed, dry_run=args.dry_run)
    table = summarize(args.out)
    return print_report(args.out, table, markdown(table) if table else "", plot(args.out, args.img) if table else ())


if __name__ == "__main__":
    sys.exit(main())
