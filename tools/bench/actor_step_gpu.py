"""The actor step on one GPU: seconds, tokens/s, MFU and peak memory of the log-prob pass and of one update, per
actor.logprob_impl, next to Hugging Face transformers' forward + backward of the same rows (issue 36 item 3).

    python tools/bench/actor_step_gpu.py --models qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b-l4 --out results/actor_step_gpu
    python tools/bench/actor_step_gpu.py --device cpu --models tiny --rows 8 --max-response 32    (smoke test)

What runs:
- Models: random-initialised Qwen2 shapes (MODELS below; a config.json is all the actor reads, no weights), bf16 on
  a GPU (fp32 on CPU), one rank (TP = PP = 1). Transformer Engine's layer spec when it imports, the local spec
  otherwise (actor.allow_local_spec_on_gpu; packed rows then run torch SDPA per sequence): each result says which.
- Rows: a DAPO-like length mix, `--rows` responses of `--prompts` groups; prompts of 200-300 tokens; a quarter of
  the responses at the cap (`--max-response`, DAPO's overlong share early in training), the rest uniform between
  5% and 100% of it. Packed THD micro-batches under actor.max_tokens_per_microbatch (`--token-budget`).
- Per impl (`--impls`: fused_linear, fused, reference): a warm-up log-prob pass and update, then `--reps` timed
  ones. Log-probs: compute_logprobs (forward only). Update: one optimizer step over all rows (one mini-batch).
- HF: transformers' Qwen2ForCausalLM of the same config (sdpa attention), the same rows padded per micro-batch
  (rows sorted by length, binned under the same token budget counted with padding), logits -> log_softmax ->
  token-level loss, backward, AdamW step: the path a user without this actor would run.
- FLOPs (model FLOPs, recomputation not counted): forward = 2 x (linear weights + LM head) per token + causal
  attention 4 x L x (heads x head_dim) x sum over sequences of s(s+1)/2; update = 3 x forward. MFU against the
  GPU's dense bf16 peak (`--peak-tflops`, default 989: H100/H200 SXM spec) and against a bf16 GEMM measured in the
  same run.
Output: `<out>.json` (every rep) and `<out>.md` (a table of medians). Rows of one run only; quote ratios within it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

# Qwen2 shapes (from the models' config.json): hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings.
MODELS = {
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv=2, ffn=4864, vocab=151936, tied=True),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv=2, ffn=8960, vocab=151936, tied=True),
    "qwen2.5-7b-l4": dict(hidden=3584, layers=4, heads=28, kv=4, ffn=18944, vocab=152064, tied=False),  # 28 -> 4
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, ffn=96, vocab=512, tied=False),  # CPU smoke test
}
IMPLS = ("fused_linear", "fused", "reference")


@dataclasses.dataclass
class Rows:
    """The benchmark's batch: tokens [B, S] right-padded, response mask [B, S], prompt and response lengths."""

    tokens: torch.Tensor
    response: torch.Tensor
    prompts: list[int]
    responses: list[int]


