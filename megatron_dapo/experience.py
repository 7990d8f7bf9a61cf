"""From rollouts to a training batch: scoring (verifier + overlong shaping), advantages, and the ActorBatch.

    G Rollouts --score_group--> RolloutGroup (rewards, accs) on the generating rank --summary--> GroupSummary
    kept GroupSummaries (every rank) --batch_advantages / row_lengths--> advantages, keep, the RowPlan
    each row's Rollout (sent by its owner to the DP rank that trains it) --rows_to_batch--> ActorBatch

Data-parallel routing (the trainer): the token rows of a group stay on the rank that generated it until the row
plan (`packing.RowPlan`, from summaries' lengths) says which DP rank trains each row; only then are they sent,
each row to the ranks of that DP rank (`rows_to_batch` builds their local ActorBatch).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.actor.packing import row_lengths as packed_row_lengths
from megatron_dapo.algorithms import group_normalized_advantages
from megatron_dapo.algorithms import overlong_filter_mask
from megatron_dapo.algorithms import soft_overlong_penalty
from megatron_dapo.batch import ActorBatch
from megatron_dapo.batch import RoutedExperts
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.envs.base import EPISODE_COUNTS
from megatron_dapo.envs.base import STOPS
from megatron_dapo.envs.base import SingleTurn
from megatron_dapo.metrics import Stat
from megatron_dapo.metrics import Stats
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import merge_stats
from megatron_dapo.metrics import mismatch_stats
from megatron_dapo.metrics import response_metrics
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GroupSummary
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup


def score_group(
    position: int,
    index: int,
    truth: str,
    rollouts: Sequence[Rollout],
    scores: Sequence[Mapping[str, Any]],
    algo: AlgorithmConfig,
    max_response_length: int,
) -> RolloutGroup:
    """Score one prompt's G finished rollouts (scores: each one's verifier result, {"score": +1 / -1, "acc", ...}).
    Rewards are +1/-1 plus the soft overlong penalty (if enabled) of the model's tokens (a multi-turn trajectory's
    observation tokens do not count); admission by dynamic sampling uses `accs`, the verifier's accuracy, never the
    shaped reward. A multi-turn environment's counts in the scores (EPISODE_COUNTS) and the observation tokens of
    each trajectory become RolloutGroup.episodes."""
    lengths = torch.tensor([r.model_tokens for r in rollouts], dtype=torch.int64)
    penalties = torch.zeros(len(rollouts))
    if algo.overlong_penalty:
        penalties = soft_overlong_penalty(
            lengths,
            max_response_length=max_response_length,
            overlong_buffer=algo.overlong_buffer,
            penalty_factor=algo.overlong_penalty_factor,
        )
    return RolloutGroup(
        index=int(index),
        position=int(position),
        truth=str(truth),
        rollouts=list(rollouts),
        accs=torch.tensor([bool(s["acc"]) for s in scores]),
        rewards=torch.tensor([s["score"] for s in scores], dtype=torch.float32) + penalties,
        penalties=penalties,
        episodes=episode_counts(rollouts, scores),
    )


def episode_counts(rollouts: Sequence[Rollout], scores: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """name -> [G] fp32: each EPISODE_COUNTS value a multi-turn episode reported (0 where absent), the
    trajectory's observation tokens and "stop/<reason>" (1 for the reason it ended, envs.base.STOPS); {} when no score
    came from a multi-turn episode (no "tool_calls")."""
    if not any("tool_calls" in s for s in scores):
        return {}
    out = {name: torch.tensor([float(s.get(name, 0)) for s in scores]) for name in EPISODE_COUNTS}
    out["observation_tokens"] = torch.tensor([float(len(r) - r.model_tokens) for r in rollouts])
    for stop in STOPS:
        out[f"stop/{stop}"] = torch.tensor([float(s.get("stop") == stop) for s in scores])
    return out


class GroupScorer:
    """Scores a finished group on the rank that generated it: the overlong shaping of `algo` (score_group) over
    each response's outcome. The rollout stream's `score` hook.

    environment: the run's (envs/base.py; default the single-turn verifier, decoding with `tokenizer`). A single-turn
    environment scores each response here; a multi-turn one (`multi_turn`) was driven turn by turn by the stream,
    which left each trajectory's outcome (its final Turn's reward and details) in Rollout.episode.
    """

    def __init__(
        self, tokenizer: Any, verifier: Callable[[str, str], dict], algo: AlgorithmConfig, max_response: int,
        environment: Any = None,
    ) -> None:  # fmt: skip
        self.tokenizer, self.verifier, self.algo, self.max_response = tokenizer, verifier, algo, max_response
        self.environment = environment or SingleTurn(tokenizer=tokenizer, verifier=verifier)

    def __call__(self, position: int, index: int, truth: str, rollouts: list[Rollout]) -> RolloutGroup:
        if not self.environment.multi_turn:
            scores = [self.environment.episode(truth).step(r.response_ids).details for r in rollouts]
        else:
            missing = [k for k, r in enumerate(rollouts) if not (r.episode and "outcome" in r.episode)]
            if missing:
                raise RuntimeError(f"example {index}: multi-turn responses {missing} finished without an outcome")
            scores = [r.episode["outcome"]["details"] for r in rollouts]
        return score_group(position, index, truth, rollouts, scores, self.algo, self.max_response)


def row_index(groups: Sequence[GroupSummary]) -> list[tuple[int, int]]:
    """(group position in the batch, response index) of every row of the training batch, in batch order."""
    return [(g, i) for g, group in enumerate(groups) for i in range(group.group_size)]


def row_lengths(groups: Sequence[GroupSummary]) -> list[int]:
    """Per batch row, its length as the actor counts it (`packing.row_lengths`: prompt + response tokens)."""
    prompts = [g.prompt_len for g in groups for _ in range(g.group_size)]
    return packed_row_lengths(prompts, torch.cat([g.lengths for g in groups]).tolist() if groups else [])


def batch_advantages(
    groups: Sequence[GroupSummary], algo: AlgorithmConfig, std_normalize: bool = True
) -> tuple[Tensor, Tensor]:
    """(advantages [B] fp32 group-normalised per group, keep [B] fp32: 0 for overlong-filtered rows).

    std_normalize: the policy loss's choice (`loss.std_normalize`; False for Dr. GRPO: A = R - mean)."""
    if not groups:
        return torch.zeros(0), torch.zeros(0)
    adv = torch.cat([group_normalized_advantages(g.rewards, g.group_size, algo.adv_eps, std_normalize) for g in groups])
    keep = torch.ones(len(adv))
    if algo.overlong_filtering:
        keep = overlong_filter_mask([f.value for g in groups for f in g.finish])
    return adv, keep


