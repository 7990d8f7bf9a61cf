"""One pass of micro-batches through the actor's pipeline: megatron's schedule (get_forward_backward_func) over the
model chunks, with the actor's forward step (padded, packed or shared-prefix inputs; logits or hidden states out;
MoE routing recorded or replayed per micro-batch).

    run(micro, make_loss, forward_only, hidden)
      for each micro-batch mb, on every stage: the stage's input -> model -> on the last stage logits [b, S, V/tp]
      (hidden: final hidden states [b, S, H], gathered over TP under sequence parallel) -> make_loss(mb)(output)
      -> megatron's schedule returns what each loss function returned (last stage), backward unless forward_only
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_attr_wrapped_model
from torch import Tensor

from megatron_dapo.actor.distributed import ParallelGroups
from megatron_dapo.actor.micro_batches import MicroBatch
from megatron_dapo.actor.packing import SharedPrefixLayout
from megatron_dapo.actor.packing import sequence_lengths
from megatron_dapo.actor.routing import RoutingReplay
from megatron_dapo.actor.routing import routing_by_row


class PipelineSchedule:
    """Runs micro-batches through the model chunks with megatron's pipeline schedule (collective over the job).

    Args:
        model: the model chunks (DDP / Float16Module wrapped, or the bare GPTModel of a frozen reference).
        tf_config: the model's TransformerConfig (dtype, sequence parallel).
        groups: this rank's process groups.
        routing: the MoE routers' replay (actor.routing_replay), or None.
    """

    def __init__(self, model: list[Any], tf_config: Any, groups: ParallelGroups, routing: RoutingReplay | None) -> None:
        self.model = model
        self.tf_config = tf_config
        self.groups = groups
        self.routing = routing
        self.device = groups.device

    def unwrapped(self) -> torch.nn.Module:
        """The GPTModel inside the DDP / Float16Module wrappers."""
        return get_attr_wrapped_model(self.model[0], "decoder", return_model_obj=True)

    def output_weight(self, hidden: bool) -> Tensor | None:
        """The LM-head weight [V_local, H] of the last stage when log-probs take hidden states (hidden), else None:
        the tied embedding when embeddings are shared (megatron's copy of it on a PP>1 last stage), else the output
        layer's weight."""
        if not (hidden and self.groups.is_last_stage):
            return None
        gpt = self.unwrapped()
        if gpt.share_embeddings_and_output_weights:
            return gpt.shared_embedding_or_output_weight()
        return gpt.output_layer.weight

    def run(
        self,
        micro: list[MicroBatch],
        make_loss: Callable[[MicroBatch], Callable],
        *,
        forward_only: bool,
        hidden: bool,
        recorded: dict[int, Tensor] | None = None,
    ) -> list[Any]:
        """One pass over `micro` (the same number of micro-batches on every rank of a model-parallel group).

        Args:
            make_loss: builds a micro-batch's loss function (megatron's forward_step contract: output -> (loss,
                dict)).
            forward_only: no backward (log-prob passes).
            hidden: the last stage returns final hidden states [b, S, H] instead of logits.
            recorded: (MoE routing record, R2) filled with each micro-batch row's routed experts
                {row: [n, layers, k]}; None replays a micro-batch's routed_experts when it has them.
        Returns:
            on the last pipeline stage the loss functions' dicts, one per micro-batch; [] elsewhere.
        """
        # variable_seq_lengths is on (model.py): micro-batches of different widths / packed lengths exchange their
        # shapes between pipeline stages, so seq_length / micro_batch_size here are only the first one's.
        first = micro[0]
        width = first.layout.num_tokens if first.layout is not None else first.batch.tokens.shape[1]
        rows = 1 if first.layout is not None else len(first.batch)
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, make_loss, hidden, recorded),
                data_iterator=iter(micro),
                model=self.model,
                num_microbatches=len(micro),
                seq_length=width,
                micro_batch_size=rows,
                forward_only=forward_only,
            )
        finally:
            if self.routing is not None:
                self.routing.off()

    def from_last_stage(self, tensor: Tensor) -> Tensor:
        """Broadcast a tensor (same shape on every stage) from the last pipeline stage to the others."""
        if self.groups.pp_size > 1:
            dist.broadcast(tensor, src=self.groups.pp_ranks[-1], group=self.groups.pp_group)
        return tensor

    def _forward_step(
        self,
        make_loss: Callable[[MicroBatch], Callable],
        hidden: bool,
        recorded: dict[int, Tensor] | None,
        data_iterator: Iterator[MicroBatch],
        model: Any,
    ) -> tuple[Tensor, Callable]:
        """Megatron forward_step_func. Padded: [b, S] tokens -> on the last stage logits [b, S, V_local] (or hidden
        states [b, S, H]). Packed: one [1, T] row with cu_seqlens (PackedSeqParams, qkv_format "thd": attention and
        RoPE restart per sequence) -> [1, T, V_local] / [1, T, H]. Shared prefix: one [1, T] row in BSHD form with
        the layout's attention mask [1, 1, T, T] and RoPE positions, same outputs as packed. On other stages the
        stage's output [S, b, H] ([T, 1, H] packed / shared)."""
        mb = next(data_iterator)
        layout = mb.layout.to(self.device) if mb.layout is not None else None
        kwargs: dict[str, Any] = {"fp32_output": False} if self.tf_config.params_dtype != torch.float32 else {}
        attention_mask = None
        shared = isinstance(layout, SharedPrefixLayout)
        if shared:
            # One BSHD row (batch 1, no packed_seq_params): the prefix/branch structure goes in as the attention
            # mask (VarlenDotProductAttention) and RoPE is taken at the layout's per-token positions.
            tokens, position_ids = layout.tokens, layout.position_ids
            attention_mask = layout.attention_mask()
        elif layout is not None:
            tokens, position_ids = layout.tokens, layout.position_ids
            cu = layout.cu_seqlens.to(torch.int32)
            kwargs["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=layout.max_seqlen,
                max_seqlen_kv=layout.max_seqlen,
            )
        else:
            tokens = mb.batch.tokens.to(self.device, non_blocking=True)
            position_ids = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0).expand_as(tokens)
        hidden_out = hidden and self.groups.is_last_stage
        gpt = self.unwrapped()
        gpt.return_hidden = hidden_out  # scoped to this call: any other forward of the model returns logits
        gpt.rope_from_position_ids = shared
        replaying = self._route(mb, tokens.shape[1], recording=recorded is not None)
        try:
            output = model(tokens, position_ids, attention_mask, **kwargs)
        finally:
            gpt.return_hidden = False
            gpt.rope_from_position_ids = False
        if recorded is not None and self.routing is not None:
            lengths = sequence_lengths(mb.batch.response_mask).tolist() if mb.rows else []
            flat = self.routing.recorded()
            for row, routed in zip(mb.rows, routing_by_row(flat, layout, lengths, tokens.shape[1]), strict=True):
                recorded[row] = routed
        if replaying and output.requires_grad:
            output.register_hook(self.routing.backward_hook)
        if hidden_out:
            if self.tf_config.sequence_parallel and self.groups.tp_size > 1:
                # [S/tp, b, H] -> [S, b, H]. The fused op already all-reduces d(hidden) over tp_group (every rank
                # holds the full gradient), so the backward of the gather must only split, not reduce-scatter.
                output = gather_from_sequence_parallel_region(
                    output, tensor_parallel_output_grad=False, group=self.groups.tp_group
                )
            output = output.transpose(0, 1)  # [S, b, H] -> [b, S, H]
        return output, make_loss(mb)

    def _route(self, mb: MicroBatch, width: int, *, recording: bool) -> bool:
        """Set this stage's MoE routers for micro-batch `mb` (actor.routing_replay): record (an R2 old-log-prob pass),
        replay mb's routed_experts (this stage's layers of them), or route freely. Returns True when replaying."""
        if self.routing is None:
            return False
        if recording:
            self.routing.record()
            return False
        return self.routing.replay_rows(mb.batch.routed_experts if mb.rows else None, mb.layout, width, self.device)