def make_rows(rows: int, group: int, max_response: int, vocab: int, seed: int = 0) -> Rows:
    """A DAPO-like length mix (module docstring); token ids uniform in [1, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(-(-rows // group)):
        prompts += [int(torch.randint(200, 301, (1,), generator=gen))] * group
    prompts = prompts[:rows]
    capped = torch.rand(rows, generator=gen) < 0.25
    frac = 0.05 + 0.95 * torch.rand(rows, generator=gen)
    responses = [max_response if c else max(1, int(f * max_response)) for c, f in zip(capped.tolist(), frac.tolist())]
    width = max(p + r for p, r in zip(prompts, responses))
    tokens = torch.randint(1, vocab, (rows, width), generator=gen)
    response = torch.zeros(rows, width)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        response[i, p : p + r] = 1.0
        tokens[i, p + r :] = 0
    return Rows(tokens=tokens, response=response, prompts=prompts, responses=responses)


def model_flops(shape: dict, rows: Rows) -> float:
    """Forward model FLOPs of the rows (module docstring): linear layers + LM head + causal attention."""
    h, layers, heads, kv, ffn, vocab = (shape[k] for k in ("hidden", "layers", "heads", "kv", "ffn", "vocab"))
    head_dim = h // heads
    per_layer = h * (heads + 2 * kv) * head_dim + heads * head_dim * h + 3 * h * ffn
    tokens = sum(p + r for p, r in zip(rows.prompts, rows.responses))
    linear = 2 * tokens * (layers * per_layer + h * vocab)
    attention = (
        4 * layers * heads * head_dim * sum((p + r) * (p + r + 1) / 2 for p, r in zip(rows.prompts, rows.responses))
    )
    return float(linear + attention)


def write_hf_config(shape: dict, path: Path) -> Path:
    """config.json of a Qwen2ForCausalLM with this shape (the actor reads only the config)."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=shape["tied"],
    )  # fmt: skip
    cfg.save_pretrained(path)
    return path


