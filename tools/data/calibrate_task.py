"""Measure how learnable a task is for a policy: accuracy and the share of mixed groups under one prompt setting.

DAPO learns only from groups whose accuracy is strictly between 0 and 1 (dynamic sampling drops the rest), so a
CPU job needs a task/prompt/format where a good share of groups is mixed. One run = one candidate:

```
 reasoning-gym items (seed) + few-shot examples (seed + 200M, disjoint)  -> template -> chat template
   -> G samples per prompt, all groups batched (left padding, top_k=0, top_p=1)
   -> compute_score(answer_format) per response -> per-group accuracy -> one CSV row (results/calibration.csv)
```
Both answer formats ("answer_line" and "last_number") are scored on the same samples and written to the row; the
``--format`` one fills the headline columns ``acc`` and ``mixed``.

Example (the CPU job's chosen setting, see docs/cpu_job.md):
    OMP_NUM_THREADS=1 python tools/data/calibrate_task.py --task chain_sum \
        --task-kwargs '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' \
        --template few_shot --format answer_line --temperature 1.0 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone
from pathlib import Path

import torch

from megatron_dapo.data.reasoning_gym_tasks import generate_items
from megatron_dapo.data.templates import PromptTemplate
from megatron_dapo.data.templates import Shot
from megatron_dapo.data.templates import get_template as get_data_template
from megatron_dapo.reward.dapo_math import compute_score
from megatron_dapo.reward.dapo_math import extract_answer

SHOT_SEED_OFFSET = 200_000_000  # same offset as megatron_dapo.data.generate.SPLIT_SEED_OFFSETS["shots"]
FORMATS = ("answer_line", "last_number")


def get_template(name: str) -> PromptTemplate:
    """A template from megatron_dapo.data.templates."""
    return get_data_template(name)


@dataclass
class Samples:
    """Decoded responses of all groups (group-major: G consecutive entries per prompt) and their stats."""

    texts: list[str]
    lengths: list[int]
    """Generated tokens per response, EOS included."""
    truncated: list[bool]
    """True when no EOS came within max_new_tokens (finish reason "length")."""
    seconds: float


def build_prompts(args: argparse.Namespace, tokenizer) -> tuple[list[str], list[str]]:
    """(prompt strings after the chat template, ground truths) for ``args.num_prompts`` items."""
    kwargs = json.loads(args.task_kwargs) if args.task_kwargs else {}
    template = get_template(args.template)
    num_shots = args.num_shots if args.num_shots is not None else template.num_shots
    shots_items = generate_items(args.task, num_shots, seed=args.seed + SHOT_SEED_OFFSET, task_kwargs=kwargs)
    shots = [Shot(question=s.question, answer=s.answer, solution=s.solution) for s in shots_items]
    items = generate_items(
        args.task, args.num_prompts, seed=args.seed, task_kwargs=kwargs, exclude={s.question for s in shots}
    )
    prompts = [
        tokenizer.apply_chat_template(template.build(it.question, shots), tokenize=False, add_generation_prompt=True)
        for it in items
    ]
    return prompts, [it.answer for it in items]


@torch.no_grad()
def prefill_shared(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int):
    """Run the prompt once per group and repeat its KV cache ``group_size`` times.

    input_ids / attention_mask: [P, S] int64, left padded. Returns (input_ids [P*G, S], attention_mask [P*G, S],
    cache) where the cache holds the first S-1 positions of every row; ``generate`` then feeds only the last prompt
    token. Prefill is most of the cost of short answers after long few-shot prompts, so this saves ~G-fold there.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    model(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        cache=cache,
        use_cache=True,
    )
    cache.batch_repeat_interleave(group_size)
    return input_ids.repeat_interleave(group_size, 0), attention_mask.repeat_interleave(group_size, 0), cache


@torch.no_grad()
def sample_groups(model, tokenizer, prompts: list[str], args: argparse.Namespace) -> Samples:
    """``group_size`` samples per prompt (group-major), ``batch_size`` rows per generate call, left padding."""
    eos = tokenizer.eos_token_id
    per_call = args.batch_size // args.group_size
    texts, lengths, truncated = [], [], []
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    for lo in range(0, len(prompts), per_call):
        enc = tokenizer(prompts[lo : lo + per_call], return_tensors="pt", padding=True, add_special_tokens=False)
        if args.shared_prefill:
            ids, mask, cache = prefill_shared(model, enc["input_ids"], enc["attention_mask"], args.group_size)
            extra = {"cache": cache}
        else:
            ids = enc["input_ids"].repeat_interleave(args.group_size, 0)
            mask = enc["attention_mask"].repeat_interleave(args.group_size, 0)
            extra = {}
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=args.temperature > 0,
            temperature=args.temperature if args.temperature > 0 else None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
            **extra,
        )
        for resp in out[:, ids.shape[1] :].tolist():
            n = resp.index(eos) + 1 if eos in resp else len(resp)
            truncated.append(eos not in resp)
            lengths.append(n)
            texts.append(tokenizer.decode(resp[:n], skip_special_tokens=True))
    return Samples(texts, lengths, truncated, time.perf_counter() - start)


