"""What rebuilding a trajectory's KV cache costs at each new turn on the embedded engine (issue 40 item 5).

    python tools/bench/multi_turn_prefill.py [--repeats 3]     # CPU, ~2 min

The embedded engine frees a trajectory's slot when its turn ends and prefills the whole context again when the next
turn starts (rollout/turns.py: the next turn is a new request with the trajectory as its prefix). Keeping the KV
cache across the tool call instead would save that prefill. This measures, on the tool-use experiment's shape
(tools/experiments/tool_use.py: SmolLM2-135M-Instruct, its few-shot tool prompt, G = 8 trajectories of a group
continuing together, a second turn of ~20 tokens), the time of the second turn as run today (prefill of the whole
context + decode) against the decode alone (the same requests with max_new_tokens 1 give the prefill's time):

    rebuild share = prefill time / (prefill + decode time) of the second turn

Rows go to results/multi_turn_prefill.csv, the summary to docs/benchmarks.md "## Multi-turn: KV rebuilt per turn"
(only that section is replaced).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev import replace_doc_section
from megatron_dapo.dev.hub import default_cache_dir

SECTION = "## Multi-turn: KV rebuilt per turn"


def _second_turn_contexts(tok, group: int) -> list[list[int]]:
    """G contexts as a group's second turn sees them: the tool prompt, a first turn with its call, the tool turn."""
    import importlib.util

    from megatron_dapo.data.dataset import prompt_token_ids
    from megatron_dapo.envs.python_tool import observation_text

    spec = importlib.util.spec_from_file_location("tool_use", REPO_ROOT / "tools/experiments/tool_use.py")
    exp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp)
    out = []
    for k in range(group):
        a, b = 37 + k, 412 + 3 * k
        prompt = prompt_token_ids(tok, exp.messages("tool", a, b))
        turn = tok.encode(f"```python\nprint({a} * {b})\n```", add_special_tokens=False) + [tok.eos_token_id]
        obs = tok.encode(observation_text(tok, str(a * b)), add_special_tokens=False)
        out.append(prompt + turn + obs)
    return out


def measure(repeats: int, group: int = 8, new_tokens: int = 20) -> dict[str, float]:
    from transformers import AutoTokenizer

    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout import TransformersEngine

    model = default_cache_dir()
    tok = AutoTokenizer.from_pretrained(model)
    engine = TransformersEngine(str(model), max_running=group)
    contexts = _second_turn_contexts(tok, group)

    def timed(tokens: int) -> float:
        # No stop token: every row generates exactly `tokens`, so the decode part is the same in every repeat.
        params = SamplingParams(n=1, max_new_tokens=tokens, seed=0, return_logprobs=True)
        start = time.perf_counter()
        engine.generate(contexts, params)
        return time.perf_counter() - start

    timed(1)  # warm-up
    prefill = [timed(1) for _ in range(repeats)]
    whole = [timed(new_tokens) for _ in range(repeats)]
    p, w = statistics.median(prefill), statistics.median(whole)
    return {
        "group": group,
        "context_tokens": sum(map(len, contexts)) / group,
        "new_tokens": new_tokens,
        "prefill_s": p,
        "second_turn_s": w,
        "rebuild_share": p / w,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    row = measure(args.repeats)
    out = REPO_ROOT / "results" / "multi_turn_prefill.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    text = (
        f"{SECTION}\n\n"
        "`tools/bench/multi_turn_prefill.py` (CPU, this 2-core machine, one run): the second turn of the tool-use "
        f"experiment's trajectories, {row['group']} of a group together, contexts of {row['context_tokens']:.0f} "
        f"tokens (few-shot tool prompt, first turn, tool turn), {row['new_tokens']} new tokens each. Prefill of the "
        f"contexts {row['prefill_s']:.2f} s (median of {args.repeats}), the whole turn {row['second_turn_s']:.2f} s: "
        f"rebuilding the KV cache is **{100 * row['rebuild_share']:.0f}%** of a turn's time. The engine frees a "
        "trajectory's slot at the end of each turn and rebuilds its cache at the next (rollout/turns.py); keeping "
        "it across the tool call would save that share of every turn after the first, at the cost of the slot's "
        "memory while the tool runs. Not measured on a GPU (SGLang keeps finished requests' KV in its radix cache, "
        "so a continuation there prefills only what is new).\n"
    )
    replace_doc_section(Path(REPO_ROOT) / "docs" / "benchmarks.md", SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