def rows_to_batch(
    rows: Sequence[tuple[Rollout, int]], advantages: Tensor, keep: Tensor, pad_token_id: int
) -> ActorBatch:
    """A right-padded ActorBatch of (rollout, group id) rows; rows of one group share their prompt.

    advantages, keep: [B] fp32 (keep 0 zeroes the row's loss_mask: overlong filtering). S = the longest row.
    response_mask (and so loss_mask) is 0 on a multi-turn trajectory's observation tokens (Rollout.observations):
    the model did not sample them. engine_logp is filled when every row has engine log-probs.
    """
    num = len(rows)
    seq_len = max((r.prompt_ids.numel() + len(r) for r, _ in rows), default=1)
    tokens = torch.full((num, seq_len), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros(num, seq_len)
    with_engine = all(r.engine_logp is not None for r, _ in rows)  # an empty batch keeps the [0, S] tensor
    engine_logp = torch.zeros(num, seq_len) if with_engine else None
    for b, (r, _) in enumerate(rows):
        start, end = r.prompt_ids.numel(), r.prompt_ids.numel() + len(r)
        tokens[b, :start] = r.prompt_ids
        tokens[b, start:end] = r.response_ids
        response_mask[b, start:end] = r.model_mask().to(response_mask.dtype)  # observation tokens: 0
        if engine_logp is not None:
            engine_logp[b, start:end] = r.engine_logp
    return ActorBatch(
        tokens=tokens,
        loss_mask=response_mask * keep[:, None],
        response_mask=response_mask,
        advantages=advantages.to(torch.float32),
        engine_logp=engine_logp,
        group_ids=torch.tensor([g for _, g in rows], dtype=torch.int64),
        prompt_lengths=torch.tensor([r.prompt_ids.numel() for r, _ in rows], dtype=torch.int64),
        routed_experts=_routed_experts([r for r, _ in rows]),
    )


def _routed_experts(rollouts: Sequence[Rollout]) -> RoutedExperts | None:
    """The engines' routing of every row (Rollout.routed_experts: prompt + response positions but the last token,
    which no engine feeds; the actor routes it to experts 0..k-1, its output feeds no used log-prob). None unless
    every row has one."""
    if not rollouts or any(r.routed_experts is None for r in rollouts):
        return None
    return RoutedExperts.from_rows([r.routed_experts for r in rollouts])


def sampled_response_metrics(groups: Sequence[GroupSummary]) -> dict[str, float]:
    """Reward/length statistics over every response decided in a step (kept or not)."""
    if not groups:
        return {}
    cat = lambda key: torch.cat([getattr(g, key) for g in groups])
    truncated = torch.tensor([f is FinishReason.LENGTH for g in groups for f in g.finish])
    out = response_metrics(cat("lengths"), truncated, cat("rewards"), cat("accs"), cat("penalties"))
    with_episodes = [g for g in groups if g.episodes]
    if with_episodes:
        counts = {name: torch.cat([g.episodes[name] for g in with_episodes]) for name in with_episodes[0].episodes}
        out.update(episode_metrics(counts, torch.cat([g.rewards for g in with_episodes])))
    return out


def episode_metrics(counts: Mapping[str, Tensor], rewards: Tensor) -> dict[str, float]:
    """The multi-turn metrics of a step's decided responses: "episode/<count>" means (turns, tool calls, errors,
    timeouts, tool seconds, observation tokens; "episode/stop/<reason>": the share that ended so) and the mean reward
    by number of tool calls
    ("episode/reward_by_tool_calls/0", "/1", "/2+"; a bucket with no response is left out)."""
    out = {f"episode/{name}": float(values.float().mean()) for name, values in counts.items()}
    calls = counts["tool_calls"]
    for label, chosen in (("0", calls == 0), ("1", calls == 1), ("2+", calls >= 2)):
        if bool(chosen.any()):
            out[f"episode/reward_by_tool_calls/{label}"] = float(rewards[chosen].float().mean())
    return out


def batch_stats(batch: ActorBatch, entropy: Tensor | None, correction: Stats, *, mismatch: bool = True) -> Stats:
    """One rank's batch metrics as Stats (merge them over DP ranks): valid-token count (after rollout correction),
    the old-log-prob pass's entropy (None: no such pass, old_logp_source engine; the update's entropy stands), the
    engine/actor log-prob mismatch (mismatch False: old_logp is the engine's own) and the rollout correction's own
    Stats (`correction`)."""
    mask = batch.response_mask
    local: Stats = {"train/valid_tokens": Stat.sum(float(batch.loss_mask.sum()))}
    if entropy is not None:
        local["actor/entropy"] = Stat.mean(float((entropy * mask).sum()), float(mask.sum()))
    if batch.engine_logp is not None and mismatch:
        local.update(mismatch_stats(batch.old_logp, batch.engine_logp, mask))
    local.update(correction)
    return local


def gathered_batch_stats(
    gather: Callable[[list[Stats]], list[Stats]],
    batch: ActorBatch,
    entropy: Tensor | None,
    correction: Stats,
    *,
    contributes: bool,
    mismatch: bool = True,
) -> dict[str, float]:
    """`batch_stats` over the whole batch: each DP rank's Stats (contributes: this rank is the one of its model-
    parallel group that does) gathered from every rank (`gather`: the rollout exchange's all_gather) and merged."""
    local = [batch_stats(batch, entropy, correction, mismatch=mismatch)] if contributes else []
    return finalize(merge_stats(gather(local)))


def engine_old_logp(batch: ActorBatch) -> Tensor:
    """pi_old taken from the engine (algorithm.old_logp_source "engine"): the batch's engine log-probs, [B, S] float32,
    zero outside the responses like the actor's old-log-prob pass. ValueError when the engine returned none."""
    if batch.engine_logp is None:
        raise ValueError(
            "algorithm.old_logp_source=engine: the engine returned no log-probs for this batch "
            "(rollout.compare_logprobs must be true and the engine must support them)"
        )
    return batch.engine_logp.float() * batch.response_mask


def apply_rollout_correction(batch: ActorBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """Apply algorithm.rollout_correction to a batch whose old_logp is filled in, in place; returns its metrics.

    Runs before `MegatronActor.update` (in the trainer on each DP rank's rows: weights and masks are per row), so the
    MIS rejection is already in loss_mask when the actor counts the global denominator D of each mini-batch: every
    micro-batch and data-parallel rank sees the same corrected mask. Sets batch.is_weight for "tis" / "mis"; "none"
    leaves the batch untouched. Metrics (floats, keys "rollout_corr/*") are those of
    `algorithms.rollout_correction.rollout_correction`; a batch without engine log-probs has none, and is an error
    when a correction is asked for.
    """
    from megatron_dapo.algorithms.rollout_correction import rollout_correction

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


# How each "rollout_corr/*" metric of one batch combines over data-parallel ranks: a mean weighted by the valid tokens
# of the loss mask before correction ("tokens"), the responses with one ("rows") or the tokens kept after it ("kept"),
# or the maximum ("max"). A key not listed is a token mean.
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


def rollout_correction_parts(batch: ActorBatch, algo: AlgorithmConfig) -> Stats:
    """`apply_rollout_correction` on one rank's rows (in place: the correction is per row, so each row gets what the
    whole batch would give it) -> its metrics as Stats (ROLLOUT_CORR_COMBINE); merged over the ranks
    (`megatron_dapo.metrics.merge_stats`) they equal the metrics of the whole batch at once."""
    valid = batch.loss_mask != 0
    weights = {"tokens": float(valid.sum()), "rows": float(valid.any(dim=-1).sum())}
    metrics = apply_rollout_correction(batch, algo)
    weights["kept"] = float((batch.loss_mask != 0).sum())
    out: Stats = {}
    for key, value in metrics.items():
        kind = ROLLOUT_CORR_COMBINE.get(key, "tokens")
        out[key] = Stat.max(value) if kind == "max" else Stat.mean(value * weights[kind], weights[kind])
    return out