def run_config(model_dir: Path, impl: str, rows: int, token_budget: int, device: str):
    from megatron_dapo.algorithms.losses.dapo import DAPOConfig
    from megatron_dapo.config import ActorConfig
    from megatron_dapo.config import AlgorithmConfig
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.config import RunConfig
    from megatron_dapo.config import TrainerConfig

    actor = ActorConfig(
        model_path=str(model_dir), dtype="bf16" if device == "cuda" else "fp32", logprob_impl=impl, packing=True,
        max_tokens_per_microbatch=token_budget, allow_local_spec_on_gpu=True, use_distributed_optimizer=False,
        lr=1e-6, lr_warmup_steps=0, grad_clip=1.0,
    )  # fmt: skip
    return RunConfig(
        actor=actor,
        trainer=TrainerConfig(prompts_per_step=1, gen_prompts_per_batch=1, mini_batch_prompts=1, micro_batch_size=1),
        algorithm=AlgorithmConfig(group_size=rows),
        loss=DAPOConfig(),
        rollout=RolloutConfig(engine="transformers", temperature=1.0),
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def bench_actor(model: str, impl: str, rows: Rows, args, model_dir: Path) -> list[dict]:
    """Warm-up + `args.reps` timed log-prob passes and updates of MegatronActor; one dict per rep."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.model import use_transformer_engine
    from megatron_dapo.batch import ActorBatch

    groups = init_distributed(1, 1)
    cfg = run_config(model_dir, impl, len(rows.prompts), args.token_budget, args.device)
    spec = "transformer_engine" if use_transformer_engine(cfg.actor, on_cpu=args.device == "cpu") else "local"
    actor = MegatronActor(cfg, groups)
    gen = torch.Generator().manual_seed(1)
    batch = ActorBatch(
        tokens=rows.tokens, loss_mask=rows.response.clone(), response_mask=rows.response,
        advantages=torch.randn(len(rows.prompts), generator=gen),
    )  # fmt: skip
    out = []
    for rep in range(args.reps + 1):
        _peak_reset(args.device)
        t0 = time.perf_counter()
        logp, _ = actor.compute_logprobs(batch)
        _sync(args.device)
        t1 = time.perf_counter()
        mem_logp = _peak_gib(args.device)
        logp_tokens = actor.pop_token_stats()
        batch.old_logp = logp + 0.01 * torch.randn(logp.shape, generator=gen) * batch.response_mask
        _peak_reset(args.device)
        t2 = time.perf_counter()
        metrics = actor.update(batch)
        _sync(args.device)
        t3 = time.perf_counter()
        tokens = actor.pop_token_stats()
        assert tokens["real_tokens"] == logp_tokens["real_tokens"], (tokens, logp_tokens)
        out.append({
            "model": model, "impl": impl, "spec": spec, "rep": rep, "warmup": rep == 0,
            "logprobs_s": t1 - t0, "update_s": t3 - t2, "logprobs_peak_gib": mem_logp,
            "update_peak_gib": _peak_gib(args.device), "computed_tokens": tokens["computed_tokens"],
            "real_tokens": tokens["real_tokens"], "loss": metrics["actor/loss"],
        })  # fmt: skip
    del actor
    return out


def bench_hf(model: str, rows: Rows, args, model_dir: Path) -> list[dict]:
    """transformers forward + backward (+ AdamW step) of the same rows, padded micro-batches under the budget."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    hf = hf.to(args.device)
    hf.config.use_cache = False
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)
    lengths = [p + r for p, r in zip(rows.prompts, rows.responses)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    micro, cur = [], []
    for i in order:  # rows x longest <= budget (a row longer than the budget is alone)
        if cur and (len(cur) + 1) * lengths[cur[0]] > args.token_budget:
            micro.append(cur)
            cur = []
        cur.append(i)
    micro.append(cur)
    adv = torch.randn(len(lengths), generator=torch.Generator().manual_seed(1)).to(args.device)
    total = float(rows.response.sum())
    out = []
    for rep in range(args.reps + 1):
        _peak_reset(args.device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for idx in micro:
            width = max(lengths[i] for i in idx)
            tokens = rows.tokens[idx, :width].to(args.device)
            mask = rows.response[idx, :width].to(args.device)
            attn = (torch.arange(width)[None, :] < torch.tensor([lengths[i] for i in idx])[:, None]).to(args.device)
            logits = hf(input_ids=tokens, attention_mask=attn.long()).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
            loss = -(logp * mask[:, 1:] * adv[idx, None]).sum() / total
            loss.backward()
            del logits, logp
        opt.step()
        _sync(args.device)
        t1 = time.perf_counter()
        out.append({
            "model": model, "impl": "hf_transformers", "spec": f"transformers {hf.config._attn_implementation}",
            "rep": rep, "warmup": rep == 0, "logprobs_s": None, "update_s": t1 - t0, "logprobs_peak_gib": None,
            "update_peak_gib": _peak_gib(args.device), "computed_tokens": float(sum(len(i) * max(lengths[j] for j in i)
            for i in micro)), "real_tokens": float(sum(lengths)), "loss": float(loss.detach()),
        })  # fmt: skip
    del hf, opt
    return out


def measured_gemm_tflops(device: str) -> float | None:
    """Dense bf16 GEMM throughput of this GPU (8192^3, median of 20), the MFU's second denominator."""
    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(23):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * 8192**3 / statistics.median(times[3:]) / 1e12


def summarise(reps: list[dict], flops: dict[str, float], peak_tflops: float, gemm_tflops: float | None) -> list[dict]:
    """Medians over the timed reps per (model, impl): seconds, tokens/s, MFU (spec and measured peak), memory."""
    out = []
    for key in dict.fromkeys((r["model"], r["impl"]) for r in reps):
        mine = [r for r in reps if (r["model"], r["impl"]) == key and not r["warmup"]]
        row = {"model": key[0], "impl": key[1], "spec": mine[0]["spec"], "reps": len(mine)}
        for phase, mult in (("logprobs", 1), ("update", 3)):
            times = [r[f"{phase}_s"] for r in mine if r[f"{phase}_s"] is not None]
            if not times:
                continue
            sec = statistics.median(times)
            row[f"{phase}_s"] = sec
            row[f"{phase}_tokens_per_s"] = mine[0]["real_tokens"] / sec
            row[f"{phase}_mfu"] = mult * flops[key[0]] / sec / (peak_tflops * 1e12)
            if gemm_tflops:
                row[f"{phase}_mfu_measured_peak"] = mult * flops[key[0]] / sec / (gemm_tflops * 1e12)
            peaks = [r[f"{phase}_peak_gib"] for r in mine if r[f"{phase}_peak_gib"] is not None]
            row[f"{phase}_peak_gib"] = max(peaks) if peaks else None
        row["pad_fraction"] = 1 - mine[0]["real_tokens"] / mine[0]["computed_tokens"]
        out.append(row)
    return out


def markdown(summary: list[dict], meta: dict) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        f"Actor step on {meta['device_name']} ({meta['timestamp']}; torch {meta['torch']}, megatron-core "
        f"{meta['megatron_core']}; {meta['rows']} rows, max response {meta['max_response']}, token budget "
        f"{meta['token_budget']}; measured bf16 GEMM {f(meta['gemm_tflops'], '.0f')} TFLOP/s, MFU against "
        f"{meta['peak_tflops']:.0f}).",
        "",
        "| model | impl | layer spec | log-probs s | tok/s | MFU | peak GiB | update s | tok/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['spec']} | {f(r.get('logprobs_s'), '.3f')} | "
            f"{f(r.get('logprobs_tokens_per_s'), ',.0f')} | {f(r.get('logprobs_mfu'), '.3f')} | "
            f"{f(r.get('logprobs_peak_gib'), '.2f')} | {f(r.get('update_s'), '.3f')} | "
            f"{f(r.get('update_tokens_per_s'), ',.0f')} | {f(r.get('update_mfu'), '.3f')} | "
            f"{f(r.get('update_peak_gib'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers comparison")
    p.add_argument("--rows", type=int, default=32, help="responses in the batch")
    p.add_argument("--group", type=int, default=16, help="responses per prompt (G)")
    p.add_argument("--max-response", type=int, default=2048, help="response length cap (a quarter are at it)")
    p.add_argument("--token-budget", type=int, default=16384, help="actor.max_tokens_per_microbatch")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions after one warm-up")
    p.add_argument("--time-budget-s", type=float, default=float("inf"), help="start no arm after this many seconds")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU for MFU")
    p.add_argument("--out", type=Path, default=Path("results/actor_step_gpu"), help="writes <out>.json and .md")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible to torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.pop("TRITON_INTERPRET", None)  # CPU dispatch (the chunked references), as a CPU job runs
    start = time.monotonic()
    gemm = measured_gemm_tflops(args.device)
    reps, flops, errors = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            shape = MODELS[model]
            model_dir = write_hf_config(shape, Path(tmp) / model)
            rows = make_rows(args.rows, args.group, args.max_response, shape["vocab"])
            flops[model] = model_flops(shape, rows)
            runs = [(impl, functools.partial(bench_actor, model, impl)) for impl in args.impls]
            runs += [("hf_transformers", functools.partial(bench_hf, model))] if args.hf else []
            for impl, run in runs:
                if time.monotonic() - start > args.time_budget_s:  # stop cleanly inside a device call's limit
                    errors.append({"model": model, "impl": impl, "error": "not run: past --time-budget-s"})
                    continue
                try:
                    got = run(rows, args, model_dir)
                except torch.cuda.OutOfMemoryError as exc:  # a row of its own, the other arms still run
                    errors.append({"model": model, "impl": impl, "error": f"OOM: {exc}".splitlines()[0][:200]})
                    got = []
                finally:
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                reps += got
                print(json.dumps(got[-1] if got else errors[-1]), flush=True)
                write_results(args, reps, flops, errors, gemm)
    print(write_results(args, reps, flops, errors, gemm))
    return 0


def write_results(args: argparse.Namespace, reps: list[dict], flops: dict, errors: list[dict], gemm) -> str:
    """<out>.json and <out>.md from the reps so far (written after every arm: a killed run keeps what it measured)."""
    import megatron.core

    summary = summarise(reps, flops, args.peak_tflops, gemm)
    meta = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?"),
        "rows": args.rows, "max_response": args.max_response, "token_budget": args.token_budget,
        "gemm_tflops": gemm, "peak_tflops": args.peak_tflops, "model_flops": flops,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, "summary": summary, "errors": errors, "reps": reps}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    table = markdown(summary, meta) + "".join(f"\n{e['model']} {e['impl']}: {e['error']}" for e in errors)
    args.out.with_suffix(".md").write_text(table)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
