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
class RoutedExperts:
    """Per token of each row, the experts every MoE layer routed it to (actor.routing_replay): row i's tokens
    0..n_i-1 (prompt + response) are data[offsets[i]:offsets[i + 1]], [n_i, layers, k]. Ragged: no padding is stored.

    data: [N, layers, k] uint8 (<= 256 experts) or int16; offsets: [B + 1] int64. `layers` are the MoE layers of one
    pipeline stage (the actor records and replays per stage) or all of them (an engine's R3 routing). Stays on the
    CPU (`to` is the identity); the actor moves one micro-batch's indices at a time.
    """

    data: Tensor
    offsets: Tensor

    @classmethod
    def from_rows(cls, rows: list[Tensor], num_experts: int | None = None) -> RoutedExperts:
        """From per-row [n_i, layers, k] integer tensors (all with the same layers and k), stored as uint8 when
        num_experts <= 256 else int16 (None: the first row's dtype)."""
        if num_experts is None:
            dtype = rows[0].dtype if rows else torch.uint8
        else:
            dtype = torch.uint8 if num_experts <= 256 else torch.int16
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        data = torch.cat([r.to(dtype) for r in rows]) if rows else torch.zeros(0, 0, 0, dtype=dtype)
        return cls(data=data, offsets=offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> Tensor:
        """[n_i, layers, k] int64."""
        return self.data[int(self.offsets[i]) : int(self.offsets[i + 1])].long()

    def __getitem__(self, index: Tensor | slice) -> RoutedExperts:
        """Rows `index` (what ActorBatch.select does to every field)."""
        ids = list(range(len(self))[index]) if isinstance(index, slice) else index.reshape(-1).tolist()
        parts = [self.data[int(self.offsets[i]) : int(self.offsets[i + 1])] for i in ids]
        lengths = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        data = torch.cat(parts) if parts else self.data[:0]
        return RoutedExperts(data=data, offsets=offsets)

    def to(self, device: torch.device | str) -> RoutedExperts:
        del device
        return self


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
    routed_experts: RoutedExperts (B rows) or None; the experts to route each token to in the actor's MoE layers
        (actor.routing_replay: r2 records them in the old-log-prob pass, r3 takes the engine's).
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
    routed_experts: RoutedExperts | None = None

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
        if self.routed_experts is not None and len(self.routed_experts) != b:
            raise ValueError(f"ActorBatch.routed_experts: expected {b} rows, got {len(self.routed_experts)}")

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
