"""MegatronActor: the DAPO policy on Megatron-Core (log-probs, updates, weight export, checkpoint state).

    ActorBatch: the full batch (same on every rank), or only this DP rank's rows with their RowPlan (plan=...)
        |   row_plan / packing.RowPlan: mini-batches (mini_batch_prompts x group_size rows), each split over DP by
        |   tokens; DP rank d holds plan.rows_of(d) for BOTH passes (the trainer sends each DP rank only those rows)
        |-- compute_logprobs --> this rank's rows --> forward-only pipeline schedule --> logp/entropy on the last
        |                        PP stage --> broadcast over PP --> [B_local, S] (plan) or all-gather over DP [B, S]
        '-- update ------------> per mini-batch x ppo_epochs: this rank's rows of it, micro-batches through
                                 get_forward_backward_func, DAPO loss / global D (all-reduced over DP), finite check,
                                 Megatron optimizer step (clip, warm-up lr)

Gradient scaling (why the loss is multiplied): a micro-batch's loss is sum(l * mask) / D with D the valid-token
count of the whole mini-batch all-reduced over data parallel (`actor.loss.dapo_loss_func`). Megatron's schedule
divides each returned loss by num_microbatches and DDP pre-scales gradients by 1 / dp_size before its SUM
all-reduce; the loss is multiplied by num_microbatches * dp_size to cancel both. The gradient is then exactly
d(sum over all tokens of the mini-batch of l) / D, the same for any TP / PP / DP / micro-batch split.

Log-probs on the last stage (actor.logprob_impl, registry in actor/loss.py): "reference" / "fused" take the
vocab-parallel logits [b, S, V/tp] the model returns; "fused_linear" switches the model to return the final hidden
states (model.hidden_output_gpt_class), gathers them over TP when sequence parallel is on, and calls
linear_logprobs_and_entropy(hidden, output weight, labels, tp_group=...) so no [T, V] logits exist in either pass. The
weight is the output layer's, or the embedding when tied (on a PP>1 last stage, megatron's copy of it, whose gradient
finalize_model_grads all-reduces with the first stage as before).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.transformer.module import Float16Module
from torch import Tensor

from megatron_dapo.actor.background_save import BackgroundWrite
from megatron_dapo.actor.checkpointing import ActorCheckpoint
from megatron_dapo.actor.checkpointing import check_checkpoint
from megatron_dapo.actor.checkpointing import checkpoint_items
from megatron_dapo.actor.distributed import ParallelGroups
from megatron_dapo.actor.loss import LOSS_METRICS
from megatron_dapo.actor.loss import LossBatch
from megatron_dapo.actor.loss import LossContext
from megatron_dapo.actor.loss import get_logprob_impl
from megatron_dapo.actor.loss import local_loss_denominator
from megatron_dapo.actor.loss import loss_kernel
from megatron_dapo.actor.loss import loss_metric_stats
from megatron_dapo.actor.loss import make_loss_func
from megatron_dapo.actor.loss import micro_batch_logprobs
from megatron_dapo.actor.micro_batches import MicroBatch
from megatron_dapo.actor.micro_batches import MicroBatcher
from megatron_dapo.actor.offload import ActorOffloader
from megatron_dapo.actor.optimizer import ActorOptimizer
from megatron_dapo.actor.optimizer import ddp_config
from megatron_dapo.actor.packing import RowPlan
from megatron_dapo.actor.packing import sequence_lengths
from megatron_dapo.actor.routing import RoutingReplay
from megatron_dapo.actor.schedule import PipelineSchedule
from megatron_dapo.algorithms.loss_configs import uses_reference
from megatron_dapo.batch import ActorBatch
from megatron_dapo.batch import RoutedExperts
from megatron_dapo.checkpoint import ItemHashes
from megatron_dapo.checkpoint import seal_hf_export
from megatron_dapo.config import RunConfig
from megatron_dapo.metrics import all_reduce_stats
from megatron_dapo.metrics import finalize
from megatron_dapo.metrics import identity
from megatron_dapo.metrics import merge_stats


def _average_steps(results: list[dict[str, float]]) -> dict[str, float]:
    """The update's metrics: each loss metric averaged over the optimizer steps taken (skipped ones excluded), and
    the counts of skipped and all steps."""
    out: dict[str, float] = {}
    ok = [r for r in results if not r["skipped"]]
    keys = ["loss", "grad_norm", "lr", "clipfrac_high", "clipfrac_low", "approx_kl", "ratio_max", "entropy"]
    keys += ["ref_kl"] if any("ref_kl" in r for r in results) else []
    for key in keys:
        values = [r[key] for r in ok if key in r]
        out[f"actor/{key}"] = sum(values) / len(values) if values else float("nan")
    out["actor/skipped_steps"] = float(sum(r["skipped"] for r in results))
    out["actor/num_updates"] = float(len(results))
    return out


class MegatronActor:
    """The policy model: Megatron GPTModel chunks + DDP + Megatron optimizer, driven by one RunConfig.

    Every rank of the job constructs one and calls every method collectively (all ranks, same arguments).

    Args:
        config: the run configuration (actor, trainer, algorithm and rollout.temperature are read).
        groups: process groups from `actor.distributed.init_distributed(actor.tensor_parallel,
            actor.pipeline_parallel)`.
        hf_dir: Hugging Face checkpoint to load weights from; None builds the architecture from
            `config.actor.model_path` and keeps Megatron's random init (e.g. before `load_checkpoint`).
        frozen: a reference model (`actor.reference.reference_model`): the same model and log-prob path, no DDP
            gradient buffers and no optimizer; only compute_logprobs, offload_state / reload_state
            and export_hf_weights are meant for it.
    """

    def __init__(
        self, config: RunConfig, groups: ParallelGroups, hf_dir: str | None = None, *, frozen: bool = False
    ) -> None:
        from transformers import AutoConfig

        from megatron_dapo.actor.model import build_gpt_model
        from megatron_dapo.actor.model import check_shared_prefix

        self.config = config
        self.groups = groups
        source = hf_dir or config.actor.model_path
        if not source:
            raise ValueError("MegatronActor: pass hf_dir or set actor.model_path (the HF config is needed)")
        self.hf_config = AutoConfig.from_pretrained(source)
        self._transfer_plan: Any = None
        """actor/reshard.py's Plan of a direct weight sync (owned_shards), made on its first call."""
        self.vocab_size = int(self.hf_config.vocab_size)
        self.device = groups.device
        self.logprob_impl = get_logprob_impl(config.actor.logprob_impl)
        """The log-prob implementation (a LogprobImpl; may be swapped between calls, e.g. in tests)."""
        self.temperature = float(config.rollout.temperature)

        check_shared_prefix(config.actor, on_cpu=groups.device.type == "cpu")
        model = build_gpt_model(
            self.hf_config,
            config.actor,
            groups,
            pre_process=groups.is_first_stage,
            post_process=groups.is_last_stage,
        )
        if hf_dir is not None:
            from megatron_dapo.actor import hf_weights

            hf_weights.load_hf_into_model([model], hf_dir, self.hf_config, groups)
        self.tf_config = model.config
        self.batcher = MicroBatcher(config, groups, sequence_parallel=bool(self.tf_config.sequence_parallel))
        """Which rows this rank trains and their micro-batches (actor/micro_batches.py)."""
        if self.tf_config.num_moe_experts and groups.tp_size > 1 and not self.tf_config.sequence_parallel:
            # megatron-core 0.16.1's MoELayer refuses this in training mode, and without sequence parallel every TP
            # rank would dispatch its copy of the tokens (expert gradients tp times too large).
            raise ValueError(
                "actor.tensor_parallel: a mixture-of-experts actor at tensor_parallel > 1 needs sequence parallel "
                "(Transformer Engine on GPU); on CPU (local spec) use tensor_parallel=1 with actor.expert_parallel"
            )
        self.routing: RoutingReplay | None = None
        """Drives the MoE routers' replay (actor.routing_replay r2 / r3; None otherwise), `actor/routing.py`."""
        if self.tf_config.moe_enable_routing_replay and not frozen:
            self.routing = RoutingReplay(model)
        self.dtype = self.tf_config.params_dtype  # fp32 on CPU whatever actor.dtype says (model.py)
        self.tf_config.calculate_per_token_loss = False  # see the module docstring: D is explicit
        if self.dtype != torch.float32:
            model = Float16Module(self.tf_config, model)
        self.frozen = frozen
        self.steps: ActorOptimizer | None = None
        """The optimizer step, the warm-up lr and the step counters (actor/optimizer.py); None when frozen."""
        self.optimizer = None
        """megatron.core's optimizer (self.steps.megatron): what checkpoints and the offloader hold."""
        if frozen:
            # Parameters keep requires_grad: megatron's parallel linears take another code path for frozen weights
            # (tensor_parallel/layers.py, linear_with_frozen_weight) whose results differ from the trained model's in
            # the last bits, so the reference would not equal the actor before the first update. Nothing builds a
            # gradient: compute_logprobs runs under no_grad and there is no DDP buffer or optimizer.
            model.eval()
            self.model = [model]
        else:
            self.model = [DistributedDataParallel(self.tf_config, ddp_config(config.actor), model)]
            self.steps = ActorOptimizer(
                config.actor, config.trainer.max_skipped_steps, self.model, self.dtype, self.device
            )
            self.optimizer = self.steps.megatron
            self.tf_config.no_sync_func = self.model[0].no_sync
            self.tf_config.finalize_model_grads_func = finalize_model_grads
            self.tf_config.grad_scale_func = self.optimizer.scale_loss if self.dtype == torch.float16 else None
        self.schedule = PipelineSchedule(self.model, self.tf_config, groups, self.routing)
        """Runs micro-batches through the pipeline (actor/schedule.py)."""
        self.offloader = ActorOffloader(self.model, self.optimizer, self.device)
        """Moves params / grads / optimizer state to host memory and back (actor.offload, megatron_dapo/memory.py)."""

    def unwrapped(self) -> torch.nn.Module:
        """The GPTModel inside the DDP / Float16Module wrappers."""
        return self.schedule.unwrapped()

    def pop_routing_agreement(self, prefix: str) -> dict[str, float]:
        """Routing agreement of the replayed forwards since the last call (collective over all ranks): see
        `RoutingReplay.agreement_metrics`; {} without routing replay."""
        return {} if self.routing is None else self.routing.agreement_metrics(prefix, self.groups)

    def row_plan(self, batch: ActorBatch) -> RowPlan:
        """The placement of a full batch's rows over DP ranks (MicroBatcher.row_plan)."""
        return self.batcher.row_plan(batch)

    def pop_token_stats(self) -> dict[str, float]:
        """Token counts of the actor's passes since the last call (MicroBatcher.pop_token_stats; collective over
        dp_group)."""
        return self.batcher.pop_token_stats()

    # ---------------------------------------------------------------------------------------------------------
    # log-probs
    # ---------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(
        self, batch: ActorBatch, *, plan: RowPlan | None = None, with_entropy: bool = True, record_routing: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (and entropies) of the batch's tokens under the current weights.

        Forward only, through the pipeline schedule, micro-batched (see `MicroBatcher.cut`); rows are placed on
        data-parallel ranks by `row_plan`. Temperature is rollout.temperature; padded vocab columns do not count.

        Args:
            batch: plan None: the full ActorBatch, the same on every rank; each DP rank computes its rows and the
                results are all-gathered over DP. With a plan: only this DP rank's rows, `plan.rows_of(dp_rank)` in
                that order (the same on the TP/PP ranks of its model-parallel group); nothing is gathered.
                tokens [B, S] and response_mask [B, S] are read.
            plan: the RowPlan of the full batch (`RowPlan.build` from its lengths), or None.
            with_entropy: also return the entropies (else None).
            record_routing: (actor.routing_replay r2; needs a plan) record every token's top-k experts in this stage's
                MoE layers into batch.routed_experts (this DP rank's rows), for `update` to replay. A batch that
                already has routed_experts (r3) is replayed instead, here too.
        Returns:
            (logp, entropy): [B, S] fp32 on CPU (B = the rows passed in), on every rank. Position t is
            log p(tokens[t] | tokens[<t]); 0 at position 0 and wherever response_mask is 0 (prompt and padding).
        """
        self._require_resident("compute_logprobs", ("params",))
        for chunk in self.model:
            chunk.eval()
        record = record_routing and self.routing is not None and batch.routed_experts is None
        if record and plan is None:
            raise ValueError("MegatronActor.compute_logprobs: record_routing needs plan= (this DP rank's rows)")
        try:
            if plan is not None:
                local, _ = self.batcher.local_rows(batch, plan, "compute_logprobs")
                recorded: dict[int, Tensor] | None = {} if record else None
                out = self._local_logprobs(local, with_entropy, len(local), recorded)[:, : len(local)].cpu()
                if record:
                    rows = [recorded[i] for i in range(len(local))]
                    batch.routed_experts = RoutedExperts.from_rows(rows, self.routing.num_experts)
            else:
                out = self._full_logprobs(batch, with_entropy)
        finally:
            for chunk in self.model:
                chunk.train(not self.frozen)
        out = out * batch.response_mask.to(torch.float32)
        return out[0], (out[1] if with_entropy else None)

    def _local_logprobs(
        self, batch: ActorBatch, with_entropy: bool, num_rows: int, recorded: dict[int, Tensor] | None = None
    ) -> Tensor:
        """[1 or 2, max(num_rows, 1), S] fp32 on self.device, on every PP stage: log-probs (and entropies) of this
        rank's rows (all of `batch`, B <= num_rows) in rows 0..B-1, zeros elsewhere. recorded: see
        `PipelineSchedule.run`."""
        s = batch.tokens.shape[1]
        micro = self.batcher.cut(batch)
        hidden = self.logprob_impl.takes_hidden
        store = self.schedule.run(micro, self._collect_logprobs, forward_only=True, hidden=hidden, recorded=recorded)
        out = torch.zeros(2, max(num_rows, 1), s, dtype=torch.float32, device=self.device)
        if self.groups.is_last_stage:
            for mb, d in zip(micro, store, strict=True):
                if mb.rows:
                    idx = torch.tensor(mb.rows, device=self.device)
                    width = min(d["logp"].shape[1], s)
                    out[0, idx, :width] = d["logp"][:, :width]
                    out[1, idx, :width] = d["entropy"][:, :width]
        return self.schedule.from_last_stage(out if with_entropy else out[:1].contiguous())

    def _full_logprobs(self, batch: ActorBatch, with_entropy: bool) -> Tensor:
        """[1 or 2, B, S] fp32 on CPU for a full batch: each DP rank computes its rows, then an all-gather over DP."""
        b, s = batch.tokens.shape
        local, plan = self.batcher.local_rows(batch, None, "compute_logprobs")
        parts = [plan.rows_of(d) for d in range(self.groups.dp_size)]
        out = self._local_logprobs(local, with_entropy, max(len(p) for p in parts))
        if self.groups.dp_size > 1:
            gathered = [torch.empty_like(out) for _ in range(self.groups.dp_size)]
            dist.all_gather(gathered, out, group=self.groups.dp_group)
        else:
            gathered = [out]
        full = torch.zeros(out.shape[0], b, s, dtype=torch.float32)
        for rows, part in zip(parts, gathered, strict=True):
            if rows:
                full[:, torch.tensor(rows)] = part[:, : len(rows)].cpu()
        return full

    def _collect_logprobs(self, mb: MicroBatch) -> Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]:
        weight = self.schedule.output_weight(self.logprob_impl.takes_hidden)
        layout = mb.layout.to(self.device) if mb.layout is not None else None

        def loss_func(output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            logp, ent = micro_batch_logprobs(
                output,
                mb.batch.tokens.to(output.device),
                packed=layout,
                output_weight=weight,
                temperature=self.temperature,
                tp_group=self.groups.tp_group,
                vocab_size=self.vocab_size,
                logprob_fn=self.logprob_impl.fn,
                needed=mb.batch.response_mask.to(output.device) > 0,  # packed: LM head on response predictions only
            )
            return output.new_zeros((), dtype=torch.float32), {"logp": logp.detach(), "entropy": ent.detach()}

        return loss_func

    # ---------------------------------------------------------------------------------------------------------
    # update
    # ---------------------------------------------------------------------------------------------------------
    def update(self, batch: ActorBatch, *, plan: RowPlan | None = None) -> dict[str, float]:
        """DAPO policy update on a training batch (old_logp filled in).

        The full batch is cut into mini-batches of trainer.mini_batch_prompts * algorithm.group_size responses (the
        last may be smaller), each is one optimizer step, repeated trainer.ppo_epochs times. Each mini-batch is split
        over data-parallel ranks by `row_plan` (balanced by tokens) and then into micro-batches. The loss divides by
        the mini-batch's valid-token count all-reduced over DP, so the split does not change the gradient. A step
        whose loss or gradient is not finite is skipped: gradients are zeroed and the weights stay unchanged.

        Args:
            batch: plan None: the full ActorBatch, the same on every rank, with old_logp [B, S]. With a plan: only
                this DP rank's rows, `plan.rows_of(dp_rank)` in that order, with their old_logp.
            plan: the RowPlan of the full batch, or None.
        Returns:
            plain floats, identical on every rank, averaged over the optimizer steps (skipped steps excluded):
            actor/loss, actor/grad_norm, actor/lr, actor/clipfrac_high, actor/clipfrac_low, actor/approx_kl,
            actor/ratio_max, actor/entropy; and actor/skipped_steps (count), actor/num_updates (count). With routing
            replay, the agreement of the replayed experts with the ones the updated routers pick
            (`pop_routing_agreement`: actor/routing_agreement, ..._min, ..._layer_{i}).
        """
        if self.frozen:
            raise RuntimeError("MegatronActor.update: this is a frozen (reference) model")
        self._require_resident("update", ("params", "grads", "optimizer"))
        if batch.old_logp is None:
            raise ValueError("MegatronActor.update: batch.old_logp is None; call compute_logprobs first")
        local, plan = self.batcher.local_rows(batch, plan, "update")
        results = []
        for _ in range(self.config.trainer.ppo_epochs):
            for rows in plan.local_mini_batches(self.groups.dp_rank):
                results.append(self._train_mini_batch(local.select(rows)))
        return {**_average_steps(results), **self.pop_routing_agreement("actor")}

    def _forward_backward(self, mini: ActorBatch, *, local: bool = False) -> dict[str, float]:
        """Zero the grads, run forward/backward on this rank's rows of one mini-batch; gradients end up reduced over
        data parallel in the DDP buffers (param.main_grad). Returns the mini-batch's metrics (all ranks). The
        denominator D is the whole mini-batch's (all DP ranks), so the split does not change the loss.

        mini: the whole mini-batch (same on every rank; this rank's rows are picked by `balance_rows`), or with
        local=True only this rank's rows of it."""
        if not local:
            plan = RowPlan.build(sequence_lengths(mini.response_mask).tolist(), self.groups.dp_size, max(len(mini), 1))
            mini = mini.select(torch.tensor(plan.rows_of(self.groups.dp_rank), dtype=torch.int64))
        micro = self.batcher.cut(mini)
        denom = local_loss_denominator(mini.loss_mask, self.config.loss.loss_agg_mode).to(self.device)
        dist.all_reduce(denom, group=self.groups.dp_group)
        make_loss = partial(self._dapo_loss, denom=denom, num_microbatches=len(micro))
        self.steps.zero_grad()
        store = self.schedule.run(micro, make_loss, forward_only=False, hidden=self.logprob_impl.takes_hidden)
        return self._reduce_metrics(store)

    def _train_mini_batch(self, local: ActorBatch) -> dict[str, float]:
        """One optimizer step on this rank's rows of one mini-batch (skipped when loss or gradient is not finite)."""
        stats = self._forward_backward(local, local=True)
        return {**stats, **self.steps.step(stats["loss"])}

    def _dapo_loss(self, mb: MicroBatch, *, denom: Tensor, num_microbatches: int) -> Callable:
        b = mb.batch.to(self.device)
        packed = mb.layout.to(self.device) if mb.layout is not None else None
        batch = LossBatch(
            b.tokens, b.loss_mask, b.old_logp, b.advantages, denom, b.response_mask, b.is_weight, b.ref_logp, packed
        )
        ctx = LossContext(
            temperature=self.temperature, tp_group=self.groups.tp_group, vocab_size=self.vocab_size,
            num_microbatches=num_microbatches, dp_size=self.groups.dp_size, logprob_fn=self.logprob_impl.fn,
            output_weight=self.schedule.output_weight(self.logprob_impl.takes_hidden), loss_kernel=self.loss_kernel,
        )  # fmt: skip
        return make_loss_func(batch, ctx, self.config.loss)

    @property
    def loss_kernel(self) -> str | None:
        """The policy loss's kernel: actor.loss_kernel, "auto" following the current logprob_impl (actor/loss.py)."""
        return loss_kernel(self.logprob_impl.name, self.config.actor.loss_kernel)

    def _reduce_metrics(self, store: list[dict[str, Tensor]]) -> dict[str, float]:
        """The loss metrics (LOSS_METRICS) of every micro-batch (on the last pipeline stage), pipeline stage and DP
        rank, combined by their declared reductions; the same floats on every rank."""
        parts = [loss_metric_stats(d) for d in store] if self.groups.is_last_stage else []
        keys = [k for k in LOSS_METRICS if k != "ref_kl" or uses_reference(self.config.loss)]
        local = merge_stats([{key: identity(LOSS_METRICS[key]) for key in keys}, *parts])
        pp = self.groups.pp_group if self.groups.pp_size > 1 else None
        return finalize(all_reduce_stats(local, [pp, self.groups.dp_group], device=self.device))

    # ---------------------------------------------------------------------------------------------------------
    # offload (driven by megatron_dapo.memory.MemoryChoreographer)
    # ---------------------------------------------------------------------------------------------------------
    def offload_state(self, parts: Sequence[str]) -> int:
        """Move `parts` ("params", "grads", "optimizer") to pinned host memory; returns the bytes moved (per rank)."""
        return self.offloader.offload(parts)

    def reload_state(self, parts: Sequence[str] | None = None) -> int:
        """Bring offloaded parts (None: all) back to the device bit for bit; returns the bytes moved."""
        return self.offloader.reload(parts)

    def _require_resident(self, what: str, parts: Sequence[str]) -> None:
        away = [p for p in parts if p in self.offloader.offloaded]
        if away:
            raise RuntimeError(f"MegatronActor.{what}: actor state {away} is offloaded; call reload_state() first")

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Everything on the device for the duration (checkpoint save / load), then offloaded again as before."""
        away = self.offloader.offloaded
        self.offloader.reload(away)
        try:
            yield
        finally:
            self.offloader.offload(away)

    # ---------------------------------------------------------------------------------------------------------
    # weights and checkpoints
    # ---------------------------------------------------------------------------------------------------------
    def export_hf_weights(
        self, bucket_bytes: int | None = None, *, dst_rank: int | None = None
    ) -> Iterator[tuple[str, Tensor]]:
        """Full (un-sharded) HF-named tensors of the current weights, (name, tensor) in HF checkpoint order, in the
        HF config's dtype; see `actor.hf_weights.export_hf_weights`. Collective: EVERY rank must iterate it to the
        end (TP gathers and PP broadcasts inside). dst_rank None: every rank receives every tensor; dst_rank = r:
        only rank r does (the others only send their shards and yield nothing)."""
        from megatron_dapo.actor import hf_weights

        self._require_resident("export_hf_weights", ("params",))
        return hf_weights.export_hf_weights(
            self.model, self.hf_config, self.groups, bucket_bytes=bucket_bytes, dst_rank=dst_rank
        )

    def owned_shards(self) -> Iterator[tuple[str, Tensor]]:
        """This rank's share of a direct weight sync: (piece name, local megatron shard in the export dtype) per piece
        of the transfer plan (actor/reshard.py), made on the first call (a collective: `Layout.gather`)."""
        from megatron_dapo.actor import reshard

        self._require_resident("owned_shards", ("params",))
        if self._transfer_plan is None:
            self._transfer_plan = reshard.transfer_plan(self.hf_config, reshard.Layout.gather(self.groups))
        return reshard.owned_shards(self.model, self.hf_config, self.groups, self._transfer_plan)

    def save_hf(self, out_dir: str, tokenizer: Any = None) -> None:
        """Write the current weights as a Hugging Face checkpoint: out_dir/model.safetensors (the HF config's
        dtype), config.json and, when given, the tokenizer's files, sealed (MANIFEST.json, COMPLETE). The one HF
        export (the trainer's final export and `megatron-dapo convert --to hf` both call it). Collective: every rank
        must call it; only global rank 0 receives the full tensors (the others send their shards, other data-parallel
        replicas do nothing) and writes; every rank returns once the files are written."""
        from safetensors.torch import save_file

        tensors = {name: t.detach().cpu().contiguous() for name, t in self.export_hf_weights(dst_rank=0)}
        if self.groups.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.save_pretrained(out_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
            seal_hf_export(out_dir)  # MANIFEST.json + COMPLETE: `megatron-dapo eval` verifies what it loads
        if dist.is_initialized():
            dist.barrier()

    def save_checkpoint(self, ckpt_dir: str, *, background: bool = False) -> BackgroundWrite | None:
        """Save model, optimizer, step count (megatron dist_checkpointing) and this rank's RNG states
        (actor/checkpointing.py).

        Collective. `ckpt_dir` is created if missing and must be empty (the trainer makes it atomic on top). See
        `load_checkpoint` for resharding; RNG states are restored only with the same world size. With background,
        the tensors are copied to host memory and written by a thread while training goes on: the returned
        BackgroundWrite must be waited for and finalised on every rank before the directory is a checkpoint
        (actor/background_save.py; the trainer does it at the next step boundary).
        """
        return ActorCheckpoint(self).save(ckpt_dir, background=background)

    check_checkpoint = staticmethod(check_checkpoint)
    checkpoint_items = staticmethod(checkpoint_items)

    def load_checkpoint(self, ckpt_dir: str, *, load_optimizer: bool = True, items: ItemHashes | None = None) -> None:
        """Load what `save_checkpoint` wrote (collective; actor/checkpointing.py).

        Weights reshard to any TP / PP / DP layout. The optimizer state uses megatron's "dp_reshardable" format: it
        loads into the same TP x PP layout (any DP size); to change TP or PP pass load_optimizer=False (weights and
        step count only; Adam moments start at zero). items: the manifest's item hashes of this directory
        (CheckpointManager.item_hashes); each storage item read is checked against them (CorruptItem, every rank).

        Nothing in the checkpoint runs: `check_checkpoint` comes first."""
        ActorCheckpoint(self).load(ckpt_dir, load_optimizer=load_optimizer, items=items)
