"""From completions to a training batch: scoring (verifier + overlong shaping), groups, and the ActorBatch.

    Completion x G --score_group--> Group(accs, payload{prompt, responses, rewards, ...}) --DynamicSampler-->
    kept groups --build_actor_batch--> ActorBatch(tokens, loss_mask, response_mask, advantages, engine_logp)

Group payloads hold only lists, ints, strings and tensors, so they can be gathered across ranks and stored in a
weights_only checkpoint (surplus carry-over).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch

from megatron_dapo.algorithms import Group
from megatron_dapo.algorithms import group_normalized_advantages
from megatron_dapo.algorithms import soft_overlong_penalty
from megatron_dapo.batch import ActorBatch
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.metrics import response_metrics


def score_group(
    prompt_ids: list[int],
    completions: Sequence[Any],
    truth: str,
    texts: Sequence[str],
    verifier: Callable[[str, str], dict],
    algo: AlgorithmConfig,
    max_response_length: int,
    index: int,
) -> Group:
    """Score one prompt's G completions. Rewards are +1/-1 plus the soft overlong penalty (if enabled); admission
    by dynamic sampling uses `accs`, the verifier's accuracy, never the shaped reward."""
    scores = [verifier(text, truth) for text in texts]
    lengths = torch.tensor([len(c.response_ids) for c in completions], dtype=torch.int64)
    penalties = torch.zeros(len(completions))
    if algo.overlong_penalty:
        penalties = soft_overlong_penalty(
            lengths,
            max_response_length=max_response_length,
            overlong_buffer=algo.overlong_buffer,
            penalty_factor=algo.overlong_penalty_factor,
        )
    payload = {
        "index": index,
        "prompt_ids": list(prompt_ids),
        "responses": [list(c.response_ids) for c in completions],
        "finish": [c.finish_reason for c in completions],
        "engine_logp": [c.response_logprobs for c in completions]
        if all(c.response_logprobs is not None for c in completions)
        else None,
        "rewards": torch.tensor([s["score"] for s in scores], dtype=torch.float32) + penalties,
        "penalties": penalties,
        "lengths": lengths,
        "truth": str(truth),
    }
    return Group(accs=torch.tensor([bool(s["acc"]) for s in scores]), payload=payload)


def group_to_state(group: Group) -> dict[str, Any]:
    return {"accs": group.accs, "payload": group.payload}


def group_from_state(state: dict[str, Any]) -> Group:
    return Group(accs=state["accs"], payload=state["payload"])


def sampled_response_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward/length statistics over every response sampled in a step (kept or not)."""
    if not groups:
        return {}
    cat = lambda key: torch.cat([g.payload[key] for g in groups])  # noqa: E731
    truncated = torch.tensor([f == "length" for g in groups for f in g.payload["finish"]])
    return response_metrics(
        cat("lengths"), truncated, cat("rewards"), torch.cat([g.accs for g in groups]), cat("penalties")
    )


def build_actor_batch(groups: Sequence[Group], algo: AlgorithmConfig, pad_token_id: int) -> ActorBatch:
    """Pack kept groups into one right-padded ActorBatch with group-normalised advantages.

    loss_mask covers response tokens (EOS included), zeroed for truncated responses under overlong filtering.
    """
    rows, adv, engine_rows, filtered = [], [], [], []
    for group in groups:
        p = group.payload
        adv.append(group_normalized_advantages(p["rewards"], len(p["responses"]), eps=algo.adv_eps))
        for i, response in enumerate(p["responses"]):
            rows.append((p["prompt_ids"], response))
            engine_rows.append(None if p["engine_logp"] is None else p["engine_logp"][i])
            filtered.append(algo.overlong_filtering and p["finish"][i] == "length")
    seq_len = max(len(a) + len(b) for a, b in rows)
    num = len(rows)
    tokens = torch.full((num, seq_len), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros(num, seq_len)
    engine_logp = torch.zeros(num, seq_len) if all(e is not None for e in engine_rows) else None
    for r, (prompt, response) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(response)
        tokens[r, :start] = torch.tensor(prompt)
        tokens[r, start:end] = torch.tensor(response)
        response_mask[r, start:end] = 1.0
        if engine_logp is not None:
            engine_logp[r, start:end] = torch.tensor(engine_rows[r], dtype=torch.float32)
    keep = torch.tensor([0.0 if f else 1.0 for f in filtered])
    return ActorBatch(
        tokens=tokens,
        loss_mask=response_mask * keep[:, None],
        response_mask=response_mask,
        advantages=torch.cat(adv),
        engine_logp=engine_logp,
    )


def apply_rollout_correction(batch: ActorBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """Apply algorithm.rollout_correction to a batch whose old_logp is filled in, in place; returns its metrics.

    Runs once on the whole batch (the same on every rank) before `MegatronActor.update`, so the MIS rejection is
    already in loss_mask when the actor counts the global denominator D of each mini-batch: every micro-batch and
    data-parallel rank sees the same corrected mask. Sets batch.is_weight for "tis" / "mis"; "none" leaves the batch
    untouched. Metrics (floats, keys "rollout_corr/*") are those of `algorithms.rollout_correction.rollout_correction`;
    a batch without engine log-probs has none, and is an error when a correction is asked for.
    """
    from megatron_dapo.algorithms.rollout_correction import rollout_correction  # noqa: PLC0415

    if batch.engine_logp is None:
        if algo.rollout_correction != "none":
            raise ValueError(
                f"algorithm.rollout_correction={algo.rollout_correction!r}: the engine returned no log-probs "
                "(rollout.compare_logprobs must be true and the engine must support them)"
            )
        return {}
    if batch.old_logp is None:
        raise ValueError("apply_rollout_correction: batch.old_logp is None; call MegatronActor.compute_logprobs first")
    result = rollout_correction(
        batch.old_logp,
        batch.engine_logp,
        batch.loss_mask,
        mode=algo.rollout_correction,
        level=algo.rollout_correction_level,
        is_threshold=algo.rollout_is_threshold,
        mis_low=algo.rollout_mis_low,
        mis_high=algo.rollout_mis_high,
    )
    if result.weights is not None:
        batch.loss_mask = result.mask
        batch.is_weight = result.weights
    return {key: float(value) for key, value in result.metrics.items()}
