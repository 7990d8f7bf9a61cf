"""Issue 23 item 5: routing replay on a small MoE on CPU. The main job's data and schedule on SmolLM2-135M-Instruct
upcycled into a Qwen2-MoE (each MLP copied into 4 experts with 10% weight noise, a fresh top-2 router:
megatron_dapo/dev/upcycle.py), FP8 rollout weights with token TIS in every arm, three arms one after another:

    none   actor.routing_replay=none   the actor routes every pass itself
    r2     actor.routing_replay=r2     the update replays the experts of the old-log-prob pass
    r3     actor.routing_replay=r3     the engine returns its experts; both actor passes replay them

    python tools/experiments/routing_replay_experiment.py run --steps 4 [--out runs/routing_replay] [-- --x.y=z]
    python tools/experiments/routing_replay_experiment.py report [--out runs/routing_replay] [--img docs/img]

"run" first writes the upcycled model under <out>/model (once; --experts, --topk, --noise), then launches
examples/run_smollm2_cpu.sh per arm (2 ranks, PP=2) with the arm's switches. Every arm turns the shared-prefix
pass off (routing replay refuses it), so a step costs the unshared actor passes on a model with twice the MLP work.
"report" prints a markdown table per arm: engine-actor routing agreement (r3: the old-log-prob pass's router against
the engine's experts; r2: the update's router against the old pass's), k3 KL(engine || actor) and |d logp| of the
sampled tokens, the TIS weights, reward accuracy, held-out avg@k; and overlays per-step curves in PNGs
(routing_replay_{kl_k3,logprob_mismatch,agreement,acc}.png).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import heldout
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import mean
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import report_overlays
from megatron_dapo.dev.experiments import run_arms
from megatron_dapo.dev.experiments import train_rows

ARMS: dict[str, tuple[str, ...]] = {arm: (f"--actor.routing_replay={arm}",) for arm in ("none", "r2", "r3")}
COMMON = (
    "--actor.shared_prefix=false",
    "--rollout.weight_dtype=fp8",
    "--rollout.compare_logprobs=true",
    "--algorithm.rollout_correction=tis",
)
AGREEMENT = {"r2": "actor/routing_agreement", "r3": "rollout/routing_agreement"}
"""The agreement an arm measures: r3 the engine's experts against the actor's router in the old-log-prob pass, r2 the
old pass's experts against the update's router (none replays nothing, so it measures none)."""
CURVES = {
    "kl_k3": ("rollout_corr/kl_k3", "k3 KL(engine || actor), sampled tokens"),
    "logprob_mismatch": ("rollout/logprob_mismatch", "mean |actor - engine| log-prob"),
    "agreement_r3": ("rollout/routing_agreement", "routing agreement engine vs actor (r3)"),
    "acc": ("reward/acc", "training reward accuracy"),
}
SOURCE_MODEL = Path("~/.cache/megatron_dapo/smollm2-135m-instruct").expanduser()


def prepare_model(out: Path, experts: int, topk: int, noise: float) -> Path:
    """<out>/model: the upcycled SmolLM2 (written once; prepares SmolLM2 itself first when it is missing)."""
    from megatron_dapo.dev.upcycle import upcycle_llama_to_moe

    model = out / "model"
    if (model / "config.json").exists():
        return model
    if not (SOURCE_MODEL / "config.json").exists():
        import subprocess

        subprocess.run([sys.executable, str(REPO_ROOT / "tools/setup/prepare_smollm2.py")], check=True)
    print(f"[prepare] upcycling {SOURCE_MODEL} -> {model} ({experts} experts, top-{topk}, noise {noise})", flush=True)
    return upcycle_llama_to_moe(SOURCE_MODEL, model, num_experts=experts, top_k=topk, noise=noise)


def arm_overrides(arm: str, model: Path, extra: list[str]) -> list[str]:
    return [f"--actor.model_path={model}", *COMMON, *ARMS[arm], *extra]


def run(args: argparse.Namespace) -> int:
    model = args.out / "model" if args.dry_run else prepare_model(args.out, args.experts, args.topk, args.noise)
    arms = {arm: arm_overrides(arm, model, args.extra) for arm in ARMS}
    return run_arms(arms, args.arms, args.out, args.steps, args.seed, dry_run=args.dry_run)


def summarize(out: Path) -> list[dict]:
    """One dict per arm found under out: means over the training steps and the last held-out evaluation."""
    table = []
    for arm in ARMS:
        train = train_rows(read_metrics(out / arm))
        if not train:
            continue
        key = AGREEMENT.get(arm)
        table.append(
            {
                "arm": arm,
                "steps": len(train),
                "agreement": mean(r.get(key) for r in train) if key else float("nan"),
                "agreement_min": min((r.get(f"{key}_min", 1.0) for r in train), default=float("nan"))
                if key
                else float("nan"),
                "kl_k3_mean": mean(r.get("rollout_corr/kl_k3") for r in train),
                "logprob_mismatch_mean": mean(r.get("rollout/logprob_mismatch") for r in train),
                "logprob_mismatch_max": max((r.get("rollout/logprob_mismatch_max", 0.0) for r in train), default=0.0),
                "is_weight_mean": mean(r.get("rollout_corr/is_weight_mean") for r in train),
                "is_weight_max": max((r.get("rollout_corr/is_weight_max", float("nan")) for r in train), default=0.0),
                "truncated_fraction_mean": mean(r.get("rollout_corr/truncated_fraction") for r in train),
                "reward_acc_mean": mean(r.get("reward/acc") for r in train),
                "step_s_mean": mean(r.get("time/step") for r in train),
                **heldout(read_metrics(out / arm)),
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    head = (
        "| arm | steps | routing agreement mean (worst layer) | k3 KL mean | mean abs d logp (max token) | "
        "IS weight mean (max) | TIS truncated | train acc | held-out | s/step |\n" + "|---" * 10 + "|"
    )
    lines = [head]
    for t in table:
        agreement = "-" if t["agreement"] != t["agreement"] else f"{t['agreement']:.4f} ({t['agreement_min']:.3f})"
        lines.append(
            f"| {t['arm']} | {t['steps']} | {agreement} | {t['kl_k3_mean']:.2e} | "
            f"{t['logprob_mismatch_mean']:.2e} ({t['logprob_mismatch_max']:.2f}) | "
            f"{t['is_weight_mean']:.3f} ({t['is_weight_max']:.2f}) | {t['truncated_fraction_mean']:.4f} | "
            f"{t['reward_acc_mean']:.3f} | {t['heldout_key'] or '-'} {t['heldout_0']:.3f} -> {t['heldout_n']:.3f} | "
            f"{t['step_s_mean']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser, sub = make_parser(__doc__, ARMS, steps=4, out=REPO_ROOT / "runs" / "routing_replay")
    r = sub.choices["run"]
    r.add_argument("--experts", type=int, default=4)
    r.add_argument("--topk", type=int, default=2)
    r.add_argument("--noise", type=float, default=0.1, help="expert weight noise, in units of each weight's std")
    args = parse_with_overrides(parser, argv)
    if args.command == "run":
        return run(args)
    return report_overlays(args.out, args.img, summarize(args.out), markdown, ARMS, CURVES, "routing_replay")


if __name__ == "__main__":
    sys.exit(main())
