"""What a trajectory's next turn costs on the embedded engine with its KV cache kept across the tool call
(SamplingParams.multi_turn, the default for multi-turn training and evaluation) and rebuilt (issue 40 item 5).

    python tools/bench/multi_turn_prefill.py [--repeats 3]     # CPU, ~3 min

On the tool-use experiment's shape (tools/experiments/tool_use.py: SmolLM2-135M-Instruct, its few-shot tool prompt,
G = 8 trajectories of a group together): the engine samples the first turn (ended by the stop token), the tool's
turn is appended, and the second turn starts. Timed: the prefill of the G second-turn contexts (the engine's
`_prefill`) with the first turn's KV kept (only the last token and the tool turn are new) and rebuilt (the whole
context again), and the decode of `new_tokens` tokens, which is the same either way:

    rebuild share = rebuilt prefill / (rebuilt prefill + decode);   turn speed-up = (rebuilt + decode) / (kept + decode)

Rows go to results/multi_turn_prefill.csv, the summary to docs/benchmarks.md "## Multi-turn: KV kept across a tool
call" (only that section is replaced).
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

SECTION = "## Multi-turn: KV kept across a tool call"
OLD_SECTION = "## Multi-turn: KV rebuilt per turn"
"""The section's title before the KV was kept (replaced by SECTION)."""


def _tool_prompts(tok, group: int) -> tuple[list[list[int]], tuple[int, ...]]:
    """G first-turn prompts (the experiment's few-shot tool prompt for G problems) and the tool turn's tokens."""
    import importlib.util

    from megatron_dapo.data.dataset import prompt_token_ids
    from megatron_dapo.envs.python_tool import observation_text

    spec = importlib.util.spec_from_file_location("tool_use", REPO_ROOT / "tools/experiments/tool_use.py")
    exp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp)
    prompts = [prompt_token_ids(tok, exp.messages("tool", 37 + k, 412 + 3 * k)) for k in range(group)]
    return prompts, tuple(tok.encode(observation_text(tok, "15244"), add_special_tokens=False))


def _second_turn(engine, prompts, observation, stop, keep: bool, first_tokens: int) -> tuple[float, int, int]:
    """First turn sampled (seeded), then the second turn's admission: (seconds in prefill of the second-turn
    contexts, tokens prefilled for them, first turns that stopped on their own)."""
    from megatron_dapo.rollout import FinishReason
    from megatron_dapo.rollout import GenerationRequest
    from megatron_dapo.rollout import SamplingParams

    params = SamplingParams(max_new_tokens=first_tokens + len(observation) + 2, stop_token_ids=stop, multi_turn=keep)
    engine.submit([GenerationRequest(k, p, 100 + k) for k, p in enumerate(prompts)], params)
    firsts = {}
    while engine.num_unfinished():
        firsts.update(engine.step())
    stopped = sum(r.finish is FinishReason.STOP for r in firsts.values())
    spent, inner = [0.0], engine._prefill

    def timed(key):
        start = time.perf_counter()
        out = inner(key)
        spent[0] += time.perf_counter() - start
        return out

    engine._prefill, before = timed, engine.prefilled_tokens
    try:
        nexts = [GenerationRequest(k, prompts[k], 200 + k, r.observe(observation, 0)) for k, r in firsts.items()
                 if r.finish is FinishReason.STOP]  # fmt: skip
        engine.submit(nexts, params)
        engine.step()  # admission: every second turn prefilled (one decode step follows)
        engine.abort()
    finally:
        engine._prefill = inner
    return spent[0], engine.prefilled_tokens - before, stopped


def measure(repeats: int, group: int = 8, new_tokens: int = 20) -> dict[str, float]:
    from transformers import AutoTokenizer

    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout import TransformersEngine

    model = default_cache_dir()
    tok = AutoTokenizer.from_pretrained(model)
    engine = TransformersEngine(str(model), max_running=group)
    prompts, observation = _tool_prompts(tok, group)
    stop = (tok.convert_tokens_to_ids("<|im_end|>"),)
    kept, rebuilt = [], []
    for _ in range(repeats):  # interleaved
        kept.append(_second_turn(engine, prompts, observation, stop, True, 48))
        rebuilt.append(_second_turn(engine, prompts, observation, stop, False, 48))
    decode_params = SamplingParams(n=1, max_new_tokens=new_tokens, seed=0)  # no stop: exactly new_tokens each
    one_params = SamplingParams(n=1, max_new_tokens=1, seed=0)
    whole, one = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, one_params)
        one.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.generate(prompts, decode_params)
        whole.append(time.perf_counter() - start)
    decode = statistics.median(whole) - statistics.median(one)  # new_tokens - 1 decode steps of G rows
    k, r = statistics.median(x[0] for x in kept), statistics.median(x[0] for x in rebuilt)
    return {
        "group": group,
        "first_turns_stopped": kept[0][2],
        "kept_prefill_tokens": kept[0][1],
        "rebuilt_prefill_tokens": rebuilt[0][1],
        "kept_prefill_s": k,
        "rebuilt_prefill_s": r,
        "new_tokens": new_tokens,
        "decode_s": decode,
        "rebuild_share": r / (r + decode),
        "turn_speedup": (r + decode) / (k + decode),
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
        f"experiment's trajectories, {row['group']} of a group together ({row['first_turns_stopped']} first turns "
        "ended on their own and continue), after the tool's turn. Prefill of their contexts with the first turn's "
        f"KV kept: {row['kept_prefill_tokens']} tokens, {row['kept_prefill_s']:.3f} s; rebuilt: "
        f"{row['rebuilt_prefill_tokens']} tokens, {row['rebuilt_prefill_s']:.3f} s (medians of {args.repeats}, "
        f"interleaved); the turn's {row['new_tokens']} decoded tokens take {row['decode_s']:.2f} s either way. "
        f"Rebuilding was **{100 * row['rebuild_share']:.0f}%** of the turn; keeping the KV makes the turn "
        f"**{row['turn_speedup']:.1f}x** faster. So the engine keeps it (SamplingParams.multi_turn, set for every "
        "multi-turn environment): a stopped row's KV is copied out of its slot (the slot frees at once, so the "
        "decode batch does not wait on the tool) and its next turn prefills the last sampled token and the tool's "
        "turn over it; at most max_running are kept (memory: at most the slot cache's again), dropped by a weight "
        "update, an abort and a release of the KV cache (a next turn then rebuilds). Exact as before in the sense "
        "that matters: the tokens depend only on the trajectory (tests/rollout/test_multi_turn_kv.py: the same bits "
        "alone or batched, logits within 1e-4 of an fp64 forward of the whole context); not the same bits as a "
        "rebuild, whose prefill rounds differently from the decode that wrote the kept KV. Not with "
        "actor.routing_replay r3 (the routing of a context must come from one prefill), nor measured on a GPU "
        "(SGLang's radix cache keeps finished requests' KV by itself).\n"
    )
    doc = Path(REPO_ROOT) / "docs" / "benchmarks.md"
    replace_doc_section(doc, OLD_SECTION if OLD_SECTION in doc.read_text() else SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
