"""The actor's rows and micro-batches: which rows of a batch each data-parallel rank trains (`row_plan`,
`local_rows`), how a rank's rows are cut into micro-batches (`cut`: a token budget or a row count, packed or padded,
prompt groups kept together under a shared prefix) and the token counts of the passes (`pop_token_stats`).

MegatronActor owns one MicroBatcher; the trainer builds the same row plan from the response lengths (RowPlan.build)
to send each data-parallel rank only its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.actor.packing import PackedLayout
from megatron_dapo.actor.packing import RowPlan
from megatron_dapo.actor.packing import SharedPrefixLayout
from megatron_dapo.actor.packing import micro_batch_rows
from megatron_dapo.actor.packing import prompt_groups
from megatron_dapo.actor.packing import prompt_lengths
from megatron_dapo.actor.packing import sequence_lengths
from megatron_dapo.actor.packing import shared_prefix_micro_batches
from megatron_dapo.batch import ActorBatch


@dataclass
class MicroBatch:
    """One micro-batch of a pass: its rows (ids into the pass's batch), the rows cut to their longest length
    (width rounded up to `multiple`), and the packed layout when actor.packing is on (a SharedPrefixLayout when
    actor.shared_prefix is also on)."""

    rows: list[int]
    batch: ActorBatch
    layout: PackedLayout | SharedPrefixLayout | None

    @property
    def computed_tokens(self) -> int:
        return self.layout.num_tokens if self.layout is not None else self.batch.tokens.numel()


def _cut_columns(batch: ActorBatch, width: int) -> ActorBatch:
    """Every [B, S] tensor cut (or zero-padded) to [B, width]; advantages unchanged."""

    def cut(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.dim() != 2:
            return t
        if t.shape[1] >= width:
            return t[:, :width]
        return torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], dim=1)

    return ActorBatch(**{f.name: cut(getattr(batch, f.name)) for f in fields(batch)})


def _prompt_layout(batch: ActorBatch, lengths: list[int]) -> tuple[list[int], Tensor]:
    """(per row P clamped to [1, length], group ids [B]) from the batch's group_ids / prompt_lengths; without them
    P is the first response column and every row is its own group (nothing is shared)."""
    if batch.prompt_lengths is None:
        prompts = prompt_lengths(batch.response_mask, lengths)
    else:
        prompts = [min(max(int(p), 1), n) for p, n in zip(batch.prompt_lengths.tolist(), lengths, strict=True)]
    ids = batch.group_ids if batch.group_ids is not None else torch.arange(len(batch), dtype=torch.int64)
    return prompts, ids.cpu()


class MicroBatcher:
    """Row placement and micro-batching of the actor's passes (module docstring).

    config: the RunConfig (actor.packing / shared_prefix / max_tokens_per_microbatch, trainer.micro_batch_size,
    mini-batch rows). groups: the actor's ParallelGroups. sequence_parallel: megatron's sequence parallel is on
    (packed lengths and widths are then multiples of the TP size).
    """

    def __init__(self, config: Any, groups: Any, *, sequence_parallel: bool) -> None:
        self.config, self.groups, self.sequence_parallel = config, groups, sequence_parallel
        self._tokens = [0, 0, 0]  # rows' / computed / held (computed minus padding) tokens since pop_token_stats

    def row_plan(self, batch: ActorBatch) -> RowPlan:
        """The placement of a full batch's rows over DP ranks (`packing.RowPlan`): mini-batches of
        trainer.mini_batch_prompts * algorithm.group_size rows, each balanced by tokens. The trainer builds the same
        plan from response lengths (`RowPlan.build`) to send each DP rank only its rows."""
        lengths = sequence_lengths(batch.response_mask).tolist()
        return RowPlan.build(lengths, self.groups.dp_size, self.config.mini_batch_rows)

    def local_rows(self, batch: ActorBatch, plan: RowPlan | None, where: str) -> tuple[ActorBatch, RowPlan]:
        """(this DP rank's rows, the plan): selected from a full batch (plan None) or checked (batch already local)."""
        if plan is None:
            plan = self.row_plan(batch)
            return batch.select(torch.tensor(plan.rows_of(self.groups.dp_rank), dtype=torch.int64)), plan
        if plan.dp_size != self.groups.dp_size:
            raise ValueError(
                f"MegatronActor.{where}: plan is for dp_size {plan.dp_size}, actor has {self.groups.dp_size}"
            )
        expected = len(plan.rows_of(self.groups.dp_rank))
        if len(batch) != expected:
            raise ValueError(
                f"MegatronActor.{where}: with plan=..., batch must hold this DP rank's {expected} rows "
                f"(plan.rows_of({self.groups.dp_rank})), got {len(batch)}"
            )
        return batch, plan

    def cut(self, batch: ActorBatch) -> list[MicroBatch]:
        """Cut this rank's rows (all of `batch`) into micro-batches (actor.max_tokens_per_microbatch, else
        trainer.micro_batch_size rows; packed when actor.packing; prompt groups kept together and laid out with a
        shared prefix when actor.shared_prefix). Without rows, one dummy micro-batch (zero masks) so the pipeline
        and the gradient all-reduce still happen. Token counts go to `pop_token_stats`."""
        a = self.config.actor
        lengths = sequence_lengths(batch.response_mask).tolist()
        # Under sequence parallel the sequence is split over TP ranks: packed lengths / widths are multiples of tp.
        multiple = self.groups.tp_size if self.sequence_parallel else 1
        shared = a.packing and a.shared_prefix
        rows_per_mb = self.config.trainer.micro_batch_size
        if shared:
            prompts, group_ids = _prompt_layout(batch, lengths)
            groups = prompt_groups(group_ids, list(range(len(batch))))
            cut = shared_prefix_micro_batches(
                lengths, prompts, groups, max_tokens=a.max_tokens_per_microbatch, rows_per_micro_batch=rows_per_mb
            )
        else:
            cut = micro_batch_rows(
                lengths,
                list(range(len(batch))),
                max_tokens=a.max_tokens_per_microbatch,
                rows_per_micro_batch=rows_per_mb,
                packed=a.packing,
            )
        micro = []
        for rows in cut:
            width = max(lengths[i] for i in rows)
            sub = _cut_columns(batch.select(torch.tensor(rows)), -(-width // multiple) * multiple)
            lens = torch.tensor([lengths[i] for i in rows], dtype=torch.int64)
            micro.append(MicroBatch(rows=rows, batch=sub, layout=self._layout(sub, lens, multiple)))
            self._tokens[0] += int(lens.sum())
        if not micro:
            width = -(-2 // multiple) * multiple
            zeros = torch.zeros(1, width)
            dummy = ActorBatch(
                tokens=torch.zeros(1, width, dtype=torch.int64),
                loss_mask=zeros,
                response_mask=zeros.clone(),
                advantages=torch.zeros(1),
                old_logp=None if batch.old_logp is None else zeros.clone(),
            )
            lens = torch.tensor([width], dtype=torch.int64)
            micro.append(MicroBatch(rows=[], batch=dummy, layout=self._layout(dummy, lens, multiple)))
        for m in micro:
            self._tokens[1] += m.computed_tokens
            if isinstance(m.layout, SharedPrefixLayout):
                self._tokens[2] += m.layout.num_real
            elif m.rows:
                self._tokens[2] += int(sequence_lengths(m.batch.response_mask).sum())
        return micro

    def _layout(self, sub: ActorBatch, lens: Tensor, multiple: int) -> PackedLayout | SharedPrefixLayout | None:
        """The micro-batch's layout: None (padded), PackedLayout (actor.packing) or SharedPrefixLayout."""
        if not self.config.actor.packing:
            return None
        if self.config.actor.shared_prefix:
            prompts, group_ids = _prompt_layout(sub, lens.tolist())
            return SharedPrefixLayout.build(sub.tokens, lens, prompts, group_ids, multiple)
        return PackedLayout.build(sub.tokens, lens, multiple)

    def pop_token_stats(self) -> dict[str, float]:
        """Token counts of the actor's passes since the last call, summed over data-parallel ranks; resets them.
        Collective over dp_group.

        Returns:
            {"real_tokens": the rows' prompt + response tokens (each row counted whole), "computed_tokens": the
            tokens the model ran (with padding; with actor.shared_prefix each prompt once per micro-batch),
            "pad_fraction": 1 - held / computed where held = computed tokens that are not padding,
            "shared_fraction": 1 - held / real, the share of the rows' tokens not recomputed thanks to
            actor.shared_prefix (0 without it)}.
        """
        counts = torch.tensor(self._tokens, dtype=torch.float64, device=self.groups.device)
        dist.all_reduce(counts, group=self.groups.dp_group)
        self._tokens = [0, 0, 0]
        real, computed, held = float(counts[0]), float(counts[1]), float(counts[2])
        return {
            "real_tokens": real,
            "computed_tokens": computed,
            "pad_fraction": 1.0 - held / max(computed, 1.0),
            "shared_fraction": 1.0 - held / max(real, 1.0),
        }
