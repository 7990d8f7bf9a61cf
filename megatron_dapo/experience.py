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
