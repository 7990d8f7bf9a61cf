"""Where the actor's time goes in one main-job mini-batch on CPU, with actor.shared_prefix off and on (torch.profiler).

Example (one process, PP=1, fp32, 1 thread as each rank of the main job; SmolLM2-135M from prepare_smollm2.py):
    python tools/bench/profile_actor_step.py --json results/profile_actor_step.json

The batch imitates one mini-batch of examples/smollm2_arith_cpu.yaml: --groups prompt groups (default 4 =
mini_batch_prompts) of 8 responses; each group shares a prompt of 140 +- 6 random tokens (the few-shot template's
length), responses are 1..64 tokens drawn geometric with mean 17 (response/length_mean of docs/results.md). Per arm
(config toggled on one actor, off first), compute_logprobs then update() (one optimizer step) run under
torch.profiler; each profiled op's self CPU time is put in a class by its name and by its enclosing ranges:

    lm_head     the fused LM-head log-prob/entropy op (forward range and its autograd backward)
    optimizer   MegatronActor._optimizer_step (grad norm, clip, Adam)
    attention   scaled-dot-product attention (forward and backward kernels, masks)
    linear      the remaining matmuls: QKV, O, MLP projections (forward and backward)
    embedding   the embedding lookup and its backward (scatter into the tied weight)
    other       norms, RoPE, SiLU, residual adds, copies, the loss, the schedule

Prints per arm the wall seconds of each pass, the token accounting (rows' prompt / response tokens, tokens computed)
and the class shares, then the largest log-prob difference off vs on next to the rounding floor (off vs off with
half the rows per micro-batch); --json writes them. The profiler adds overhead (small on these op sizes); compare
shares and the off/on ratio, not absolute seconds, when the machine is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile
from torch.profiler import record_function

from megatron_dapo.dev.hub import default_cache_dir

CLASSES = ("lm_head", "optimizer", "attention", "linear", "embedding", "other")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")


def group_batch(groups: int, group_size: int, vocab: int, seed: int = 0):
    """ActorBatch of `groups` prompt groups x `group_size` rows (see the module docstring)."""
    from megatron_dapo.batch import ActorBatch

    gen = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    prompt_lens = (140 + torch.randint(-6, 7, (groups,), generator=gen)).tolist()
    prompts = [torch.randint(1, vocab, (p,), generator=gen) for p in prompt_lens]
    torch.manual_seed(seed)
    responses = torch.distributions.Geometric(probs=torch.tensor(1.0 / 17.0)).sample((rows,)).long() + 1
    responses = responses.clamp(max=64).tolist()
    width = max(prompt_lens) + max(responses)
    tokens = torch.zeros(rows, width, dtype=torch.int64)
    mask = torch.zeros(rows, width)
    for i, r in enumerate(responses):
        p = prompt_lens[i // group_size]
        tokens[i, :p] = prompts[i // group_size]
        tokens[i, p : p + r] = torch.randint(1, vocab, (r,), generator=gen)
        mask[i, p : p + r] = 1.0
    advantages = torch.randn(rows, generator=gen)
    group_ids = torch.arange(rows) // group_size
    return ActorBatch(
        tokens=tokens,
        loss_mask=mask.clone(),
        response_mask=mask,
        advantages=advantages,
        group_ids=group_ids,
        prompt_lengths=torch.tensor(prompt_lens)[group_ids],
    )


def _classify(event) -> str:
    """The class of an op from its enclosing ranges (the profiler's cpu_parent chain), then from its name."""
    if event.name in ("lm_head", "optimizer"):
        return event.name
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if name == "lm_head" or "LinearLogProbEntropy" in name:
            return "lm_head"
        if name == "optimizer":
            return "optimizer"
        if "scaled_dot_product" in name or "ScaledDotProduct" in name:
            return "attention"
        if "Embedding" in name or name == "aten::embedding":
            return "embedding"
        parent = parent.cpu_parent
    name = event.name
    if "scaled_dot_product" in name:
        return "attention"
    if name in _MATMUL:
        return "linear"
    if "embedding" in name:
        return "embedding"
    return "other"


def _shares(prof) -> dict[str, float]:
    """Self CPU seconds per class over every profiled event (self times add up to the profiled total; a range's
    or autograd node's own self time is its Python / dispatch overhead)."""
    out: dict[str, float] = defaultdict(float)
    for event in prof.events():
        out[_classify(event)] += event.self_cpu_time_total / 1e6
    return {k: out.get(k, 0.0) for k in CLASSES}


def _arm(actor, batch, shared: bool) -> dict:
    from megatron_dapo.actor.packing import prompt_lengths
    from megatron_dapo.actor.packing import sequence_lengths

    actor.config.actor.shared_prefix = shared
    actor.pop_token_stats()
    batch.old_logp = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        with record_function("logprobs"):
            logp, _ = actor.compute_logprobs(batch)
        t1 = time.perf_counter()
        batch.old_logp = logp
        with record_function("update"):
            stats = actor.update(batch)
        t2 = time.perf_counter()
    lengths = sequence_lengths(batch.response_mask)
    prompts = torch.tensor(prompt_lengths(batch.response_mask, lengths))
    tokens = actor.pop_token_stats()
    seconds = _shares(prof)
    total = sum(seconds.values())
    return {
        "shared_prefix": shared,
        "logprobs_s": t1 - t0,
        "update_s": t2 - t1,
        "prompt_tokens": int(prompts.sum()),
        "response_tokens": int((lengths - prompts).sum()),
        "computed_tokens_per_pass": tokens["computed_tokens"] / 2,
        "pad_fraction": tokens["pad_fraction"],
        "shared_fraction": tokens["shared_fraction"],
        "op_seconds": seconds,
        "op_share": {k: v / max(total, 1e-9) for k, v in seconds.items()},
        "loss": stats["actor/loss"],
        "logp": logp,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_cache_dir()), help="HF checkpoint folder (prepare_smollm2.py)")
    parser.add_argument("--config", default="examples/smollm2_arith_cpu.yaml", help="the main job's config")
    parser.add_argument("--groups", type=int, default=4, help="prompt groups (rows = groups x group_size)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (main job: 1 per rank)")
    parser.add_argument("--arms", default="off,on", help="shared_prefix arms, in order")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # CPU dispatch, as the main job runs
    torch.set_num_threads(args.threads)
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.checkpointing import allocate_adam_state
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.config import load_config

    groups = init_distributed(1, 1)
    overrides = [f"--actor.model_path={args.model}", "--actor.pipeline_parallel=1"]
    overrides.append(f"--trainer.mini_batch_prompts={args.groups}")
    cfg = load_config(args.config, overrides)
    actor = MegatronActor(cfg, groups, hf_dir=args.model)
    impl = actor.logprob_impl

    def lm_head(*a: object, **kw: object) -> object:
        with record_function("lm_head"):
            return impl.fn(*a, **kw)

    actor.logprob_impl = dataclasses.replace(impl, fn=lm_head)
    step = actor._optimizer_step

    def optimizer_step() -> tuple[bool, float]:
        with record_function("optimizer"):
            return step()

    actor._optimizer_step = optimizer_step
    allocate_adam_state(actor.optimizer)
    batch = group_batch(args.groups, cfg.algorithm.group_size, actor.vocab_size)
    state = {k: v.clone() for k, v in actor.unwrapped().state_dict().items() if torch.is_tensor(v)}
    results = []
    for arm in args.arms.split(","):
        actor.unwrapped().load_state_dict(state, strict=False)  # both arms start from the same weights
        res = _arm(actor, batch, arm == "on")
        results.append(res)
        shares = " ".join(f"{k} {v:.0%}" for k, v in res["op_share"].items())
        print(
            f"shared_prefix={arm}: logprobs {res['logprobs_s']:.1f} s, update {res['update_s']:.1f} s; tokens: prompt "
            f"{res['prompt_tokens']}, response {res['response_tokens']}, computed/pass "
            f"{res['computed_tokens_per_pass']:.0f}; self time {sum(res['op_seconds'].values()):.1f} s: {shares}",
            flush=True,
        )
    if len(results) == 2:
        # The rounding floor for that difference: the same unshared pass with other micro-batches (other matmul
        # shapes and attention blocks), from the same weights.
        actor.unwrapped().load_state_dict(state, strict=False)
        actor.config.actor.shared_prefix = False
        actor.config.trainer.micro_batch_size = max(1, cfg.trainer.micro_batch_size // 2)
        floor, _ = actor.compute_logprobs(batch, with_entropy=False)
        diff = float((results[0]["logp"] - results[1]["logp"]).abs().max())
        noise = float((results[0]["logp"] - floor).abs().max())
        print(f"max |logp off - on| = {diff:.2e}; off vs off with half the rows per micro-batch: {noise:.2e}")
        results[0]["max_logp_diff_on"] = diff
        results[0]["max_logp_diff_half_micro_batch"] = noise
    for res in results:
        res.pop("logp")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "arms": results}, indent=1))


if __name__ == "__main__":
    main()
