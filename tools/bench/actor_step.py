"""Actor time of one main-job step, padded rows vs today's packed defaults, interleaved in the same processes.

Example (CPU, gloo, PP=2, SmolLM2-135M, the main job's step shape):
    python tools/setup/prepare_smollm2.py
    python tools/bench/actor_step.py --reps 3 --json results/actor_step_smollm2_pp2.json

Arms (config overrides applied to one MegatronActor between passes, so both see the same load):
    padded: actor.packing=false, actor.logprob_impl=fused   (rows sorted by length, padded to the micro-batch's
            longest, full logits)
    packed_logits: actor.packing=true, actor.logprob_impl=fused (packing alone, full logits)
    packed: actor.packing=true,  actor.logprob_impl=fused_linear (today's defaults: packed THD, fused LM head)
Each rep runs, per arm in alternating order, compute_logprobs on the step's batch and update() (2 mini-batches of
32 responses, as in examples/smollm2_arith_cpu.yaml: 8 prompts x 8 samples, mini_batch_prompts 4, 8 rows per
micro-batch). The batch imitates the main job's rollouts: prompts of 140 +- 6 tokens (the few-shot template), responses
of 1..64 tokens drawn geometric with mean 17 (the measured response/length_mean of docs/results.md), random token ids.
Prints per-rep seconds and the medians; the ratio is padded / packed of (logprobs + update).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_dapo.dev.hub import default_cache_dir
from megatron_dapo.net import free_port

ARMS = {
    "padded": {"packing": False, "logprob_impl": "fused"},
    "packed_logits": {"packing": True, "logprob_impl": "fused"},
    "packed": {"packing": True, "logprob_impl": "fused_linear"},
}  # every arm runs with actor.shared_prefix=false (the batch's rows have distinct prompts; for sharing see
# tools/bench/profile_actor_step.py)


def main_job_batch(rows: int, vocab: int, seed: int = 0):
    """ActorBatch shaped like one main-job step (see the module docstring)."""
    from megatron_dapo.batch import ActorBatch

    gen = torch.Generator().manual_seed(seed)
    prompts = (140 + torch.randint(-6, 7, (rows,), generator=gen)).tolist()
    geo = torch.distributions.Geometric(probs=torch.tensor(1.0 / 17.0))
    torch.manual_seed(seed)
    responses = geo.sample((rows,)).long().add(1).clamp(max=64).tolist()
    width = max(p + r for p, r in zip(prompts, responses, strict=True))
    tokens = torch.randint(1, vocab, (rows, width), generator=gen)
    response = torch.zeros(rows, width)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        response[i, p : p + r] = 1.0
        tokens[i, p + r :] = 0
    advantages = torch.randn(rows, generator=gen)
    return ActorBatch(tokens=tokens, loss_mask=response.clone(), response_mask=response, advantages=advantages)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.checkpointing import allocate_adam_state
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.loss import get_logprob_impl
    from megatron_dapo.config import load_config

    groups = init_distributed(1, 2)
    cfg = load_config(args.config, [f"--actor.model_path={args.model}"])
    actor = MegatronActor(cfg, groups, hf_dir=args.model)
    batch = main_job_batch(cfg.trainer.prompts_per_step * cfg.algorithm.group_size, actor.vocab_size)
    allocate_adam_state(actor.optimizer)
    rows = []
    for rep in range(args.reps):
        for arm in sorted(ARMS, reverse=rep % 2 == 1):  # alternate the order: no arm always goes first
            actor.config.actor.packing = ARMS[arm]["packing"]
            actor.config.actor.shared_prefix = False
            actor.logprob_impl = get_logprob_impl(ARMS[arm]["logprob_impl"])
            actor.pop_token_stats()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            batch.old_logp, _ = actor.compute_logprobs(batch)
            t1 = time.perf_counter()
            actor.update(batch)
            t2 = time.perf_counter()
            tokens = actor.pop_token_stats()
            rows.append({"rep": rep, "arm": arm, "logprobs_s": t1 - t0, "update_s": t2 - t1, **tokens})
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_cache_dir()), help="HF checkpoint folder (prepare_smollm2.py)")
    parser.add_argument("--config", default="examples/smollm2_arith_cpu.yaml", help="the main job's config")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per arm")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (main job: 1)")
    parser.add_argument("--json", default=None, help="also write the rows and medians to this file")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # CPU dispatch, as the main job runs
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(2, free_port(), args, out_dir), nprocs=2, join=True)
        rows = json.loads(Path(out_dir, "rows.json").read_text())
    summary: dict = {"config": vars(args), "rows": rows, "median": {}}
    for row in rows:
        print(json.dumps(row), flush=True)
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        med = {k: statistics.median(r[k] for r in mine) for k in ("logprobs_s", "update_s", "pad_fraction")}
        med["actor_s"] = statistics.median(r["logprobs_s"] + r["update_s"] for r in mine)
        summary["median"][arm] = med
        print(f"{arm}: median logprobs {med['logprobs_s']:.1f} s, update {med['update_s']:.1f} s, "
              f"actor {med['actor_s']:.1f} s, pad_fraction {med['pad_fraction']:.3f}")  # fmt: skip
    med = summary["median"]
    summary["ratio_padded_over_packed"] = med["padded"]["actor_s"] / med["packed"]["actor_s"]
    print(f"padded / packed (logprobs + update): {summary['ratio_padded_over_packed']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
