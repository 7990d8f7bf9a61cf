"""Does a Python tool help a small model on arithmetic it cannot do in its head? (issue 40 item 7)

Task: the product of a 2-digit and a 3-digit number (SmolLM2-135M-Instruct gets nearly none right unaided). Two arms
on the same problems and seeds, DAPO on CPU with the main job's settings otherwise (examples/smollm2_arith_cpu.yaml):

    tool     reward.environment=python_tool; the few-shot turns show a fenced python block, the tool's reply (a "tool"
             turn) and the answer line; the model's calls run in the sandbox (envs/sandbox.py)
    no_tool  reward.environment=single_turn; the same problems, few-shot turns that answer directly

    python tools/experiments/tool_use.py probe                 # sampling only: tool-call rate and accuracy, both arms
    python tools/experiments/tool_use.py run --steps 10 --seeds 0 1
    -> results/tool_use/{probe.json, summary.md}; runs/tool_use/<arm>_seed<k>/ (metrics.jsonl, trajectories/)

Reported per arm: accuracy, the share of trajectories with a tool call, tool errors (steps 1..N of each run), mean
over seeds with the standard error across seeds. The model is tiny; the summary says plainly what separates.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
from pathlib import Path

from megatron_dapo.dev.experiments import main_job_command
from megatron_dapo.dev.hub import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "results" / "tool_use"
"""probe.json and summary.md (committed)."""
RUNS = ROOT / "runs" / "tool_use"
"""Each arm's data and run directories (not committed: checkpoints and the final weights)."""
ARMS = ("tool", "no_tool")
SHOTS = ((23, 417), (56, 208), (71, 934))
INSTRUCTION = "Compute the product. End with a line 'Answer: N'."
TOOL_INSTRUCTION = INSTRUCTION + " You may run Python in a ```python block; its output comes back to you."


def problem(rng: random.Random) -> tuple[int, int]:
    return rng.randint(11, 99), rng.randint(101, 999)


def messages(arm: str, a: int, b: int) -> list[dict[str, str]]:
    """The chat prompt of one problem: three solved examples (with the tool in the tool arm), then the question."""
    out: list[dict[str, str]] = []
    for x, y in SHOTS:
        if arm == "tool":
            out += [
                {"role": "user", "content": f"{TOOL_INSTRUCTION}\n{x} * {y} ="},
                {"role": "assistant", "content": f"```python\nprint({x} * {y})\n```"},
                {"role": "tool", "content": str(x * y)},
                {"role": "assistant", "content": f"{x} * {y} = {x * y}\nAnswer: {x * y}"},
            ]
        else:
            out += [
                {"role": "user", "content": f"{INSTRUCTION}\n{x} * {y} ="},
                {"role": "assistant", "content": f"{x} * {y} = {x * y}\nAnswer: {x * y}"},
            ]
    text = TOOL_INSTRUCTION if arm == "tool" else INSTRUCTION
    return [*out, {"role": "user", "content": f"{text}\n{a} * {b} ="}]


