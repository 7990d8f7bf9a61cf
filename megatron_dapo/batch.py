"""The training batch handed from the trainer to the actor (no megatron import).

Token alignment: position t of every [B, S] tensor refers to the token tokens[:, t], predicted from tokens[:, :t].
Position 0 is never a response token, so log-prob tensors hold 0 there.

    tokens       [p p p p r r r r EOS pad pad]
    loss_mask    [0 0 0 0 1 1 1 1  1   0   0 ]   response tokens incl. EOS (0 for overlong-filtered responses)
    old_logp     [0 0 0 0 x x x x  x   0   0 ]   actor log-probs before the update (recomputed, not the engine's)
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields

import torch
from torch import Tensor


@dataclass
class ActorBatch:
    """Sequences for the actor; all tensors share the leading dim B (responses) and S (padded length).

    tokens: [B, S] int64, prompt + response, right-padded with pad_token_id.
    loss_mask: [B, S] float32, 1 on response tokens trained on.
    response_mask: [B, S] float32, 1 on every response token (for entropy/length metrics even when filtered).
    advantages: [B] float32, constant over a response's tokens.
    old_logp: [B, S] float32 or None until the actor fills it.
    engine_logp: [B, S] float32 or None; the rollout engine's sampling log-probs (mismatch metrics; the input of
        the rollout correction).
    is_weight: [B, S] float32 or None; rollout-correction importance weights multiplying each token's policy loss
        (algorithm.rollout_correction "tis" / "mis", set by the trainer before the update; None: no correction).
    ref_logp: [B, S] float32 or None; a frozen reference model's log-probs (losses with a KL term,
        `algorithms.policy_loss.uses_reference`; filled by the trainer before the update).
    group_ids: [B] int64 or None; rows with one id are the responses of one prompt (they share tokens[:P]). The
        trainer always sets it; None: every row its own group (actor.shared_prefix then shares nothing).
    prompt_lengths: [B] int64 or None; P per row (its prompt is tokens[:P]). None: the column of the row's first
        response token (`packing.prompt_lengths`).
    """

    tokens: Tensor
    loss_mask: Tensor
    response_mask: Tensor
    advantages: Tensor
    old_logp: Tensor | None = None
    engine_logp: Tensor | None = None
    is_weight: Tensor | None = None
    ref_logp: Tensor | None = None
    group_ids: Tensor | None = None
    prompt_lengths: Tensor | None = None

    def __post_init__(self) -> None:
        b, s = self.tokens.shape
        for name in ("loss_mask", "response_mask", "old_logp", "engine_logp", "is_weight", "ref_logp"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, s):
                raise ValueError(f"ActorBatch.{name}: expected shape {(b, s)}, got {tuple(value.shape)}")
        for name in ("advantages", "group_ids", "prompt_lengths"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b,):
                raise ValueError(f"ActorBatch.{name}: expected shape {(b,)}, got {tuple(value.shape)}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: Tensor | slice) -> ActorBatch:
        """Rows `index` of every tensor (micro-batching, data-parallel sharding)."""
        return ActorBatch(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index] for f in fields(self)}
        )

    def num_valid_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device | str) -> ActorBatch:
        return ActorBatch(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in fields(self)
            }
        )
