"""Peak RSS of MegatronActor.compute_logprobs and update: full logits vs the fused LM head (actor.logprob_impl).

Example (CPU, gloo, PP=2, SmolLM2-135M, 8 x 1024 tokens):
    python tools/setup/prepare_smollm2.py                       # once: GGUF -> safetensors cache
    python tools/bench/actor_memory.py --model ~/.cache/megatron_dapo/smollm2-135m-instruct \
        --impls fused fused_linear --rows 8 --seq 1024 --pp 2 --micro-batch-size 2

Each impl runs in fresh gloo processes (one per pipeline stage, so peaks never mix): build the actor from the HF
checkpoint, then for each of (a) compute_logprobs on the batch and (b) one update() (one mini-batch of --rows
responses, one optimizer step; Adam's moments are allocated before it, as in every step after the first) reset the
kernel's peak-RSS counter (/proc/self/clear_refs "5", Linux) and read VmHWM afterwards. The batch is --rows
random-token sequences of --seq tokens: a --prompt-len prompt, the rest is response (loss mask 1). Ops run their CPU
dispatch (chunked torch references; TRITON_INTERPRET is cleared). Prints one JSON line per (impl, rank) and a
summary with the ratio fused_linear / full logits per phase on the last stage.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_dapo.dev.hub import default_cache_dir
from megatron_dapo.net import free_port


def _rss_mb(field: str) -> float:
    """VmRSS / VmHWM of this process in MiB (from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _batch(rows: int, seq: int, prompt_len: int, vocab: int, seed: int = 0):
    from megatron_dapo.batch import ActorBatch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=gen)
    response = torch.zeros(rows, seq)
    response[:, prompt_len:] = 1.0
    advantages = torch.randn(rows, generator=gen)
    return ActorBatch(tokens=tokens, loss_mask=response.clone(), response_mask=response, advantages=advantages)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, impl: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.checkpointing import allocate_adam_state
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.config import ActorConfig
    from megatron_dapo.config import AlgorithmConfig
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.config import RunConfig
    from megatron_dapo.config import TrainerConfig

    groups = init_distributed(1, args.pp)
    cfg = RunConfig(
        actor=ActorConfig(
            model_path=args.model,
            pipeline_parallel=args.pp,
            dtype="fp32",
            lr=1e-6,
            lr_warmup_steps=0,
            logprob_impl=impl,
            use_distributed_optimizer=False,
        ),
        trainer=TrainerConfig(
            prompts_per_step=1, gen_prompts_per_batch=1, mini_batch_prompts=1, micro_batch_size=args.micro_batch_size
        ),
        algorithm=AlgorithmConfig(group_size=args.rows, overlong_buffer=4),
        rollout=RolloutConfig(engine="transformers", max_response_length=args.seq, temperature=1.0),
    )
    actor = MegatronActor(cfg, groups, hf_dir=args.model)
    batch = _batch(args.rows, args.seq, args.prompt_len, actor.vocab_size)
    res = {"impl": impl, "rank": rank, "last_stage": groups.is_last_stage, "rss_after_build_mb": _rss_mb("VmRSS")}
    torch.distributed.barrier()
    _reset_peak()
    start = time.perf_counter()
    logp, _ = actor.compute_logprobs(batch)
    res["logprobs_s"] = time.perf_counter() - start
    res["logprobs_peak_mb"] = _rss_mb("VmHWM")
    batch.old_logp = logp
    allocate_adam_state(actor.optimizer)  # Adam's moments exist before the measured step, as after the first
    torch.distributed.barrier()
    _reset_peak()
    before = _rss_mb("VmRSS")
    start = time.perf_counter()
    metrics = actor.update(batch)
    res["update_s"] = time.perf_counter() - start
    res["update_peak_mb"] = _rss_mb("VmHWM")
    res["update_rss_before_mb"] = before
    res["loss"] = metrics["actor/loss"]
    res["grad_norm"] = metrics["actor/grad_norm"]
    Path(out_dir, f"{impl}_rank{rank}.json").write_text(json.dumps(res))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_cache_dir()), help="HF checkpoint folder (prepare_smollm2.py)")
    parser.add_argument("--impls", nargs="+", default=["fused", "fused_linear"], help="actor.logprob_impl values")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (one process each)")
    parser.add_argument("--rows", type=int, default=8, help="responses in the mini-batch")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per row (prompt + response)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per row (not trained)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # CPU dispatch: chunked torch references, not the interpreter
    results = []
    with tempfile.TemporaryDirectory() as out_dir:
        for impl in args.impls:
            mp.spawn(_worker, args=(args.pp, free_port(), args, impl, out_dir), nprocs=args.pp, join=True)
            for rank in range(args.pp):
                res = json.loads(Path(out_dir, f"{impl}_rank{rank}.json").read_text())
                print(json.dumps(res), flush=True)
                results.append(res)
    last = {r["impl"]: r for r in results if r["last_stage"]}
    summary = {"config": vars(args), "results": results}
    if "fused_linear" in last:
        for base in (i for i in last if i != "fused_linear"):
            for phase in ("logprobs_peak_mb", "update_peak_mb"):
                ratio = last["fused_linear"][phase] / last[base][phase]
                summary[f"ratio_{phase}_fused_linear_over_{base}"] = ratio
                print(f"last stage {phase}: fused_linear {last['fused_linear'][phase]:.0f} MiB / {base} "
                      f"{last[base][phase]:.0f} MiB = {ratio:.3f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
