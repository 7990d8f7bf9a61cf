"""The actor's optimizer step: Megatron's optimizer built from the actor section, the warm-up learning rate, and
one step with a finite check between the gradient norm and the update.

    step(loss) --> loss not finite: skip
               --> prepare_grads -> global grad norm -> not finite on any rank: skip
               --> clip by the total norm (actor.grad_clip) -> step_with_ready_grads -> every weight finite, or raise
    a skipped step zeroes the gradients and leaves the weights unchanged; trainer.max_skipped_steps skipped in a row
    stops the run with the last loss and norm in the message.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from megatron_dapo.config import ActorConfig


def ddp_config(actor: ActorConfig) -> DistributedDataParallelConfig:
    """Megatron DDP's settings: fp32 gradient reduction, no overlap (the trainer's step order), the distributed
    optimizer per actor.use_distributed_optimizer."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=actor.use_distributed_optimizer,
    )


def _optimizer_config(actor: ActorConfig, dtype: torch.dtype) -> OptimizerConfig:
    """Megatron's Adam from the actor section (a constant lr: `set_lr` drives the warm-up), in the model's dtype."""
    return OptimizerConfig(
        optimizer="adam",
        lr=actor.lr,
        min_lr=actor.lr,
        weight_decay=actor.weight_decay,
        adam_beta1=actor.adam_beta1,
        adam_beta2=actor.adam_beta2,
        clip_grad=actor.grad_clip,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=actor.use_distributed_optimizer,
    )


class ActorOptimizer:
    """Megatron's optimizer over the DDP model chunks, with the warm-up schedule and the step counters.

    Args:
        actor: the actor section (lr, lr_warmup_steps, weight_decay, Adam betas, grad_clip, distributed optimizer).
        max_skipped_steps: trainer.max_skipped_steps (0: never stop).
        model: the DDP-wrapped model chunks.
        dtype: the model's parameter dtype.
        device: where the collective flags live.
    """

    def __init__(
        self, actor: ActorConfig, max_skipped_steps: int, model: list[Any], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.actor = actor
        self.max_skipped_steps = max_skipped_steps
        self.model = model
        self.device = device
        self.megatron = get_megatron_optimizer(_optimizer_config(actor, dtype), model)
        """megatron.core's optimizer (chained with expert parallelism); its state is what checkpoints hold."""
        self.num_steps = 0
        """Successful optimizer steps so far (drives the warm-up)."""
        self.num_skipped = 0
        """Steps skipped because the loss or a gradient was not finite."""
        self.consecutive_skipped = 0
        """Steps skipped in a row (a successful step resets it); trainer.max_skipped_steps bounds it."""
        self.set_lr()

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based): linear warm-up over actor.lr_warmup_steps, then
        constant actor.lr (step k < W uses lr * (k + 1) / W)."""
        warmup = self.actor.lr_warmup_steps
        if warmup <= 0 or step >= warmup:
            return self.actor.lr
        return self.actor.lr * (step + 1) / warmup

    def set_lr(self) -> float:
        """Set the optimizer's learning rate and weight decay for the current step count; returns the lr."""
        lr = self.lr_at(self.num_steps)
        for group in self.megatron.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.actor.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def zero_grad(self) -> None:
        """Zero the DDP gradient buffers and the optimizer's gradients."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.megatron.zero_grad()

    def step(self, loss: float) -> dict[str, float]:
        """One optimizer step on the reduced gradients of a mini-batch whose loss is `loss` (the same on every rank),
        or a skipped one. Collective. Returns {"lr", "skipped" (0 / 1), "grad_norm" (when the loss was finite)}."""
        stats = {"lr": self.set_lr()}
        stepped = False
        if math.isfinite(loss):
            stepped, stats["grad_norm"] = self._step_if_finite()
        stats["skipped"] = float(not stepped)
        if not stepped:
            self.zero_grad()
            self.num_skipped += 1
            self.consecutive_skipped += 1
        else:
            self.num_steps += 1
            self.consecutive_skipped = 0
            self._check_finite_weights()
        limit = self.max_skipped_steps
        if limit and self.consecutive_skipped >= limit:
            raise RuntimeError(
                f"MegatronActor.update: {self.consecutive_skipped} optimizer steps in a row were skipped (loss or "
                f"gradient not finite; last loss {loss}, grad_norm {stats.get('grad_norm', float('nan'))}); "
                f"stopping at trainer.max_skipped_steps={limit}: lower actor.lr or check the data and rewards"
            )
        return stats

    @torch.no_grad()
    def _step_if_finite(self) -> tuple[bool, float]:
        """Megatron's step in its public parts, with a finite check between norm and update:
        prepare_grads (copy/unscale to main grads) -> get_grad_norm (global) -> skip if not finite -> clip by the
        total norm (coefficient actor.grad_clip / (norm + 1e-6) when < 1) -> step_with_ready_grads.
        Returns (stepped, grad_norm before clipping); the decision is the same on every rank (global norm)."""
        found_inf = bool(self.megatron.prepare_grads())
        grad_norm = float(self.megatron.get_grad_norm())
        ok = torch.tensor([float(not found_inf and math.isfinite(grad_norm))], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 0.0:
            return False, grad_norm
        clip = self.actor.grad_clip
        if clip > 0.0 and clip / (grad_norm + 1.0e-6) < 1.0:
            optimizers = getattr(self.megatron, "chained_optimizers", [self.megatron])
            grads = [p.grad for opt in optimizers for p in opt.get_parameters() if p.grad is not None]
            torch._foreach_mul_(grads, clip / (grad_norm + 1.0e-6))
        return bool(self.megatron.step_with_ready_grads()), grad_norm

    @torch.no_grad()
    def _check_finite_weights(self) -> None:
        """Raise if any weight of any rank is NaN/Inf after a step, before it reaches a checkpoint or the engine
        (collective over all ranks: every rank raises together)."""
        bad = [name for chunk in self.model for name, p in chunk.named_parameters() if not torch.isfinite(p).all()]
        flag = torch.tensor([float(len(bad))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            where = f"on this rank: {', '.join(bad[:3])}" if bad else "on another rank"
            raise RuntimeError(
                f"MegatronActor.update: non-finite weights after optimizer step {self.num_steps} "
                f"(actor.lr={self.actor.lr}, lr used {self.lr_at(self.num_steps - 1)}; {where}); stopping"
            )
