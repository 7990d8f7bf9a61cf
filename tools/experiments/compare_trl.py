"""Issue 14 item 1: TRL's GRPOTrainer (loss_type "dapo") and our main job on the same CPU work, in one invocation.

    python tools/experiments/compare_trl.py run --steps 4 [--out runs/side_by_side] [--arms trl ours_no_ds ours]
    python tools/experiments/compare_trl.py report [--out runs/side_by_side]     (markdown table for docs/benchmarks.md)
    python tools/experiments/compare_trl.py run --steps 1 --out /tmp/smoke -- --trainer.prompts_per_step=2 ...
                                                                     (overrides after "--" go to every arm)

Arms, run back to back (each in its own process tree; its resident memory, the sum of PSS over the tree, is sampled
every 2 s):
    trl         trl.GRPOTrainer on SmolLM2-135M-Instruct, one process with 2 torch threads
    ours_no_ds  the main job (examples/smollm2_arith_cpu.yaml, torchrun 2 ranks, PP=2) with dynamic sampling off
    ours        the main job as shipped (dynamic sampling on: it may generate several batches per step)

What is the same in every arm (read from examples/smollm2_arith_cpu.yaml, so they cannot drift apart): the weights,
the train and held-out files, the chat template (TRL renders the same messages with the same tokenizer; checked),
G, prompts per step and the order they are visited in (TRL gets our PromptIterator's order with its shuffle off),
the response cap, temperature / top-p / top-k (top_k 0: no top-k filter), the reward (our verifier +1/-1 plus the
same soft overlong penalty, computed by the same functions), Adam (lr, betas, eps 1e-8, no weight decay, grad clip),
the warm-up (linear over the first optimizer steps, our schedule passed to TRL as a LambdaLR) and two optimizer
updates per step (mini_batch_prompts = half the prompts). Held-out accuracy of every arm is measured by the same
code, our trainer's evaluation (avg@k over the first eval_max_prompts prompts, the same seeds), on the arm's final
weights; TRL's initial weights are evaluated too, which must equal our step-0 evaluation.

What differs (TRL has no equivalent): dynamic sampling (hence the ours_no_ds arm); TRL's "dapo" normalizer is the
generation batch's token count divided by the number of accumulation windows, ours the exact token count of each
mini-batch; TRL's advantage uses std + 1e-4, ours std + 1e-6; TRL generates with transformers' generate (the prompt
prefilled once per sample), ours with the embedded engine (prefilled once per group); ours runs the actor as a
2-stage pipeline over gloo and syncs weights into the engine every step, TRL generates from the model it trains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev.experiments import finished
from megatron_dapo.dev.experiments import heldout
from megatron_dapo.dev.experiments import main_job_command
from megatron_dapo.dev.experiments import make_parser
from megatron_dapo.dev.experiments import mean
from megatron_dapo.dev.experiments import parse_with_overrides
from megatron_dapo.dev.experiments import print_report
from megatron_dapo.dev.experiments import read_metrics
from megatron_dapo.dev.experiments import train_rows

CONFIG = REPO_ROOT / "examples" / "smollm2_arith_cpu.yaml"
OURS: dict[str, tuple[str, ...]] = {
    "ours_no_ds": ("--algorithm.dynamic_sampling=false",),
    "ours": (),
}
ARMS = ("trl", *OURS)
TRL_VERSION = "1.16.0"


# ------------------------------------------------------------------------------------------------ peak RSS
def tree_rss(pid: int) -> tuple[int, int]:
    """(sum of PSS, max RSS) in bytes over a process and all its descendants ((0, 0) once it is gone).

    The sum uses the proportional set size (a page shared by k processes counts 1/k in each): a plain RSS sum
    counts a forked helper's copy-on-write pages once per process and read 18.4 GiB for our 2-rank job whose
    largest process held 3.4 GiB. Falls back to RSS where PSS is not available (non-Linux)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total, largest = 0, 0
    for p in procs:
        try:
            full = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += getattr(full, "pss", full.rss)
        largest = max(largest, full.rss)
    return total, largest


