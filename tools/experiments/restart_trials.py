"""Issue 22 item 3: one rank fails at a seeded random point of the tiny CPU job; the job must restart itself and end
exactly as a run that was never interrupted.

    python tools/experiments/restart_trials.py run [--trials 20] [--seed 0] [--out runs/restart_trials] [--only 3,7]
    python tools/experiments/restart_trials.py report [--out runs/restart_trials] [--md docs/restart_trials.md]

Each trial draws (hook point, step, rank, kind) from a generator seeded with (seed, trial): the point is one of the
trainer's testing-hook points (docs/reliability.md, "Testing hooks": in generation, after the log-probs pass, at the
step's end, while a checkpoint is written, after the save), the step one of 1..STEPS, the rank 0 or 1, the kind a
SIGKILL (as the OOM killer would) or a RuntimeError. The job runs under `megatron-dapo launch --nproc-per-node=2`
(distributed.max_restarts 2) with tests/_hooks_driver.py failing that rank in the first attempt only. A trial passes
when the job exits 0 after exactly one restart, its metrics.jsonl has each step once, and its metrics (timing keys
aside) and final weights equal the uninterrupted run's. The embedded engine runs inside each rank, so killing a
rank is also how an engine crash looks here. Rows go to OUT/trials.csv; `report` writes the markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.tiny import make_tiny_run
from megatron_dapo.dev.tiny import tiny_overrides
from megatron_dapo.metrics import read_metrics
from megatron_dapo.metrics import without_timing

STEPS = 4
POINTS = ("fresh_prompt", "logprobs_end", "step_end", "before_manifest", "in_save", "after_step")
KINDS = ("kill", "raise")
FIELDS = ("trial", "point", "step", "rank", "kind", "exit_code", "restarts", "steps_logged", "metrics_equal",
          "weights_equal", "resumed_from", "seconds", "ok")  # fmt: skip


def _launch(tiny: dict[str, str], run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "megatron_dapo.cli", "launch", "--nproc-per-node=2", "--module=tests._hooks_driver",
        "--config", str(REPO_ROOT / "examples" / "tiny_cpu.yaml"), *tiny_overrides(tiny, run_dir),
        "--actor.tensor_parallel=2", "--logging.console=plain", "--logging.plots=false", "--trainer.eval_every=0",
        f"--trainer.total_steps={STEPS}", "--checkpoint.save_every=1", f"--checkpoint.keep_last={STEPS}",
    ]  # fmt: skip


def _run(cmd: list[str], log: Path, crash: str | None) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("MEGATRON_DAPO_CRASH", None)
    if crash:
        env["MEGATRON_DAPO_CRASH"] = crash
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    return proc.returncode, log.read_text()


def draw(seed: int, trial: int) -> tuple[str, int, int, str]:
    """The trial's (point, step, rank, kind)."""
    rng = random.Random(f"{seed}:{trial}")
    return rng.choice(POINTS), rng.randint(1, STEPS), rng.randint(0, 1), rng.choice(KINDS)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny = make_tiny_run(out / "tiny", num_train=48, num_test=4)
    straight = out / "straight"
    if not (straight / "hf_final" / "model.safetensors").exists():
        code, text = _run(_launch(tiny, straight), out / "straight.log", None)
        if code != 0:
            raise SystemExit(f"the uninterrupted run failed (exit {code}):\n{text[-3000:]}")
    expected_rows = without_timing(read_metrics(straight))
    expected = load_file(str(straight / "hf_final" / "model.safetensors"))
    table = out / "trials.csv"
    only = {int(x) for x in args.only.split(",")} if args.only else set(range(args.trials))
    earlier = {int(r["trial"]): r for r in csv.DictReader(open(table))} if args.only and table.exists() else {}
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for trial in range(args.trials):
            if trial not in only:
                if trial in earlier:
                    writer.writerow(earlier[trial])
                continue
            point, step, rank, kind = draw(args.seed, trial)
            run_dir = out / f"trial_{trial:03d}"
            if run_dir.exists():
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            start = time.perf_counter()
            code, text = _run(_launch(tiny, run_dir), out / f"trial_{trial:03d}.log", f"{point}:{step}:{rank}:{kind}")
            rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
            final = run_dir / "hf_final" / "model.safetensors"
            weights = final.exists() and all(torch.equal(load_file(str(final))[k], v) for k, v in expected.items())
            resumed = [
                line.split("resumed from ")[1].split()[0] for line in text.splitlines() if "resumed from " in line
            ]
            row = {
                "trial": trial, "point": point, "step": step, "rank": rank, "kind": kind, "exit_code": code,
                "restarts": text.count("(distributed.max_restarts): attempt"),
                "steps_logged": " ".join(str(r["step"]) for r in rows),
                "metrics_equal": without_timing(rows) == expected_rows, "weights_equal": weights,
                "resumed_from": Path(resumed[0]).name if resumed else "",
                "seconds": round(time.perf_counter() - start, 1),
            }  # fmt: skip
            # A point the job never reaches (in_save / before_manifest of a step that saves nothing) fails nothing:
            # then no restart is expected, and the run is simply uninterrupted.
            restarts_ok = row["restarts"] in (0, 1)
            row["ok"] = (
                code == 0 and restarts_ok and row["steps_logged"] == " ".join(map(str, range(1, STEPS + 1)))
                and row["metrics_equal"] and weights
            )  # fmt: skip
            writer.writerow(row)
            f.flush()
            print(", ".join(f"{k}={row[k]}" for k in FIELDS), flush=True)


def report(args: argparse.Namespace) -> None:
    rows = list(csv.DictReader(open(Path(args.out) / "trials.csv")))
    passed = sum(r["ok"] == "True" for r in rows)
    restarted = sum(r["restarts"] == "1" for r in rows)
    unreached = len(rows) - restarted
    lines = [
        f"{passed} of {len(rows)} trials ended exactly as the uninterrupted run; {restarted} restarted once"
        + (f", {unreached} drew a point their step never reaches" if unreached else "")
        + ". Seed and draws: tools/experiments/restart_trials.py.",
        "",
        "| trial | failure | exit | restarts | resumed from | steps logged | metrics equal | weights equal | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trial']} | rank {r['rank']} {r['kind']} at {r['point']} of step {r['step']} | {r['exit_code']} | "
            f"{r['restarts']} | {r['resumed_from'] or '-'} | {r['steps_logged']} | {r['metrics_equal']} | "
            f"{r['weights_equal']} | {r['seconds']} |"
        )
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "report"))
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run: rerun these trials (comma-separated), keep the other rows")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "restart_trials"))
    parser.add_argument("--md", default="", help="report: also write the table to this markdown file")
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
