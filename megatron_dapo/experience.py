"""From completions to a training batch: scoring (verifier + overlong shaping), groups, and the ActorBatch.

    Completion x G --score_group--> Group(accs, payload{prompt, responses, rewards, ...}) --DynamicSampler-->
    kept groups --build_actor_batch--> ActorBatch(tokens, loss_mask, response_mask, advantages, engine_logp)

Group payloads hold only lists, ints, strings and tensors, so they can be gathered across ranks and stored in a
weights_only checkpoint (surplus carry-over).

Data-parallel routing (the trainer): a scored group is split (`split_group`) into a small summary that every rank
receives (accs, rewards, lengths, finish reasons, prompt length, owner rank: what dynamic sampling, advantages,
metrics and the row plan need) and its token rows (prompt, responses, engine log-probs), which stay in the
generating rank's `RolloutStore` until the row plan (`packing.RowPlan`) says which DP rank trains on each row; only
then are they sent, each row to the ranks of that DP rank (`rows_to_batch` builds their local ActorBatch).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

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


LIGHT_KEYS = ("index", "rewards", "penalties", "lengths", "finish")
HEAVY_KEYS = ("prompt_ids", "responses", "engine_logp", "truth")


def split_group(group: Group, owner: int, key: str) -> tuple[Group, dict[str, Any]]:
    """(summary, rows) of a scored group. The summary's payload keeps LIGHT_KEYS plus prompt_len, owner (the rank
    holding the rows) and key (its id in that rank's RolloutStore); rows holds HEAVY_KEYS, token ids as int32
    tensors (prompt [P], responses [L_i]) and engine log-probs as fp32 tensors [L_i] (or None)."""
    p = group.payload
    light = {k: p[k] for k in LIGHT_KEYS}
    light.update(prompt_len=len(p["prompt_ids"]), owner=int(owner), key=str(key))
    rows = {
        "prompt_ids": torch.tensor(p["prompt_ids"], dtype=torch.int32),
        "responses": [torch.tensor(r, dtype=torch.int32) for r in p["responses"]],
        "engine_logp": None
        if p["engine_logp"] is None
        else [torch.tensor(x, dtype=torch.float32) for x in p["engine_logp"]],
        "truth": p["truth"],
    }
    return Group(accs=group.accs, payload=light), rows


def join_group(summary: Group, rows: dict[str, Any]) -> Group:
    """The inverse of `split_group`: the full group (payload as `score_group` makes it)."""
    payload = {k: summary.payload[k] for k in LIGHT_KEYS}
    payload["prompt_ids"] = rows["prompt_ids"].tolist()
    payload["responses"] = [r.tolist() for r in rows["responses"]]
    payload["engine_logp"] = None if rows["engine_logp"] is None else [x.tolist() for x in rows["engine_logp"]]
    payload["truth"] = rows["truth"]
    return Group(accs=summary.accs, payload=payload)


class RolloutStore:
    """The token rows of the groups this rank generated, by key, until they are routed (or dropped)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rows: dict[str, dict[str, Any]] = {}
        self._count = 0

    def add(self, group: Group) -> Group:
        """Keep `group`'s rows here; return its summary (owner = this rank)."""
        self._count += 1
        summary, rows = split_group(group, self.rank, f"{self.rank}:{self._count}")
        self.rows[summary.payload["key"]] = rows
        return summary

    def retain(self, summaries: Sequence[Group]) -> None:
        """Drop every stored group whose summary is not in `summaries` (e.g. keep only the sampler's carry)."""
        keep = {g.payload["key"] for g in summaries}
        self.rows = {k: v for k, v in self.rows.items() if k in keep}


def row_index(groups: Sequence[Group]) -> list[tuple[int, int]]:
    """(group position, response index) of every row of the training batch, in batch order."""
    return [(g, i) for g, group in enumerate(groups) for i in range(len(group.payload["lengths"]))]


def row_lengths(groups: Sequence[Group]) -> list[int]:
    """Per batch row, prompt + response tokens: what `packing.sequence_lengths` gives for the built batch (a row
    without response tokens counts 2). Needs prompt_len (summaries) or prompt_ids (full groups)."""
    out = []
    for group in groups:
        p = group.payload
        prompt = p["prompt_len"] if "prompt_len" in p else len(p["prompt_ids"])
        out.extend(prompt + int(n) if int(n) > 0 else 2 for n in p["lengths"].tolist())
    return out


def batch_advantages(groups: Sequence[Group], algo: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """(advantages [B] fp32 group-normalised per group, keep [B] fp32: 0 for overlong-filtered rows)."""
    adv = [
        group_normalized_advantages(g.payload["rewards"], len(g.payload["lengths"]), eps=algo.adv_eps) for g in groups
    ]
    keep = [0.0 if algo.overlong_filtering and f == "length" else 1.0 for g in groups for f in g.payload["finish"]]
    return torch.cat(adv) if adv else torch.zeros(0), torch.tensor(keep, dtype=torch.float32)


def rows_to_batch(
    rows: Sequence[tuple[Sequence[int] | Tensor, Sequence[int] | Tensor, Sequence[float] | Tensor | None]],
    advantages: Tensor,
    keep: Tensor,
    pad_token_id: int,
) -> ActorBatch:
    """A right-padded ActorBatch of (prompt ids, response ids, engine log-probs or None) rows.

    advantages, keep: [B] fp32 (keep 0 zeroes the row's loss_mask: overlong filtering). S = the longest row.
    """
    num = len(rows)
    seq_len = max((len(a) + len(b) for a, b, _ in rows), default=1)
    tokens = torch.full((num, seq_len), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros(num, seq_len)
    with_engine = all(e is not None for _, _, e in rows)  # an empty batch keeps the [0, S] tensor
    engine_logp = torch.zeros(num, seq_len) if with_engine else None
    for r, (prompt, response, engine) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(response)
        tokens[r, :start] = torch.as_tensor(prompt, dtype=torch.int64)
        tokens[r, start:end] = torch.as_tensor(response, dtype=torch.int64)
        response_mask[r, start:end] = 1.0
        if engine_logp is not None:
            engine_logp[r, start:end] = torch.as_tensor(engine, dtype=torch.float32)
    return ActorBatch(
        tokens=tokens,
        loss_mask=response_mask * keep[:, None],
        response_mask=response_mask,
        advantages=advantages.to(torch.float32),
        engine_logp=engine_logp,
    )


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
    rows = []
    for group in groups:
        p = group.payload
        for i, response in enumerate(p["responses"]):
            rows.append((p["prompt_ids"], response, None if p["engine_logp"] is None else p["engine_logp"][i]))
    advantages, keep = batch_advantages(groups, algo)
    return rows_to_batch(rows, advantages, keep, pad_token_id)


def apply_rollout_correction(batch: ActorBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """Apply algorithm.rollout_correction to a batch whose old_logp is filled in, in place; returns its metrics.

    Runs before `MegatronActor.update` (in the trainer on each DP rank's rows: weights and masks are per row), so the
    MIS rejection is already in loss_mask when the actor counts the global denominator D of each mini-batch: every
    micro-batch and data-parallel rank sees the same corrected mask. Sets batch.is_weight for "tis" / "mis"; "none"
    leaves the batch untouched. Metrics (floats, keys "rollout_corr/*") are those of
    `algorithms.rollout_correction.rollout_correction`; a batch without engine log-probs has none, and is an error
    when a correction is asked for.
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


# How each "rollout_corr/*" metric of one batch combines over data-parallel ranks: the weight of its mean (valid
# tokens of the loss mask before correction, responses with one, tokens kept after it) or "max".
ROLLOUT_CORR_COMBINE = {
    "rollout_corr/kl_k1": "tokens",
    "rollout_corr/kl_k3": "tokens",
    "rollout_corr/truncated_fraction": "tokens",
    "rollout_corr/masked_fraction": "tokens",
    "rollout_corr/log_ppl_diff": "rows",
    "rollout_corr/log_ppl_abs_diff": "rows",
    "rollout_corr/masked_seq_fraction": "rows",
    "rollout_corr/is_weight_mean": "kept",
    "rollout_corr/ratio_max": "max",
    "rollout_corr/is_weight_max": "max",
}


def rollout_correction_parts(batch: ActorBatch, algo: AlgorithmConfig) -> tuple[dict[str, float], dict[str, float]]:
    """`apply_rollout_correction` on one rank's rows (in place: the correction is per row, so each row gets what the
    whole batch would give it) -> (its metrics, their weights {"tokens", "rows", "kept"}) for
    `combine_rollout_correction`."""
    valid = batch.loss_mask != 0
    weights = {"tokens": float(valid.sum()), "rows": float(valid.any(dim=-1).sum())}
    metrics = apply_rollout_correction(batch, algo)
    weights["kept"] = float((batch.loss_mask != 0).sum())
    return metrics, weights


def combine_rollout_correction(parts: Sequence[tuple[dict[str, float], dict[str, float]]]) -> dict[str, float]:
    """The batch's rollout-correction metrics from every DP rank's `rollout_correction_parts`: weighted means
    (ROLLOUT_CORR_COMBINE) and maxima, equal to the metrics of the whole batch at once."""
    out: dict[str, float] = {}
    for key in sorted({k for metrics, _ in parts for k in metrics}):
        kind = ROLLOUT_CORR_COMBINE.get(key, "tokens")
        values = [(metrics[key], weights) for metrics, weights in parts if key in metrics]
        if kind == "max":
            out[key] = max(v for v, _ in values)
        else:
            total = sum(w[kind] for _, w in values)
            out[key] = sum(v * w[kind] for v, w in values) / total if total > 0 else 0.0
    return out