def run_sampled(cmd: list[str], env: dict[str, str] | None = None, period_s: float = 2.0) -> dict[str, float]:
    """Run cmd to completion, sampling its process tree's memory every period_s; returns rc, wall seconds, the peak
    of the tree's PSS sum ("peak_rss_gib": the job's resident memory) and the largest single process's peak RSS
    (GiB). Reading PSS (/proc/PID/smaps_rollup) costs CPU: every 0.5 s it took ~17% of one core beside a 2-core job,
    every 2 s about a quarter of that."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)
    peak_sum, peak_max = 0, 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_sum, peak_max
        while not done.is_set():
            total, largest = tree_rss(proc.pid)
            peak_sum, peak_max = max(peak_sum, total), max(peak_max, largest)
            done.wait(period_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    done.set()
    sampler.join()
    return {
        "rc": rc,
        "wall_s": time.perf_counter() - start,
        "peak_rss_gib": peak_sum / 2**30,
        "peak_rss_process_gib": peak_max / 2**30,
    }


# ------------------------------------------------------------------------------------------------ TRL arm
def _heldout(cfg, model, tokenizer, ranks: int = 2) -> dict[str, float]:
    """Our trainer's held-out evaluation (Trainer.evaluate), reproduced on one process for `model`: the first
    eval_max_prompts prompts split over `ranks` engine ranks as the trainer interleaves them, rank r sampling with
    seed trainer.seed + 7 + r, k = eval_samples, the engine's batch size 32."""
    from megatron_dapo.data import PromptDataset
    from megatron_dapo.data.dataset import prompt_token_ids
    from megatron_dapo.evaluate import score_groups
    from megatron_dapo.reward import Verifier
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.transformers_engine import TransformersEngine

    t = cfg.trainer
    examples = PromptDataset(cfg.data.eval_files, tokenizer=tokenizer, max_prompt_length=cfg.data.max_prompt_length)
    examples = examples.examples[: t.eval_max_prompts or None]
    engine = TransformersEngine(model, max_running=32)
    verifier = Verifier.from_config(cfg.reward)
    scored = []
    for r in range(ranks):
        mine = examples[r::ranks]
        params = SamplingParams(
            n=t.eval_samples,
            max_new_tokens=cfg.rollout.max_response_length,
            temperature=t.eval_temperature,
            top_p=t.eval_top_p,
            top_k=cfg.rollout.top_k,
            stop_token_ids=(tokenizer.eos_token_id,),
            seed=t.seed + 7 + r,
            return_logprobs=False,
        )
        comps = engine.generate([prompt_token_ids(tokenizer, ex.prompt_messages) for ex in mine], params)
        for i, ex in enumerate(mine):
            group = comps[i * t.eval_samples : (i + 1) * t.eval_samples]
            texts = tokenizer.batch_decode([c.response_ids for c in group], skip_special_tokens=True)
            scored.append([verifier(text, ex.ground_truth) for text in texts])
    return score_groups(scored, t.eval_samples)