def write_data(arm: str, folder: Path, num_train: int = 400, num_test: int = 64, seed: int = 0) -> Path:
    """train.jsonl / test.jsonl in the project's prompt format (a message list and the ground truth)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", num_train), ("test", num_test)):
        rows = []
        for _ in range(count):
            a, b = problem(rng)
            rows.append({"data_source": "tool_use/products", "prompt": messages(arm, a, b),
                         "reward_model": {"ground_truth": str(a * b)}})  # fmt: skip
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def probe(samples: int = 4, prompts: int = 16) -> dict:
    """Sampling only, no training: per arm the share of responses with a tool call and the accuracy."""
    from transformers import AutoTokenizer

    from megatron_dapo.data.dataset import prompt_token_ids
    from megatron_dapo.envs.base import make_environment
    from megatron_dapo.reward import make_verifier
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout import TransformersEngine

    tok = AutoTokenizer.from_pretrained(default_cache_dir())
    engine = TransformersEngine(str(default_cache_dir()), max_running=16)
    verifier = make_verifier("answer_line")
    rng = random.Random(1)
    problems = [problem(rng) for _ in range(prompts)]
    out = {}
    for arm in ARMS:
        env = make_environment("python_tool" if arm == "tool" else "single_turn", tokenizer=tok, verifier=verifier)
        params = SamplingParams(n=samples, max_new_tokens=96, seed=3, stop_token_ids=(tok.eos_token_id,))
        ids = [prompt_token_ids(tok, messages(arm, a, b)) for a, b in problems]
        first = engine.generate(ids, params)
        calls = correct = 0
        for i, r in enumerate(first):
            a, b = problems[i // samples]
            episode = env.episode(str(a * b))
            turn = episode.step(r.response_ids)
            if not turn.done:  # a tool call: one more turn after the observation, as the stream would run it
                calls += 1
                context = ids[i // samples] + r.response_ids.tolist() + list(turn.observation_ids)
                again = engine.generate([context], SamplingParams(n=1, max_new_tokens=48, seed=i))[0]
                turn = episode.step(again.response_ids)
                if not turn.done:
                    turn = episode.finish("max_turns")
            correct += turn.reward > 0
        total = len(first)
        out[arm] = {"responses": total, "tool_call_rate": calls / total, "accuracy": correct / total}
        print(f"{arm}: {out[arm]}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "probe.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def arm_overrides(arm: str, data: Path) -> list[str]:
    """The main job's config with this arm's data and environment (later overrides win)."""
    return [
        f"--data.train_files={data / 'train.jsonl'}", f"--data.eval_files={data / 'test.jsonl'}",
        f"--reward.environment={'python_tool' if arm == 'tool' else 'single_turn'}",
        "--rollout.max_response_length=128", "--algorithm.overlong_buffer=32", "--trainer.eval_every=0",
        "--checkpoint.save_every=0", "--logging.trajectory_samples=8", "--logging.plots=false",
    ]  # fmt: skip


def run(steps: int, seeds: list[int]) -> None:
    """Train each arm for `steps` steps per seed (the main job's launcher: torchrun, 2 ranks) and summarise."""
    for arm in ARMS:
        data = write_data(arm, RUNS / "data" / arm)
        for seed in seeds:
            run_dir = RUNS / f"{arm}_seed{seed}"
            if (run_dir / "exit_code").exists():
                continue  # done already (delete the folder to rerun)
            cmd = main_job_command(run_dir, steps, seed, arm_overrides(arm, data))
            print(" ".join(cmd), flush=True)
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            # Exit 2 "nothing was trained" is an outcome here (an arm with no mixed group), not a failure.
            (run_dir / "exit_code").write_text(f"{proc.returncode}\n")
            if proc.returncode not in (0, 2):
                raise SystemExit(f"{run_dir}: train exited {proc.returncode}")
    summarise(seeds)


def _mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def summarise(seeds: list[int]) -> str:
    """summary.md: per arm, the mean over steps of each metric per seed, then mean +- SE over seeds."""
    keys = ("reward/acc", "train/responses", "episode/tool_calls", "episode/tool_errors", "episode/turns",
            "response/length_mean")  # fmt: skip
    lines = ["| arm | seeds | steps | exit codes | " + " | ".join(keys) + " |", "|---" * (len(keys) + 4) + "|"]
    for arm in ARMS:
        per_seed: dict[str, list[float]] = {k: [] for k in keys}
        steps, exits = 0, []
        for seed in seeds:
            path = RUNS / f"{arm}_seed{seed}" / "metrics.jsonl"
            if not path.exists():
                continue
            exits.append(
                (path.parent / "exit_code").read_text().strip() if (path.parent / "exit_code").exists() else "?"
            )
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            rows = [r for r in rows if r.get("step", 0) >= 1]
            steps = len(rows)
            for k in keys:
                vals = [r[k] for r in rows if r.get(k) is not None]
                if vals:
                    per_seed[k].append(sum(vals) / len(vals))
        cells = []
        for k in keys:
            if per_seed[k]:
                m, se = _mean_se(per_seed[k])
                cells.append(f"{m:.3f} +- {se:.3f}")
            else:
                cells.append("-")
        lines.append(f"| {arm} | {len(per_seed[keys[0]])} | {steps} | {' '.join(exits)} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.md").write_text(text)
    print(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    r = sub.add_parser("run")
    r.add_argument("--steps", type=int, default=10)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    s = sub.add_parser("summary")
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    if args.what == "probe":
        probe(args.samples, args.prompts)
    elif args.what == "run":
        run(args.steps, args.seeds)
    else:
        summarise(args.seeds)


if __name__ == "__main__":
    main()
