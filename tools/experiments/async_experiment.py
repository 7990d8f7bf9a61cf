"""Issue 24 item 7: synchronous colocated against asynchronous split training on the CPU main job (SmolLM2-135M,
2 ranks, seed 0), the arms one after another in one invocation:

    sync      colocated: both ranks generate, then both train (PP=2), in turn (the main job)
    async     rollout.engine_ranks=1: rank 1 only generates, rank 0 only trains (PP=1); trainer.max_staleness=1, so
              step s is generated while step s-1 trains
    lockstep  the same split with max_staleness=0 (no overlap): isolates the placement from the overlap (not run by
              default)

Every arm trains with token TIS on the engine's log-probs (on-policy it weighs ~1) and evaluates nothing in the job:
"run" scores the base model and each arm's hf_final with `megatron-dapo eval` (the job's eval settings: avg@4 on 32
held-out prompts) into <out>/<arm>/heldout.json.

    python tools/experiments/async_experiment.py run --steps 8 [--arms sync async] [--out runs/async] [-- --x.y=z]
    python tools/experiments/async_experiment.py report [--out runs/async] [--img docs/img]

"report" prints a markdown table per arm: seconds per step and per kept group, the actor's busy fraction (log-probs
+ update + push over the step) and the time it waits for generation, the engines' busy fraction inside the stream and
their wait for weights, response age (weight versions behind the update that trains on it), k3 KL(engine || actor),
IS weights and truncation, split by the steps whose responses were all on-policy (age 0) and the others, training
accuracy and held-out avg@4; and overlays per-step curves (async_{step_s,kl_k3,age,acc}.png).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import mean
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import report_overlays
from megatron_dapo.dev.experiments import run_arms
from megatron_dapo.dev.experiments import train_rows

SPLIT = ("--rollout.engine_ranks=1", "--actor.pipeline_parallel=1")
ARMS: dict[str, tuple[str, ...]] = {
    "sync": (),
    "async": (*SPLIT, "--trainer.max_staleness=1"),
    "lockstep": (*SPLIT, "--trainer.max_staleness=0"),
}
DEFAULT_ARMS = ("sync", "async")
COMMON = ("--algorithm.rollout_correction=tis", "--trainer.eval_every=0")
CONFIG = REPO_ROOT / "examples" / "smollm2_arith_cpu.yaml"
BASE_MODEL = Path("~/.cache/megatron_dapo/smollm2-135m-instruct").expanduser()
CURVES = {
    "step_s": ("time/step", "seconds per step"),
    "kl_k3": ("rollout_corr/kl_k3", "k3 KL(engine || actor), sampled tokens"),
    "age": ("stream/response_age_mean", "mean response age (weight versions)"),
    "acc": ("reward/acc", "training reward accuracy"),
}


def evaluate(model: Path, out_file: Path) -> None:
    """`megatron-dapo eval` of `model` with the main job's eval settings -> out_file (once)."""
    if out_file.exists():
        return
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "eval", "--config", str(CONFIG), f"--model={model}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    out_file.write_text(proc.stdout)


def run(args: argparse.Namespace) -> int:
    arms = {arm: [*COMMON, *ARMS[arm], *args.extra] for arm in ARMS}
    rc = run_arms(arms, args.arms, args.out, args.steps, args.seed, dry_run=args.dry_run)
    if rc or args.dry_run:
        return rc
    evaluate(BASE_MODEL, args.out / "base_heldout.json")
    for arm in args.arms:
        evaluate(args.out / arm / "hf_final", args.out / arm / "heldout.json")
    return 0


def _heldout(path: Path) -> float:
    if not path.exists():
        return float("nan")
    scores = json.loads(path.read_text())
    key = next((k for k in scores if k.startswith("eval/avg@")), None)
    return float(scores[key]) if key else float("nan")


def summarize(out: Path) -> list[dict]:
    """One dict per arm found under out: means over the training steps (step 1, with the engines' and the actor's
    start-up in it, is left out of the timings) and the held-out score of its final model."""
    table = []
    for arm in ARMS:
        train = train_rows(read_metrics(out / arm))
        if not train:
            continue
        timed = train[1:] or train
        fresh = [r for r in train if r.get("stream/response_age_max", 0) == 0]
        stale = [r for r in train if r.get("stream/response_age_max", 0) > 0]
        step_s = mean(r["time/step"] for r in timed)
        actor = [(r.get("time/logprobs", 0) + r.get("time/update", 0) + r.get("time/weight_sync", 0)) / r["time/step"]
                 for r in timed]  # fmt: skip
        table.append(
            {
                "arm": arm,
                "steps": len(train),
                "step_s": step_s,
                "group_s": mean(r["time/step"] / max(r.get("sampling/prompts_kept", 0), 1) for r in timed),
                "wall_s": sum(r["time/step"] for r in train),
                "actor_busy": mean(actor),
                "actor_wait_s": mean(r.get("time/generate") for r in timed),
                "engine_busy": mean(r.get("stream/engine_busy_fraction") for r in timed),
                "engine_wait_s": mean(r.get("time/engine_wait_for_weights", 0.0) for r in timed),
                "age_mean": mean(r.get("stream/response_age_mean", 0.0) for r in train),
                "age_max": max(r.get("stream/response_age_max", 0.0) for r in train),
                "kl_fresh": mean(r.get("rollout_corr/kl_k3") for r in fresh),
                "kl_stale": mean(r.get("rollout_corr/kl_k3") for r in stale),
                "is_mean": mean(r.get("rollout_corr/is_weight_mean") for r in train),
                "is_max": max((r.get("rollout_corr/is_weight_max", 0.0) for r in train), default=0.0),
                "truncated": mean(r.get("rollout_corr/truncated_fraction") for r in train),
                "acc": mean(r.get("reward/acc") for r in train),
                "heldout": _heldout(out / arm / "heldout.json"),
                "heldout_base": _heldout(out / "base_heldout.json"),
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    head = (
        "| arm | steps | s/step | s/kept group | wall s | actor busy (waits s/step) | engine busy (waits s/step) | "
        "age mean (max) | k3 KL age 0 / age >= 1 | IS weight mean (max) | TIS truncated | train acc | held-out |\n"
        + "|---" * 13
        + "|"
    )
    lines = [head]
    for t in table:
        lines.append(
            f"| {t['arm']} | {t['steps']} | {t['step_s']:.0f} | {t['group_s']:.1f} | {t['wall_s']:.0f} | "
            f"{t['actor_busy']:.2f} ({t['actor_wait_s']:.0f}) | {t['engine_busy']:.2f} ({t['engine_wait_s']:.0f}) | "
            f"{t['age_mean']:.2f} ({t['age_max']:.0f}) | {t['kl_fresh']:.1e} / {t['kl_stale']:.1e} | "
            f"{t['is_mean']:.3f} ({t['is_max']:.2f}) | {t['truncated']:.4f} | {t['acc']:.3f} | "
            f"{t['heldout_base']:.3f} -> {t['heldout']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser, sub = make_parser(__doc__, ARMS, steps=8, out=REPO_ROOT / "runs" / "async")
    sub.choices["run"].set_defaults(arms=list(DEFAULT_ARMS))
    args = parse_with_overrides(parser, argv)
    if args.command == "run":
        return run(args)
    return report_overlays(args.out, args.img, summarize(args.out), markdown, ARMS, CURVES, "async")


if __name__ == "__main__":
    sys.exit(main())