def trl_arm(out: Path, steps: int, seed: int, threads: int, extra: list[str]) -> int:
    """TRL's GRPOTrainer on the main job's settings for `steps` of our steps (2 optimizer updates each); writes
    out/metrics.jsonl in our metric names (step 0: held-out evaluation of the initial weights)."""
    import torch

    torch.set_num_threads(threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer
    from transformers import TrainerCallback

    from megatron_dapo.algorithms import soft_overlong_penalty
    from megatron_dapo.config import load_config
    from megatron_dapo.data import PromptDataset
    from megatron_dapo.data import PromptIterator
    from megatron_dapo.data.dataset import prompt_token_ids
    from megatron_dapo.reward import Verifier

    if trl.__version__ != TRL_VERSION:
        print(f"compare_trl: trl {trl.__version__} installed, the comparison is pinned to {TRL_VERSION}", flush=True)
    cfg = load_config(CONFIG, [f"--trainer.seed={seed}", *extra])
    a, t, r = cfg.algorithm, cfg.trainer, cfg.rollout
    rows_per_step = t.prompts_per_step * a.group_size
    rows_per_update = t.mini_batch_prompts * a.group_size
    if rows_per_step % rows_per_update or rows_per_update % t.micro_batch_size:
        raise SystemExit("compare_trl: the config's mini/micro batch sizes do not divide the step's rows")
    updates_per_step = rows_per_step // rows_per_update
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    train = PromptDataset(cfg.data.train_files, tokenizer=tokenizer, max_prompt_length=cfg.data.max_prompt_length)
    order = PromptIterator(train.examples, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    visited = order.next_batch(steps * t.prompts_per_step)  # what ours visits without dynamic sampling
    dataset = Dataset.from_list([{"prompt": ex.prompt_messages, "ground_truth": ex.ground_truth} for ex in visited])
    verifier = Verifier.from_config(cfg.reward)
    model = AutoModelForCausalLM.from_pretrained(cfg.actor.model_path, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "metrics.jsonl").open("w")

    def write(row: dict) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"[trl] {json.dumps(row)}", flush=True)

    if t.eval_every:
        start = time.perf_counter()
        write({"step": 0, **_heldout(cfg, model, tokenizer), "time/eval": time.perf_counter() - start})

    state = {"generate": 0.0, "logprobs": 0.0, "tokens": 0, "acc": [], "reward": []}

    def reward(completions, completion_ids, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [verifier(text, truth) for text, truth in zip(texts, ground_truth, strict=True)]
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.int64)
        penalty = torch.zeros(len(texts))
        if a.overlong_penalty:
            penalty = soft_overlong_penalty(
                lengths,
                max_response_length=r.max_response_length,
                overlong_buffer=a.overlong_buffer,
                penalty_factor=a.overlong_penalty_factor,
            )
        state["tokens"] += int(lengths.sum())
        state["acc"].extend(float(s["acc"]) for s in scores)
        values = [s["score"] + float(p) for s, p in zip(scores, penalty, strict=True)]
        state["reward"].extend(values)
        return values

    reward.__name__ = "dapo_answer_line"

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                state["generate"] += time.perf_counter() - start

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            start = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                state["logprobs"] += time.perf_counter() - start

    class StepLog(TrainerCallback):
        """Every `updates_per_step` optimizer steps is one of our steps: log its time split and reward."""

        def __init__(self) -> None:
            self.start = time.perf_counter()
            self.losses: list[dict] = []
            self.lrs: list[float] = []

        def on_step_begin(self, args, state_, control, **kwargs):
            self.lrs.append(optimizer.param_groups[0]["lr"])  # the rate this optimizer step uses

        def on_log(self, args, state_, control, logs=None, **kwargs):
            if logs:
                self.losses.append(dict(logs))

        def on_step_end(self, args, state_, control, **kwargs):
            if state_.global_step % updates_per_step:
                return
            now = time.perf_counter()
            step_s = now - self.start
            gen, lp = state["generate"], state["logprobs"]
            row = {
                "step": state_.global_step // updates_per_step,
                "time/step": step_s,
                "time/generate": gen,
                "time/logprobs": lp,
                "time/update": step_s - gen - lp,
                "perf/gen_tokens_per_s": state["tokens"] / max(gen, 1e-9),
                "response/length_mean": state["tokens"] / max(len(state["acc"]), 1),
                "reward/acc": mean(state["acc"]),
                "reward/mean": mean(state["reward"]),
                "actor/lr": mean(self.lrs),
            }
            for logged in self.losses[-updates_per_step:]:
                for key in ("clip_ratio/high_mean", "clip_ratio/low_mean", "entropy", "grad_norm"):
                    if key in logged:
                        row.setdefault(f"trl/{key}", []).append(float(logged[key]))
            row = {k: (mean(v) if isinstance(v, list) else v) for k, v in row.items()}
            write(row)
            state.update(generate=0.0, logprobs=0.0, tokens=0, acc=[], reward=[])
            self.lrs = []
            self.start = time.perf_counter()

    act = cfg.actor
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=act.lr, betas=(act.adam_beta1, act.adam_beta2), eps=1e-8, weight_decay=act.weight_decay
    )
    warmup = act.lr_warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: 1.0 if warmup <= 0 or k >= warmup else (k + 1) / warmup
    )  # our ActorOptimizer.lr_at: update k < W uses lr * (k + 1) / W
    args = trl.GRPOConfig(
        output_dir=str(out / "trl_output"),
        use_cpu=True,
        seed=t.seed,
        data_seed=t.seed,
        shuffle_dataset=False,
        num_generations=a.group_size,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=rows_per_update // t.micro_batch_size,
        steps_per_generation=rows_per_step // t.micro_batch_size,
        num_iterations=1,
        max_steps=steps * updates_per_step,
        max_completion_length=r.max_response_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        loss_type="dapo",
        epsilon=cfg.loss.eps_low,  # the main job's policy loss, dapo (DAPOConfig: the `loss` section)
        epsilon_high=cfg.loss.effective_eps_high,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=a.overlong_filtering,
        learning_rate=act.lr,
        max_grad_norm=act.grad_clip,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        log_completions=False,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepLog()],
        optimizers=(optimizer, schedule),
    )
    ours = prompt_token_ids(tokenizer, visited[0].prompt_messages)
    theirs = trainer._tokenize_prompts([visited[0].prompt_messages])[0][0]
    if list(theirs) != list(ours):
        raise SystemExit("compare_trl: TRL renders the prompt to other token ids than our template does")
    trainer.train()
    if t.eval_every:
        start = time.perf_counter()
        write({"step": steps, **_heldout(cfg, trainer.model, tokenizer), "time/eval": time.perf_counter() - start})
    log.close()
    return 0


