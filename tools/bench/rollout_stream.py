"""The main CPU job with generation as sequential rounds (the code before the stream, a git commit) and as the stream
(this tree), interleaved: rounds, stream, rounds, stream ... with the same seed and steps. Runs in
runs/rollout_stream/<arm>_<k>; `report` writes results/rollout_stream/{<arm>_<k>.jsonl, summary.json, summary.md}.

    python tools/bench/rollout_stream.py run [--rounds-commit 27cfe3c] [--repeats 2] [--steps 5] [-- overrides]
    python tools/bench/rollout_stream.py report

Per arm (all repeats): generation seconds per kept group (sum of time/generate / sum of sampling/prompts_kept) and
per generated token, the median step time, the held-out avg@k at the last step. The rounds arm runs from a detached
worktree of --rounds-commit (created under runs/rollout_stream/worktree, PYTHONPATH pointing at it), so each arm
runs its own code; both read the same model cache and write their data under their own tree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import finished
from megatron_dapo.dev.experiments import heldout
from megatron_dapo.dev.experiments import main_job_command
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import print_report
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import train_rows

OUT = REPO_ROOT / "runs" / "rollout_stream"
RESULTS = REPO_ROOT / "results" / "rollout_stream"
ROUNDS_COMMIT = "27cfe3c"
"""The last commit that generated in sequential rounds over static shards (issue 19)."""


def worktree(commit: str, out: Path) -> Path:
    """A detached worktree of `commit` under out/worktree (made once)."""
    path = out / "worktree"
    if not (path / "megatron_dapo").exists():
        cmd = ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-f", str(path), commit]
        subprocess.run(cmd, check=True)
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if not commit.startswith(head.stdout.strip()[:7]):
        raise SystemExit(f"{path} is at {head.stdout.strip()}, not {commit}: remove it and rerun")
    return path


def run(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"rounds": worktree(args.rounds_commit, args.out), "stream": REPO_ROOT}
    for k in range(args.repeats):
        for arm, tree in trees.items():
            run_dir = (args.out / f"{arm}_{k}").resolve()
            if finished(run_dir, args.steps):
                print(f"[{arm}_{k}] already has step {args.steps}: skipped", flush=True)
                continue
            cmd = main_job_command(run_dir, args.steps, args.seed, args.extra)
            cmd[1] = str(tree / "examples" / "run_smollm2_cpu.sh")
            env = {**os.environ, "PYTHONPATH": str(tree)}
            print(f"[{arm}_{k}] ({tree}) {' '.join(cmd)}", flush=True)
            if subprocess.run(cmd, cwd=tree, env=env).returncode != 0:
                print(f"[{arm}_{k}] failed; stopping", file=sys.stderr)
                return 1
    return 0


def summarize(out: Path) -> list[dict]:
    table = []
    for arm in ("rounds", "stream"):
        runs = sorted(p for p in out.glob(f"{arm}_*") if read_metrics(p))
        rows = [r for p in runs for r in train_rows(read_metrics(p))]
        if not rows:
            continue
        gen_s = sum(r["time/generate"] for r in rows)
        kept = sum(r["sampling/prompts_kept"] for r in rows)
        tokens = sum(r["perf/gen_tokens_per_s"] * r["time/generate"] for r in rows)
        evals = [heldout(read_metrics(p)) for p in runs]
        table.append(
            {
                "arm": arm,
                "runs": len(runs),
                "steps": len(rows),
                "gen_s_per_kept_group": gen_s / max(kept, 1),
                "gen_ms_per_token": 1000 * gen_s / max(tokens, 1),
                "tokens_per_kept_group": tokens / max(kept, 1),
                "prompts_sampled_per_step": statistics.mean(r["sampling/prompts_sampled"] for r in rows),
                "gen_s_per_step_median": statistics.median(r["time/generate"] for r in rows),
                "step_s_median": statistics.median(r["time/step"] for r in rows),
                "heldout_key": evals[0]["heldout_key"],
                "heldout_0": [e["heldout_0"] for e in evals],
                "heldout_last": [e["heldout_n"] for e in evals],
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    head = (
        "| arm | runs x steps | gen s / kept group | tokens / kept group | gen ms / token | sampled prompts / step "
        "| gen s / step (median) | step s (median) | held-out at the end |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for t in table:
        held = ", ".join(f"{v:.3f}" for v in t["heldout_last"])
        lines.append(
            f"| {t['arm']} | {t['runs']} x {t['steps'] // max(t['runs'], 1)} | {t['gen_s_per_kept_group']:.2f} | "
            f"{t['tokens_per_kept_group']:.0f} | {t['gen_ms_per_token']:.1f} | {t['prompts_sampled_per_step']:.1f} | "
            f"{t['gen_s_per_step_median']:.1f} | "
            f"{t['step_s_median']:.1f} | {t['heldout_key']} {held} |"
        )
    if len(table) == 2:
        r, s = table
        lines.append(
            f"\nstream / rounds: generation per kept group {s['gen_s_per_kept_group'] / r['gen_s_per_kept_group']:.2f}"
            f"x (tokens {s['tokens_per_kept_group'] / r['tokens_per_kept_group']:.2f}x), "
            f"per token {s['gen_ms_per_token'] / r['gen_ms_per_token']:.2f}x, step time "
            f"{s['step_s_median'] / r['step_s_median']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser, sub = make_parser(__doc__, ["rounds", "stream"], steps=5, out=OUT, img=False)
    r = sub.choices["run"]
    r.add_argument("--rounds-commit", default=ROUNDS_COMMIT)
    r.add_argument("--repeats", type=int, default=2)
    args = parse_with_overrides(parser, argv)
    if args.command == "run":
        return run(args)
    table = summarize(args.out)
    text = markdown(table)
    if table:
        RESULTS.mkdir(parents=True, exist_ok=True)
        for run_dir in sorted(p for p in args.out.glob("*_*") if (p / "metrics.jsonl").exists()):
            (RESULTS / f"{run_dir.name}.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
        (RESULTS / "summary.json").write_text(json.dumps(table, indent=1))
        (RESULTS / "summary.md").write_text(text + "\n")
    return print_report(args.out, table, text)


if __name__ == "__main__":
    sys.exit(main())
