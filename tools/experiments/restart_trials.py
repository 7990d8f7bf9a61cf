"""Issue 22 item 3: one rank fails at a seeded random point of the tiny CPU job (or, with --failure engine, the
ranks' engines die at seeded random points); the job must heal itself and end exactly as a run that was never
interrupted.

    python tools/experiments/restart_trials.py run [--failure rank|engine] [--trials 20] [--seed 0] [--out DIR]
        [--only 3,7]
    python tools/experiments/restart_trials.py report [--failure rank|engine] [--out DIR] [--md FILE]

Each trial draws (hook point, step, rank, kind) from a generator seeded with (seed, trial): the point is one of the
trainer's testing-hook points (docs/reliability.md, "Testing hooks": in generation, after the log-probs pass, at the
step's end, while a checkpoint is written, after the save), the step one of 1..STEPS, the rank 0 or 1, the kind a
SIGKILL (as the OOM killer would) or a RuntimeError. The job runs under `megatron-dapo launch --nproc-per-node=2`
(distributed.max_restarts 2) with tests/_hooks_driver.py failing that rank in the first attempt only. A trial passes
when the job exits 0 after exactly one restart, its metrics.jsonl has each step once, and its metrics (timing keys
aside) and final weights equal the uninterrupted run's. Rows go to OUT/trials.csv; `report` writes the markdown table.

--failure engine: each trial draws a kill seed and a count of 1..3 kills per rank; tests/_hooks_driver.py
(MEGATRON_DAPO_ENGINE_KILL) kills each rank's embedded engine that many times while the rollout stream runs, at
engine steps drawn from that seed (the model dropped, everything in flight lost, EngineDied raised). The stream must
restart each engine in place (no rank restart), re-sync its weights and re-queue its requests. A trial passes when the
job exits 0 without a rank restart, every engine restart is logged, each step is logged once, and metrics and final
weights equal the uninterrupted run's (the embedded engine is batch-invariant and each response seeded). Rows go to
OUT/engine_trials.csv.
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
ENGINE_FIELDS = ("trial", "kill_seed", "kills_per_rank", "exit_code", "rank_restarts", "engine_restarts",
                 "restarts_by_step", "requests_requeued", "steps_logged", "metrics_equal", "weights_equal", "seconds",
                 "ok")  # fmt: skip
RANK_RESTART = "(distributed.max_restarts): attempt"
"""What the launcher's line about a rank restart holds."""
ENGINE_RESTART = "restarting it in place"
"""What the stream's line about an engine restart holds."""


def _launch(tiny: dict[str, str], run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "megatron_dapo.cli", "launch", "--nproc-per-node=2", "--module=tests._hooks_driver",
        "--config", str(REPO_ROOT / "examples" / "tiny_cpu.yaml"), *tiny_overrides(tiny, run_dir),
        "--actor.tensor_parallel=2", "--logging.console=plain", "--logging.plots=false", "--trainer.eval_every=0",
        f"--trainer.total_steps={STEPS}", "--checkpoint.save_every=1", f"--checkpoint.keep_last={STEPS}",
    ]  # fmt: skip


def _run(cmd: list[str], log: Path, crash: str | None, engine_kill: str | None = None) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("MEGATRON_DAPO_CRASH", None)
    env.pop("MEGATRON_DAPO_ENGINE_KILL", None)
    if crash:
        env["MEGATRON_DAPO_CRASH"] = crash
    if engine_kill:
        env["MEGATRON_DAPO_ENGINE_KILL"] = engine_kill
    with open(log, "w") as out:
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    return proc.returncode, log.read_text()


def draw(seed: int, trial: int) -> tuple[str, int, int, str]:
    """The trial's (point, step, rank, kind)."""
    rng = random.Random(f"{seed}:{trial}")
    return rng.choice(POINTS), rng.randint(1, STEPS), rng.randint(0, 1), rng.choice(KINDS)


def draw_engine(seed: int, trial: int) -> tuple[int, int]:
    """The engine trial's (kill seed, kills per rank)."""
    rng = random.Random(f"engine:{seed}:{trial}")
    return rng.randrange(2**31), rng.randint(1, 3)