def group_stats(correct: list[bool], group_size: int) -> dict[str, float]:
    """Accuracy and the shares of mixed / all-correct / all-wrong groups (groups are contiguous)."""
    groups = [correct[i : i + group_size] for i in range(0, len(correct), group_size)]
    means = [sum(g) / len(g) for g in groups]
    return {
        "acc": sum(correct) / len(correct),
        "mixed": sum(0 < m < 1 for m in means) / len(means),
        "all_correct": sum(m == 1 for m in means) / len(means),
        "all_wrong": sum(m == 0 for m in means) / len(means),
    }


def summarise(samples: Samples, truths: list[str], args: argparse.Namespace) -> dict[str, object]:
    """One CSV row: settings, headline numbers for ``args.format`` and per-format accuracy / mixed share."""
    g = args.group_size
    row_truths = [t for t in truths for _ in range(g)]
    per_format = {}
    for fmt in FORMATS:
        correct = [compute_score(s, t, answer_format=fmt)["acc"] for s, t in zip(samples.texts, row_truths)]
        per_format[fmt] = group_stats(correct, g)
    head = per_format[args.format]
    n = len(samples.texts)
    return {
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "name": args.name,
        "task": args.task,
        "task_kwargs": args.task_kwargs or "{}",
        "template": args.template,
        "num_shots": args.num_shots if args.num_shots is not None else get_template(args.template).num_shots,
        "format": args.format,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": args.num_prompts,
        "group_size": g,
        "seed": args.seed,
        "acc": round(head["acc"], 4),
        "mixed": round(head["mixed"], 4),
        "all_correct": round(head["all_correct"], 4),
        "all_wrong": round(head["all_wrong"], 4),
        "answer_line_rate": round(sum(extract_answer(s, "answer_line") is not None for s in samples.texts) / n, 4),
        "trunc_rate": round(sum(samples.truncated) / n, 4),
        "mean_len": round(sum(samples.lengths) / n, 2),
        "sec_per_group": round(samples.seconds / args.num_prompts, 2),
        "acc_answer_line": round(per_format["answer_line"]["acc"], 4),
        "mixed_answer_line": round(per_format["answer_line"]["mixed"], 4),
        "acc_last_number": round(per_format["last_number"]["acc"], 4),
        "mixed_last_number": round(per_format["last_number"]["mixed"], 4),
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def append_csv(path: Path, row: dict[str, object]) -> None:
    """Append ``row`` to ``path``, writing the header when the file is new; a header mismatch is an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != list(row):
            raise ValueError(f"{path}: header {header} differs from this tool's columns {list(row)}; use another --out")
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: the cached SmolLM2, converted on first use)")
    p.add_argument("--task", default="chain_sum", help="reasoning-gym task (basic_arithmetic, chain_sum, ...)")
    p.add_argument("--task-kwargs", default="", help="difficulty kwargs as JSON, e.g. '{\"max_terms\": 2}'")
    p.add_argument("--template", "--few-shot", dest="template", default="few_shot", help="megatron_dapo template")
    p.add_argument("--num-shots", type=int, default=None, help="worked examples (default: the template's own)")
    p.add_argument("--format", choices=FORMATS, default="answer_line", help="answer format of the headline numbers")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="rows per generate call (a multiple of group size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-shared-prefill",
        dest="shared_prefill",
        action="store_false",
        help="prefill every row separately (default: once per prompt, KV cache repeated for the group)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--name", default="", help="label for the CSV row")
    p.add_argument("--show", type=int, default=0, help="print this many sample responses")
    p.add_argument("--out", type=Path, default=Path("results/calibration.csv"))
    args = p.parse_args(argv)
    if args.batch_size % args.group_size:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --group-size {args.group_size}")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    if args.model is None:
        from megatron_dapo.dev.hub import prepare_smollm2

        args.model = str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts, truths = build_prompts(args, tokenizer)
    samples = sample_groups(model, tokenizer, prompts, args)
    for i in range(min(args.show, len(samples.texts))):
        j = i * args.group_size  # first sample of successive groups
        print(f"--- truth {truths[i]} len {samples.lengths[j]}\n{samples.texts[j]}")
    row = summarise(samples, truths, args)
    append_csv(args.out, row)
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
