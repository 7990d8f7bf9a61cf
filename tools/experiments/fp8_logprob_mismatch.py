"""Measure what FP8 rollout weights do to the engine's log-probs (docs/rollout_correction.md).

The transformers engine samples responses with the full-precision weights, then the same weights are synced as
FP8 (rollout.weight_dtype "fp8": 128 x 128 block e4m3, rollout/fp8.py) into a second engine, and both score the
same sequences by teacher forcing against the full-precision model (the actor's stand-in: the fp32 path matches
the actor to < 1e-4, tests/rollout/test_actor_sync.py). Prints one JSON object: mismatch of the FP8 engine
(mean / max |d logp|, k3 KL, log-ppl difference, the TIS / MIS shares at the default thresholds) and the sync
bytes of "auto" and "fp8" for the model's fp32 and bf16 weights.

    python tools/experiments/fp8_logprob_mismatch.py ~/.cache/megatron_dapo/smollm2-135m-instruct \
        --prompts 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per response")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    from megatron_dapo.algorithms.rollout_correction import rollout_correction
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout import TransformersEngine
    from megatron_dapo.rollout import WeightSync

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    questions = [f"What is {a} + {b}? Think step by step." for a, b in zip(range(11, 99, 7), range(23, 99, 9))]
    prompts = []
    for q in questions[: args.prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    params = SamplingParams(
        n=1, max_new_tokens=args.tokens, temperature=args.temperature, seed=args.seed, stop_token_ids=(2,)
    )
    start = time.perf_counter()
    full = TransformersEngine(reference, max_running=len(prompts))
    completions = full.generate(prompts, params)
    gen_s = time.perf_counter() - start

    fp8_engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval())
    state = list(reference.state_dict().items())
    sync = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        named = [(n, t.to(dtype)) for n, t in state if n != "lm_head.weight"]  # tied to the embedding
        sync[f"{dtype_name}_auto_bytes"] = WeightSync(None).sync(named)["weight_sync/bytes"]
        target = fp8_engine if dtype_name == "fp32" else _Sink()
        sync[f"{dtype_name}_fp8_bytes"] = WeightSync(target, weight_dtype="fp8").sync(named)["weight_sync/bytes"]

    width = max(len(c.prompt_ids) + len(c.response_ids) for c in completions)
    ids = torch.full((len(completions), width), 2, dtype=torch.long)
    mask = torch.zeros(len(completions), width)
    for i, c in enumerate(completions):
        seq = torch.cat([c.prompt_ids, c.response_ids])
        ids[i, : len(seq)] = seq
        mask[i, len(c.prompt_ids) : len(seq)] = 1.0

    def score(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float() / args.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return torch.cat([torch.zeros(len(ids), 1), lp], dim=1) * mask

    actor = score(reference)
    fp8 = score(fp8_engine.model)
    valid = mask != 0
    diff = (fp8 - actor)[valid]
    out = {
        "model": args.model_dir,
        "responses": len(completions),
        "response_tokens": int(valid.sum()),
        "generate_s": round(gen_s, 2),
        "fp8_vs_actor_abs_logp_mean": float(diff.abs().mean()),
        "fp8_vs_actor_abs_logp_max": float(diff.abs().max()),
        "full_engine_vs_actor_abs_logp_max": float(
            (torch.cat([c.engine_logp for c in completions]) - actor[valid]).abs().max()
        ),
    }
    for mode in ("tis", "mis"):  # default thresholds: C = 2, band [0.5, 2]
        out.update({k: float(v) for k, v in rollout_correction(actor, fp8, mask, mode=mode).metrics.items()})
    out.update(sync)
    out["sync_ratio_bf16"] = sync["bf16_fp8_bytes"] / sync["bf16_auto_bytes"]
    out["sync_ratio_fp32"] = sync["fp32_fp8_bytes"] / sync["fp32_auto_bytes"]
    print(json.dumps(out, indent=1))


class _Sink:
    """A stand-in engine that accepts and drops the tensors (bytes metric only)."""

    def begin_weight_update(self) -> None:
        pass

    def update_weights(self, bucket: object) -> None:
        pass

    def end_weight_update(self, *, full: bool = True) -> None:
        pass


if __name__ == "__main__":
    main()