def engine_trial(tiny: dict[str, str], out: Path, trial: int, seed: int) -> tuple[dict, Path, str]:
    """One --failure engine trial: (its row without the comparisons, its run dir, its log)."""
    kill_seed, kills = draw_engine(seed, trial)
    run_dir = out / f"engine_{trial:03d}"
    start = time.perf_counter()
    code, text = _run(_launch(tiny, run_dir), out / f"engine_{trial:03d}.log", None, f"{kill_seed}:{kills}")
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    by_step = {int(r["step"]): int(r.get("stream/engine_restarts", 0)) for r in rows}
    row = {
        "trial": trial, "kill_seed": kill_seed, "kills_per_rank": kills, "exit_code": code,
        "rank_restarts": text.count(RANK_RESTART), "engine_restarts": text.count(ENGINE_RESTART),
        "restarts_by_step": " ".join(f"{s}:{n}" for s, n in sorted(by_step.items()) if n),
        "requests_requeued": int(sum(r.get("stream/requests_requeued", 0) for r in rows)),
        "seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    return row, run_dir, text


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
    engine = args.failure == "engine"
    fields = ENGINE_FIELDS if engine else FIELDS
    table = out / ("engine_trials.csv" if engine else "trials.csv")
    only = {int(x) for x in args.only.split(",")} if args.only else set(range(args.trials))
    earlier = {int(r["trial"]): r for r in csv.DictReader(open(table))} if args.only and table.exists() else {}
    steps = " ".join(map(str, range(1, STEPS + 1)))

    def same(run_dir: Path) -> tuple[list[dict], bool, bool]:
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        final = run_dir / "hf_final" / "model.safetensors"
        weights = final.exists() and all(torch.equal(load_file(str(final))[k], v) for k, v in expected.items())
        return rows, without_timing(rows) == expected_rows, weights

    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        for trial in range(args.trials):
            if trial not in only:
                if trial in earlier:
                    writer.writerow(earlier[trial])
                continue
            if engine:
                subprocess.run(["rm", "-rf", str(out / f"engine_{trial:03d}")], check=True)
                row, run_dir, _ = engine_trial(tiny, out, trial, args.seed)
                rows, row["metrics_equal"], row["weights_equal"] = same(run_dir)
                row["steps_logged"] = " ".join(str(r["step"]) for r in rows if r["step"] >= 1)
                row["ok"] = (
                    row["exit_code"] == 0 and row["rank_restarts"] == 0 and row["engine_restarts"] >= 1
                    and row["engine_restarts"] == sum(int(x.split(":")[1]) for x in row["restarts_by_step"].split())
                    and row["steps_logged"] == steps and row["metrics_equal"] and row["weights_equal"]
                )  # fmt: skip
                writer.writerow(row)
                f.flush()
                print(", ".join(f"{k}={row[k]}" for k in fields), flush=True)
                continue
            point, step, rank, kind = draw(args.seed, trial)
            run_dir = out / f"trial_{trial:03d}"
            if run_dir.exists():
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            start = time.perf_counter()
            code, text = _run(_launch(tiny, run_dir), out / f"trial_{trial:03d}.log", f"{point}:{step}:{rank}:{kind}")
            rows, metrics_equal, weights = same(run_dir)
            resumed = [
                line.split("resumed from ")[1].split()[0] for line in text.splitlines() if "resumed from " in line
            ]
            row = {
                "trial": trial, "point": point, "step": step, "rank": rank, "kind": kind, "exit_code": code,
                "restarts": text.count(RANK_RESTART),
                "steps_logged": " ".join(str(r["step"]) for r in rows),
                "metrics_equal": metrics_equal, "weights_equal": weights,
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


def report_engine(args: argparse.Namespace) -> str:
    rows = list(csv.DictReader(open(Path(args.out) / "engine_trials.csv")))
    passed = sum(r["ok"] == "True" for r in rows)
    restarts = sum(int(r["engine_restarts"]) for r in rows)
    lines = [
        f"{passed} of {len(rows)} trials ended exactly as the uninterrupted run, with {restarts} in-place engine "
        f"restarts in all and no rank restart. Seed and draws: tools/experiments/restart_trials.py --failure engine.",
        "",
        "| trial | kills per rank | exit | rank restarts | engine restarts (step:n) | requests re-queued "
        "| steps logged | metrics equal | weights equal | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trial']} | {r['kills_per_rank']} | {r['exit_code']} | {r['rank_restarts']} | "
            f"{r['engine_restarts']} ({r['restarts_by_step']}) | {r['requests_requeued']} | {r['steps_logged']} | "
            f"{r['metrics_equal']} | {r['weights_equal']} | {r['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace) -> None:
    if args.failure == "engine":
        text = report_engine(args)
        if args.md:
            Path(args.md).write_text(text)
        print(text)
        return
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
    parser.add_argument("--failure", choices=("rank", "engine"), default="rank", help="what fails in each trial")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run: rerun these trials (comma-separated), keep the other rows")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "restart_trials"))
    parser.add_argument("--md", default="", help="report: also write the table to this markdown file")
    args = parser.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
