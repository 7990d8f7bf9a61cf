"""Changed-weights (delta) vs full weight sync on the main job's model, side by side in one run (issue 39 item 4).

    python tools/bench/delta_sync.py [--steps 10] [--moe] [--fp8]   # CPU, ~2 min dense; --moe adds the upcycled
                                                                    # MoE, --fp8 each model's block-FP8 stream

The main job's model (SmolLM2-135M-Instruct from the offline cache; with --moe also its sparse upcycle, 4 experts
top-2, dev/upcycle.py) takes --steps AdamW steps at the main job's optimizer settings (examples/smollm2_arith_cpu.yaml:
lr, warm-up, betas, weight decay) on supervised batches of the main job's prompts and answers: Adam's step per
element is about lr whatever the loss, so the changed fraction is the one the DAPO updates give, not a guess. After
each step the weights are exported in bf16 (what a bf16 actor exports; the CPU actor is fp32) and pushed twice:
a full WeightSync into one TransformersEngine, a delta one (rollout.weight_sync_delta) into another. Per step:
bytes and seconds of each, the changed fraction overall and per tensor kind; the two engines are checked equal bit
for bit after every step. With --fp8 each model also runs with rollout.weight_dtype "fp8" (the rows "... fp8"): the
export is quantized to block FP8 (rollout/fp8.py) and the delta is of the float8 weights and their fp32 scales, what an
FP8 SGLang server's loader or a split launch's engine rank receives; here the engine rank's path: a DeltaDecoder
rebuilds the FP8 tensors and the engine dequantizes them, checked against a full FP8 sync after every step (a
projection's kind counts its weight's elements; its scales' changes, 1/16384 as many, are counted with them). Rows go
to results/delta_sync.csv, the summary to docs/benchmarks.md "## Delta weight sync" (only that section is replaced).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import yaml

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev import replace_doc_section
from megatron_dapo.dev.hub import default_cache_dir

KINDS = ("embed", "attention", "mlp", "experts", "router", "norm", "lm_head")


def kind_of(name: str) -> str:
    """The tensor kind of an HF parameter name (the rows of the per-kind fractions)."""
    for part, kind in (("embed_tokens", "embed"), ("lm_head", "lm_head"), ("self_attn", "attention"),
                       ("mlp.experts", "experts"), ("mlp.gate.", "router"), ("shared_expert_gate", "router"),
                       ("mlp", "mlp"), ("norm", "norm")):  # fmt: skip
        if part in name:
            return kind
    return "other"


def batches(tokenizer, data: Path, size: int, steps: int, max_tokens: int = 192) -> list[dict]:
    """`steps` batches of `size` rows: each a prompt of the main job's data with its answer line appended, the loss
    on every token (a supervised stand-in for the RL gradient: Adam's update size does not depend on it)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()[: size * steps]]
    texts = [r["extra_info"]["question"] + f" {r['reward_model']['ground_truth']}\nAnswer: "
             f"{r['reward_model']['ground_truth']}" for r in rows]  # fmt: skip
    out = []
    for k in range(steps):
        enc = tokenizer(texts[k * size : (k + 1) * size], return_tensors="pt", padding=True, truncation=True,
                        max_length=max_tokens)  # fmt: skip
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


def exported(model: torch.nn.Module, names: frozenset[str]) -> list[tuple[str, torch.Tensor]]:
    """The model's weights as a bf16 export sends them, under the engine's names: the checkpoint's per-expert names
    of transformers' fused experts are cut from the fused parameters (param_writer.fused_expert_rows)."""
    from megatron_dapo.rollout.param_writer import fused_expert_rows

    params = dict(model.named_parameters())
    experts = fused_expert_rows(params)
    out = []
    for name in sorted(names):
        if name in experts:
            fused, expert, rows = experts[name]
            tensor = params[fused][expert, rows]
        else:
            tensor = params[name]
        out.append((name, tensor.detach().to(torch.bfloat16)))
    return out


ENCODINGS = ("indices", "bitmap", "blocks128", "chosen")
"""A delta's positions as int32 indices (4 bytes each), as a bitmap of the tensor (n / 8 bytes), or as the changed
128-element blocks (an int32 id and all 128 values each); each alternative or the full tensor, whichever is smaller
per tensor. "chosen": what rollout/delta.py sends (the smaller of indices and bitmap, or the full tensor)."""


def encoding_bytes(entry) -> dict[str, int]:
    """The bytes one WeightDelta entry would take in each of ENCODINGS."""
    n, v = entry.values.numel(), entry.values.element_size()
    if entry.index is None:
        return dict.fromkeys(ENCODINGS, n * v)
    n = math.prod(entry.shape)
    k, full = entry.index.numel(), n * v
    blocks = torch.unique(entry.index.long() // 128).numel()
    alternatives = {"indices": k * (4 + v), "bitmap": (n + 7) // 8 + k * v, "blocks128": blocks * (4 + 128 * v)}
    return {**{e: min(b, full) for e, b in alternatives.items()}, "chosen": entry.nbytes}


class _Measured:
    """An engine whose updates are also counted in every encoding (the delta path's, before it applies them)."""

    def __init__(self, engine) -> None:
        self.engine, self.sizes = engine, dict.fromkeys(ENCODINGS, 0)

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def update_weights(self, bucket) -> None:
        for _, entry in bucket:
            for e, b in encoding_bytes(entry).items():
                self.sizes[e] += b
        self.engine.update_weights(bucket)

    def end_weight_update(self, *, full: bool = True) -> None:
        self.engine.end_weight_update(full=full)


def _counting(items, encoder, per_kind: dict[str, list[int]]):
    """The (name, tensor) pairs passed through, each one's changed elements (the encoder's count across its
    encoding, which runs between two of these yields) added to its kind's [changed, total]."""
    for name, t in items:
        seen = encoder.changed
        yield name, t
        per_kind[kind_of(name)][1] += t.numel()
        per_kind[kind_of(name)][0] += encoder.changed - seen


class _EngineRank:
    """A split launch's engine rank in one process: each bucket of WeightDelta entries goes through the wire's plain
    pairs (rollout/delta.as_plain_tensors) and a DeltaDecoder, and the engine loads the full tensors it rebuilds."""

    def __init__(self, engine) -> None:
        from megatron_dapo.rollout.delta import DeltaDecoder

        self.engine, self.decoder, self.version = engine, DeltaDecoder(), None

    def begin_weight_update(self) -> None:
        self.version = None
        self.engine.begin_weight_update()

    def update_weights(self, bucket) -> None:
        from megatron_dapo.rollout.delta import as_plain_tensors

        if self.version is None:
            self.version = bucket[0][1].version
            self.decoder.begin(self.version, next((d.base for _, d in bucket if d.base is not None), None))
        self.engine.update_weights(self.decoder.decode(list(as_plain_tensors(bucket))))

    def end_weight_update(self, *, full: bool = True) -> None:
        self.decoder.end()
        self.engine.end_weight_update(full=full)


def run_model(label: str, hf_dir: Path, optim: dict, data: Path, steps: int, rows: list[dict],
              weight_dtype: str = "auto") -> None:  # fmt: skip
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    from megatron_dapo.rollout import TransformersEngine
    from megatron_dapo.rollout import WeightSync

    torch.manual_seed(0)  # the same updates for a model's bf16 and fp8 runs
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    moe = {"experts_implementation": "eager"} if "moe" in label else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **moe)
    full_engine, delta_engine = TransformersEngine(hf_dir), TransformersEngine(hf_dir)
    names = full_engine.weights.parameter_names
    fp8 = weight_dtype == "fp8"
    full = WeightSync(full_engine, weight_dtype=weight_dtype)
    measured = _Measured(_EngineRank(delta_engine) if fp8 else delta_engine)
    delta = WeightSync(measured, weight_dtype=weight_dtype, delta=True)
    opt = torch.optim.AdamW(model.parameters(), lr=optim["lr"], betas=(optim["adam_beta1"], optim["adam_beta2"]),
                            weight_decay=optim["weight_decay"])  # fmt: skip
    warmup = optim["lr_warmup_steps"]
    for step, batch in enumerate(batches(tokenizer, data, 8, steps + 1)):
        if step > 0:  # step 0: the first (full) sync of the initial weights
            for group in opt.param_groups:
                group["lr"] = optim["lr"] * min(1.0, step / warmup) if warmup else optim["lr"]
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            model(**batch, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        named = exported(model, names)
        per_kind = {k: [0, 0] for k in (*KINDS, "other")}
        measured.sizes = dict.fromkeys(ENCODINGS, 0)
        t0 = time.perf_counter()
        m_full = full.sync(iter(named))
        t1 = time.perf_counter()
        m_delta = delta.sync(_counting(iter(named), delta.encoder, per_kind))
        t2 = time.perf_counter()
        same = all(torch.equal(a, b) for a, b in zip(full_engine.model.state_dict().values(),
                                                     delta_engine.model.state_dict().values()))  # fmt: skip
        if not same:
            raise SystemExit(f"{label} step {step}: the delta-synced engine differs from the fully synced one")
        row = {"model": label, "step": step, "full_bytes": m_full["weight_sync/bytes"], "full_s": round(t1 - t0, 4),
               "delta_bytes": m_delta["weight_sync/bytes"], "delta_s": round(t2 - t1, 4),
               "changed_fraction": m_delta["weight_sync/changed_fraction"], "engines_equal": same}  # fmt: skip
        row.update({f"changed_{k}": (c / n if n else "") for k, (c, n) in per_kind.items() if n})
        row.update({f"bytes_{e}": b for e, b in measured.sizes.items()})
        if row["bytes_chosen"] != row["delta_bytes"]:
            raise SystemExit(f"{label} step {step}: the encodings' count differs from what the sync sent")
        rows.append(row)
        print(json.dumps(row), flush=True)


def summary(rows: list[dict], csv_path: Path, optim: dict) -> str:
    lines = [
        "## Delta weight sync",
        "",
        f"Written by `tools/bench/delta_sync.py` ({time.strftime('%Y-%m-%d')}): the main job's model, AdamW at its "
        f"settings (lr {optim['lr']}, warm-up {optim['lr_warmup_steps']}), bf16 exports pushed by a full and a delta "
        'WeightSync into two transformers engines on this CPU (rows "fp8": the exports\' block-FP8 quantization, the '
        "delta of the float8 weights and their scales rebuilt by a split launch's DeltaDecoder); the engines were "
        "equal bit for bit after every step.",
        "",
        "| model | steps | changed fraction (median, steps 1..) | delta bytes / full bytes | delta s / full s |",
        "|---|---|---|---|---|",
    ]
    for label in dict.fromkeys(r["model"] for r in rows):
        later = [r for r in rows if r["model"] == label and r["step"] > 0]
        if not later:
            continue
        frac = sorted(r["changed_fraction"] for r in later)[len(later) // 2]
        byte_ratio = sum(r["delta_bytes"] for r in later) / sum(r["full_bytes"] for r in later)
        time_ratio = sum(r["delta_s"] for r in later) / sum(r["full_s"] for r in later)
        lines.append(f"| {label} | {len(later)} | {frac:.4f} | {byte_ratio:.3f} | {time_ratio:.2f} |")
    kinds = [k for k in (*KINDS, "other") if any(f"changed_{k}" in r for r in rows)]
    lines += ["", "Changed fraction per tensor kind (mean over steps 1..):", "",
              "| model | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]  # fmt: skip
    for label in dict.fromkeys(r["model"] for r in rows):
        later = [r for r in rows if r["model"] == label and r["step"] > 0]
        cells = []
        for k in kinds:
            values = [r[f"changed_{k}"] for r in later if r.get(f"changed_{k}", "") != ""]
            cells.append(f"{sum(values) / len(values):.4f}" if values else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Delta bytes in each encoding of the changed positions, as a share of the full syncs' bytes (steps "
              "1..; per tensor the encoding or the full tensor, whichever is smaller; tools/bench/delta_sync.py "
              "ENCODINGS):", "", "| model | " + " | ".join(ENCODINGS) + " |",
              "|---|" + "---|" * len(ENCODINGS)]  # fmt: skip
    for label in dict.fromkeys(r["model"] for r in rows):
        later = [r for r in rows if r["model"] == label and r["step"] > 0]
        full = sum(r["full_bytes"] for r in later)
        lines.append(f"| {label} | " + " | ".join(f"{sum(r[f'bytes_{e}'] for r in later) / full:.4f}"
                                                  for e in ENCODINGS) + " |")  # fmt: skip
    shown = csv_path.relative_to(REPO_ROOT) if csv_path.is_relative_to(REPO_ROOT) else csv_path
    lines += ["", "Seconds are this 2-core CPU's: the full sync is an in-process copy, the delta adds the host "
              "comparison against its copy of the last export, so here the delta is slower; across a link (an SGLang "
              f"server, the split launch) the bytes are what counts. Raw rows: `{shown}`.", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--moe", action="store_true", help="also the sparse upcycle of the model (4 experts, top-2)")
    parser.add_argument("--fp8", action="store_true", help='also each model with rollout.weight_dtype "fp8"')
    parser.add_argument("--model", default=str(default_cache_dir()))
    parser.add_argument("--data", default=str(REPO_ROOT / "runs/data/chain_sum_2x2d/train.jsonl"))
    parser.add_argument("--config", default=str(REPO_ROOT / "examples/smollm2_arith_cpu.yaml"))
    parser.add_argument("--csv", default=str(REPO_ROOT / "results/delta_sync.csv"))
    parser.add_argument("--docs", default=str(REPO_ROOT / "docs/benchmarks.md"))
    args = parser.parse_args()
    data = Path(args.data)
    if not data.is_file():
        raise SystemExit(f"{data}: the main job's data is missing; run examples/run_smollm2_cpu.sh once to make it")
    actor = yaml.safe_load(Path(args.config).read_text())["actor"]
    optim = {"lr": 1e-6, "lr_warmup_steps": 0, "adam_beta1": 0.9, "adam_beta2": 0.999, "weight_decay": 0.0}
    optim.update({k: actor[k] for k in optim if k in actor})
    rows: list[dict] = []
    dtypes = ("auto", "fp8") if args.fp8 else ("auto",)

    def run(label: str, hf_dir: Path) -> None:
        for dtype in dtypes:
            run_model(label + (" fp8" if dtype == "fp8" else ""), hf_dir, optim, data, args.steps, rows, dtype)

    run("smollm2-135m", Path(args.model))
    if args.moe:
        from megatron_dapo.dev.upcycle import upcycle_llama_to_moe

        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            moe_dir = upcycle_llama_to_moe(args.model, Path(tmp) / "moe", num_experts=4, top_k=2, noise=0.01)
            run("smollm2-135m upcycled moe", moe_dir)
    csv_path = Path(args.csv)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    replace_doc_section(Path(args.docs), "## Delta weight sync", summary(rows, csv_path, optim))
    print(f"wrote {csv_path} and the '## Delta weight sync' section of {args.docs}")


if __name__ == "__main__":
    main()
