"""Issue 13 item 3: the SmolLM2 CPU job in three arms, same seed and steps, one after another.

    fp32     rollout.weight_dtype=auto  algorithm.rollout_correction=none   (today's run)
    fp8      rollout.weight_dtype=fp8   algorithm.rollout_correction=none   (FP8 rollout weights, uncorrected)
    fp8_tis  rollout.weight_dtype=fp8   algorithm.rollout_correction=tis    (FP8 rollout weights, TIS C=2)

    python tools/experiments/rollout_mismatch_experiment.py run --steps 10 [--out runs/rollout_mismatch] \
        [-- --extra.override=1]
    python tools/experiments/rollout_mismatch_experiment.py report [--out runs/rollout_mismatch] [--img docs/img]
    python tools/experiments/rollout_mismatch_experiment.py run --dry-run            (print the commands only)

"run" launches examples/run_smollm2_cpu.sh once per arm (torchrun, 2 ranks; it prepares the model and data on first
use) with the arm's overrides, the same trainer.seed, total_steps and a held-out evaluation at the last step; an arm
whose metrics.jsonl already holds the final step is skipped, so an interrupted session can resume. Cost on 2 CPU
cores: roughly the main job's per-step time (docs/cpu_job.md) x steps x 3, FP8 adds the quantization of the sync.
"report" reads the three metrics.jsonl files and prints a markdown table (per arm: mean / last k3 KL, log-ppl abs
diff, actor-engine |d logp|, TIS truncated share, reward accuracy, held-out avg@k) for docs/results.md, and draws one
PNG per curve with the three arms overlaid (rollout_mismatch_{kl_k3,log_ppl,logprob_mismatch,acc}.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import heldout
from megatron_dapo.dev.experiments import main_job_command
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import mean
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import report_overlays
from megatron_dapo.dev.experiments import run_arms
from megatron_dapo.dev.experiments import train_rows

ARMS: dict[str, tuple[str, ...]] = {
    "fp32": ("--rollout.weight_dtype=auto", "--algorithm.rollout_correction=none"),
    "fp8": ("--rollout.weight_dtype=fp8", "--algorithm.rollout_correction=none"),
    "fp8_tis": ("--rollout.weight_dtype=fp8", "--algorithm.rollout_correction=tis"),
}
CURVES = {
    "kl_k3": ("rollout_corr/kl_k3", "k3 KL(engine || actor)"),
    "log_ppl": ("rollout_corr/log_ppl_abs_diff", "|log ppl_actor - log ppl_engine|"),
    "logprob_mismatch": ("rollout/logprob_mismatch", "mean |actor - engine| log-prob"),
    "acc": ("reward/acc", "training reward accuracy"),
}
COMMON = ("--rollout.compare_logprobs=true",)


def arm_command(arm: str, out: Path, steps: int, seed: int, extra: list[str]) -> list[str]:
    """The command line of one arm: the main job's launcher with the arm's switches and a shared schedule."""
    return main_job_command(out / arm, steps, seed, [*COMMON, *ARMS[arm], *extra])


def run(args: argparse.Namespace) -> int:
    arms = {arm: (*COMMON, *ARMS[arm], *args.extra) for arm in ARMS}
    return run_arms(arms, args.arms, args.out, args.steps, args.seed, dry_run=args.dry_run)


def summarize(out: Path) -> list[dict]:
    """One dict per arm found under out: means over the training steps and the last held-out evaluation."""
    table = []
    for arm in ARMS:
        rows = read_metrics(out / arm)
        train = train_rows(rows)
        if not train:
            continue
        table.append(
            {
                "arm": arm,
                "steps": len(train),
                "kl_k3_mean": mean(r.get("rollout_corr/kl_k3") for r in train),
                "kl_k3_last": train[-1].get("rollout_corr/kl_k3", float("nan")),
                "log_ppl_abs_diff_mean": mean(r.get("rollout_corr/log_ppl_abs_diff") for r in train),
                "logprob_mismatch_mean": mean(r.get("rollout/logprob_mismatch") for r in train),
                "truncated_fraction_mean": mean(r.get("rollout_corr/truncated_fraction") for r in train),
                "is_weight_mean": mean(r.get("rollout_corr/is_weight_mean") for r in train),
                "is_weight_max": max(
                    (r.get("rollout_corr/is_weight_max", float("nan")) for r in train), default=float("nan")
                ),
                "reward_acc_mean": mean(r.get("reward/acc") for r in train),
                **heldout(rows),
                "sync_bytes": train[-1].get("weight_sync/bytes", float("nan")),
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    head = (
        "| arm | steps | k3 KL mean (last) | log-ppl abs diff | mean abs d logp | IS weight mean (max) | "
        "TIS truncated | train acc | held-out | sync MB |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for t in table:
        key, value = t["heldout_key"], t["heldout_n"]
        lines.append(
            f"| {t['arm']} | {t['steps']} | {t['kl_k3_mean']:.2e} ({t['kl_k3_last']:.2e}) | "
            f"{t['log_ppl_abs_diff_mean']:.2e} | {t['logprob_mismatch_mean']:.2e} | "
            f"{t['is_weight_mean']:.3f} ({t['is_weight_max']:.2f}) | {t['truncated_fraction_mean']:.3f} | "
            f"{t['reward_acc_mean']:.3f} | "
            f"{key or '-'} {value:.3f} | {t['sync_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser, _ = make_parser(__doc__, ARMS, steps=10, out=REPO_ROOT / "runs" / "rollout_mismatch")
    args = parse_with_overrides(parser, argv)
    if args.command == "run":
        return run(args)
    return report_overlays(args.out, args.img, summarize(args.out), markdown, ARMS, CURVES, "rollout_mismatch")


if __name__ == "__main__":
    sys.exit(main())
