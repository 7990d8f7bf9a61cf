"""Held-out evaluation with the paper's protocol: k samples per prompt (32), temperature 1.0, top-p 0.7.

avg@k: mean accuracy over all k samples; pass@k: the unbiased estimator 1 - C(n-c, k)/C(n, k) with n = k samples,
i.e. 1 if any of the k is correct; cons@k: the majority-voted answer (over extracted predictions) is correct.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_vote(preds: Sequence[str | None]) -> str | None:
    """The most frequent non-empty prediction; ties go to the one seen first. None if there is none."""
    counts = Counter(p for p in preds if p is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(p for p in preds if p is not None and counts[p] == best)


def score_groups(scored: Sequence[Sequence[dict[str, Any]]], k: int) -> dict[str, float]:
    """Aggregate per-prompt lists of verifier results ({"acc", "pred"}) into avg@k, pass@k and cons@k.

    Args:
        scored: one list of k verifier results per prompt.
    """
    if not scored:
        return {f"eval/avg@{k}": 0.0, f"eval/pass@{k}": 0.0, f"eval/cons@{k}": 0.0, "eval/num_prompts": 0.0}
    avg, passed, cons = 0.0, 0.0, 0.0
    for results in scored:
        if len(results) != k:
            raise ValueError(f"expected {k} samples per prompt, got {len(results)}")
        correct = [bool(r["acc"]) for r in results]
        avg += sum(correct) / k
        passed += pass_at_k(k, sum(correct), k)
        vote = majority_vote([r["pred"] for r in results])
        cons += float(vote is not None and any(r["acc"] and r["pred"] == vote for r in results))
    n = len(scored)
    return {
        f"eval/avg@{k}": avg / n,
        f"eval/pass@{k}": passed / n,
        f"eval/cons@{k}": cons / n,
        "eval/num_prompts": float(n),
    }


def sample_scores(
    engine: Any, prompts: Sequence[list[int]], truths: Sequence[str], verifier: Any, tokenizer: Any, params: Any,
    environment: Any = None, records: Sequence[dict[str, Any]] | None = None,
) -> list[list[dict[str, Any]]]:  # fmt: skip
    """The evaluation driver (the trainer's evaluation and `megatron-dapo eval`): params.n responses per prompt from
    `engine`, each scored by `verifier(text, truth)` on its decoded text, or with a multi-turn `environment`
    (reward.environment) driven turn by turn (rollout/turns.run_trajectories) and scored by its episodes' outcomes.
    Returns one list of params.n results per prompt ([] without prompts: the engine is not called).

    Args:
        prompts: token ids per prompt (chat template applied). truths: ground truth per prompt. records: each
            prompt's record for the environment's episodes (envs/base.py prompt_record), or None.
        params: the engine's SamplingParams (`rollout.factory.sampling_params` with the evaluation's temperature and
            top_p).
    """
    if not prompts:
        return []
    k = params.n
    if environment is not None and environment.multi_turn:
        from megatron_dapo.rollout.turns import run_trajectories

        record = (lambda i: records[i]) if records is not None else (lambda i: None)
        done = run_trajectories(engine, prompts, lambda i: environment.episode(truths[i], record(i)), params)
        details = [r.episode["outcome"]["details"] for r in done]
        return [details[i * k : (i + 1) * k] for i in range(len(prompts))]
    completions = engine.generate(list(prompts), params)
    scored = []
    for i, truth in enumerate(truths):
        group = completions[i * k : (i + 1) * k]
        texts = tokenizer.batch_decode([c.response_ids for c in group], skip_special_tokens=True)
        scored.append([verifier(text, truth) for text in texts])
    return scored


def evaluate(
    engine: Any,
    prompts: Sequence[list[int]],
    truths: Sequence[str],
    verifier: Any,
    params: Any,
    *,
    tokenizer: Any,
    environment: Any = None,
    records: Sequence[dict[str, Any]] | None = None,
) -> dict[str, float]:
    """`sample_scores` aggregated by `score_groups` (avg@k, pass@k, cons@k with k = params.n)."""
    scored = sample_scores(engine, prompts, truths, verifier, tokenizer, params, environment, records)
    return score_groups(scored, params.n)