# ------------------------------------------------------------------------------------------------ driver
def run(args: argparse.Namespace) -> int:
    summary_path = args.out / "runs.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for arm in args.arms:
        run_dir = args.out / arm
        if arm == "trl":
            cmd = [sys.executable, __file__, "_trl", "--out", str(run_dir), "--steps", str(args.steps)]
            cmd += ["--seed", str(args.seed), "--threads", str(args.threads), "--", *args.extra]
            # Passive OpenMP waiting: with libgomp's default spinning, a 2-thread process on this shared 2-core
            # machine ran a [64, 576] x [576, 1536] matmul 8x slower than with PASSIVE (21.7 vs 2.6 ms, measured
            # at load average 8); our ranks run 1 thread each and are not exposed to it.
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
        else:
            cmd = main_job_command(run_dir, args.steps, args.seed, [*OURS[arm], *args.extra])
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.dry_run:
            print(" ".join(cmd))
            continue
        if arm in summary and finished(run_dir, args.steps):
            print(f"[{arm}] already measured with step {args.steps}: skipped", flush=True)
            continue
        print(f"[{arm}] {' '.join(cmd)}", flush=True)
        load_before = os.getloadavg()[0]
        result = run_sampled(cmd, env=env)
        result["load_avg_1m"] = [load_before, os.getloadavg()[0]]
        summary[arm] = result
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=1))
        if result["rc"] != 0:
            print(f"[{arm}] exited {result['rc']}; stopping", file=sys.stderr)
            return int(result["rc"])
    return 0


def summarize(out: Path) -> list[dict]:
    summary_path = out / "runs.json"
    runs = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    table = []
    for arm in ARMS:
        rows = read_metrics(out / arm)
        train = train_rows(rows)
        if not train:
            continue

        def median(key_: str, train_: list[dict] = train) -> float:
            values = [r[key_] for r in train_ if key_ in r]
            return statistics.median(values) if values else float("nan")

        table.append(
            {
                "arm": arm,
                "steps": len(train),
                "step_s": median("time/step"),
                "generate_s": median("time/generate"),
                "logprobs_s": median("time/logprobs"),
                "update_s": median("time/update"),
                "sync_s": median("time/weight_sync"),
                "gen_tok_s": median("perf/gen_tokens_per_s"),
                "peak_rss_gib": runs.get(arm, {}).get("peak_rss_gib", float("nan")),
                "train_acc": mean(r.get("reward/acc") for r in train),
                **heldout(rows),
            }
        )
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| arm | steps | s/step (median) | generate | log-probs | update | weight sync | gen tok/s | peak memory GiB | "
        "train acc | held-out step 0 -> N |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['arm']} | {t['steps']} | {t['step_s']:.0f} | {t['generate_s']:.0f} | {t['logprobs_s']:.0f} | "
            f"{t['update_s']:.0f} | {t['sync_s']:.1f} | {t['gen_tok_s']:.0f} | {t['peak_rss_gib']:.2f} | "
            f"{t['train_acc']:.3f} | {t['heldout_key'] or '-'} {t['heldout_0']:.3f} -> {t['heldout_n']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser, sub = make_parser(__doc__, ARMS, steps=4, out=REPO_ROOT / "runs" / "side_by_side", img=False)
    run_parser = sub.choices["run"]
    run_parser.add_argument("--threads", type=int, default=2, help="torch threads of the TRL process (ours: 2 x 1)")
    q = sub.add_parser("_trl", help="(internal) the TRL arm, run by 'run' in its own process")
    q.add_argument("--steps", type=int, required=True)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "side_by_side")
    args = parse_with_overrides(parser, argv)
    if args.command == "_trl":
        return trl_arm(args.out, args.steps, args.seed, args.threads, args.extra)
    if args.command == "run":
        return run(args)
    table = summarize(args.out)
    return print_report(args.out, table, markdown(table) if table else "")


if __name__ == "__main__":
    sys.exit(main())
