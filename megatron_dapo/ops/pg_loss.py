"""The fused policy-loss kernel: every registered policy loss (dapo, grpo, dr_grpo, gspo, cispo) runs here, the
twin of `megatron_dapo.algorithms.policy_loss.surrogate_loss` for a `Surrogate` spec (kind clip / gspo / cispo).

One kernel launch per direction (GSPO adds one before them: `_seq_log_ratio_kernel`, one program per sequence over
its contiguous tokens, the mean log-ratio of each sequence; no atomics):

- forward: each program reduces BLOCK tokens to 7 partial sums (weighted loss, mask weight, valid count, clip-high
  count, clip-low count, KL sum, ratio max) written to a [num_programs, 8] fp32 buffer; torch then sums that buffer
  in a fixed order. No float atomics, so the result is bitwise reproducible run to run.
- backward: recomputes ratio and branch per token from the inputs (nothing [B, T] is saved besides the inputs
  themselves) and writes d loss / d logp in logp's dtype, already scaled by grad_output / D.

Branches and ties (see docs/kernels.md and policy_loss.clipped_token_loss): every clip decision compares the fp32
log-ratio r = logp - old_logp with log(1 - eps_low), log(1 + eps_high) and log(c) (policy_loss.ClipBounds), so the
reference, this kernel and the CUDA twin pick the same branch for the same inputs whatever their exp rounds to. A
log-ratio exactly on a bound keeps the unclipped gradient -A * ratio. r is clamped to [-20, 20] before exp (as verl
does), so loss and gradient stay finite for log-ratios of any size.

Layouts: the padded rows [B, T] of the actor (sequence = row) or a packed 1-D layout [N] of only the valid tokens
with cu_seqlens [S + 1] (sequence = segment; `fused_surrogate_loss(..., cu_seqlens=)`), so GSPO's per-sequence
reduction needs no padding.

Dispatch: `use_triton` (ops/dispatch.py) picks Triton for CUDA tensors and for CPU tensors under TRITON_INTERPRET=1;
other CPU calls run the reference. backend="cuda" (actor.logprob_impl "fused_cuda") selects the CUDA C++ twin
from csrc/ on GPU, which must then have been built (csrc/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_dapo.algorithms.loss_configs import LOSS_DENOMINATOR_UNIT
from megatron_dapo.algorithms.policy_loss import LOG_RATIO_CLAMP
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import clip_loss_entry
from megatron_dapo.algorithms.policy_loss import surrogate_loss
from megatron_dapo.ops.dispatch import kernel_backend
from megatron_dapo.ops.dispatch import use_triton

BLOCK_TOKENS = 1024
NUM_PARTIALS = 8  # columns of the per-program partial buffer (7 used, padded to 8)
_LOG_RATIO_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)
KIND_CODES = {"clip": 0, "gspo": 1, "cispo": 2}
"""The kernels' KIND constexpr for each `policy_loss.SURROGATES` kind."""


@triton.jit
def _seq_log_ratio_kernel(logp_ptr, old_ptr, mask_ptr, starts_ptr, out_ptr, BLOCK: tl.constexpr):
    """GSPO's pass 1: out[s] = mean of logp - old_logp over the valid tokens (mask != 0) of sequence s, the tokens
    starts[s] .. starts[s + 1] - 1; 0 for a sequence with none. One program per sequence, a fixed-order loop."""
    pid = tl.program_id(0)
    start = tl.load(starts_ptr + pid)
    end = tl.load(starts_ptr + pid + 1)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    count = tl.zeros((BLOCK,), dtype=tl.float32)
    for first in range(start, end, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        inb = offs < end
        logp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
        valid = inb & (tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32) != 0.0)
        total += tl.where(valid, logp - old, 0.0)
        count += tl.where(valid, 1.0, 0.0)
    tl.store(out_ptr + pid, tl.sum(total, axis=0) / tl.maximum(tl.sum(count, axis=0), 1.0))


@triton.jit
def _surrogate(r, logp, adv, lo, hi, clip_c, log_lo, log_hi, log_c, DUAL_CLIP: tl.constexpr, KIND: tl.constexpr):
    """Per token, fp32: the ratio exp(r), the loss, its gradient factor d l / d logp (unmasked) and the clip-high /
    clip-low decisions. KIND 0 (clip) / 1 (gspo) / 2 (cispo) as in policy_loss.surrogate_token_loss. Branches are
    decided on the log-ratio r: the exp below compiles to ex2.approx on sm_90 and rounds differently from torch's,
    so a decision on exp(r) could differ between backends at a bound."""
    # Clamp before exp (verl's bound): the ratio, loss and gradient stay finite in fp32 for any finite inputs.
    ratio = tl.exp(tl.minimum(tl.maximum(r, -_LOG_RATIO_CLAMP), _LOG_RATIO_CLAMP))
    if KIND == 2:
        # CISPO: the IS weight sg(clip(ratio, lo, hi)) multiplies -A logp; its gradient -A w never vanishes.
        clip_high = r > log_hi
        clip_low = r < log_lo
        is_w = tl.where(clip_high, hi, tl.where(clip_low, lo, ratio))
        loss = -adv * is_w * logp
        dloss = -adv * is_w
    else:
        clip_high = (adv > 0) & (r > log_hi)
        clip_low = (adv < 0) & (r < log_lo)
        loss = tl.where(clip_high, -adv * hi, tl.where(clip_low, -adv * lo, -adv * ratio))
        # Unclipped gradient d(-A r)/dlogp = -A ratio, zero where the clamp is active (as torch.clamp's gradient).
        active = ~clip_high & ~clip_low & (r >= -_LOG_RATIO_CLAMP) & (r <= _LOG_RATIO_CLAMP)
        if DUAL_CLIP:
            capped = (adv < 0) & (r > log_c)
            loss = tl.where(capped, -adv * clip_c, loss)
            active = active & ~capped
        dloss = tl.where(active, -adv * ratio, 0.0)
    return ratio, loss, dloss, clip_high, clip_low


@triton.jit
def _pg_loss_kernel(
    logp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    seq_lr_ptr,
    seq_id_ptr,
    partial_ptr,
    grad_out_ptr,
    inv_denom_ptr,
    grad_ptr,
    num_elements,
    seq_len,
    lo,
    hi,
    clip_c,
    log_lo,
    log_hi,
    log_c,
    ADV_PER_TOKEN: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KIND: tl.constexpr,
    PACKED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of tokens. Forward (BACKWARD=False): the block's row of partial sums at partial_ptr [P, 8].
    Backward: d loss / d logp at grad_ptr, scaled by grad_out * inv_denom (both 0-dim, read on device: no host
    sync for grad_output or a tensor num_tokens). The pointers the other direction reads are never touched.
    The decision log-ratio r is the token's, or for gspo its sequence's mean (seq_lr_ptr).
    """
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < num_elements
    # Upcast right after every load: the interpreter keeps bf16 as raw bits.
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    if PACKED:
        seq = tl.load(seq_id_ptr + offs, mask=inb, other=0)
    else:
        seq = offs // seq_len
    if ADV_PER_TOKEN:
        adv = tl.load(adv_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    else:
        adv = tl.load(adv_ptr + seq, mask=inb, other=0.0).to(tl.float32)
    w = tl.load(mask_ptr + offs, mask=inb, other=0).to(tl.float32)
    token_r = logp - old
    if KIND == 1:
        r = tl.load(seq_lr_ptr + seq, mask=inb, other=0.0)
    else:
        r = token_r
    ratio, loss, dloss, clip_high, clip_low = _surrogate(
        r, logp, adv, lo, hi, clip_c, log_lo, log_hi, log_c, DUAL_CLIP, KIND
    )
    valid = inb & (w != 0.0)
    if BACKWARD:
        scale = tl.load(grad_out_ptr).to(tl.float32) * tl.load(inv_denom_ptr)
        grad = tl.where(valid, dloss * w * scale, 0.0)
        tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=inb)
    else:
        # tl.where instead of multiplying by the mask: masked-out tokens never leak inf/NaN into the sums.
        row = partial_ptr + pid * 8
        tl.store(row + 0, tl.sum(tl.where(valid, loss * w, 0.0), axis=0))
        tl.store(row + 1, tl.sum(tl.where(valid, w, 0.0), axis=0))
        tl.store(row + 2, tl.sum(tl.where(valid, 1.0, 0.0), axis=0))
        tl.store(row + 3, tl.sum(tl.where(valid & clip_high, 1.0, 0.0), axis=0))
        tl.store(row + 4, tl.sum(tl.where(valid & clip_low, 1.0, 0.0), axis=0))
        tl.store(row + 5, tl.sum(tl.where(valid, -token_r, 0.0), axis=0))
        tl.store(row + 6, tl.max(tl.where(valid, ratio, 0.0), axis=0))
        tl.store(row + 7, 0.0)


def _launch_meta(num_elements: int) -> tuple[int, int]:
    block = min(BLOCK_TOKENS, max(16, triton.next_power_of_2(max(num_elements, 1))))
    return block, triton.cdiv(max(num_elements, 1), block)


def _bound_args(b: ClipBounds) -> tuple[float, ...]:
    """The kernels' scalar arguments (lo, hi, clip_c, log_lo, log_hi, log_c), all already fp32-exact."""
    return (b.lo, b.hi, 0.0 if b.clip_c is None else b.clip_c, b.log_lo, b.log_hi, b.log_c)


@dataclass(frozen=True)
class _Layout:
    """How tokens map to sequences in one call: rows of `seq_len` tokens (padded [B, T]), or `seq_ids` [N] int32 per
    token (packed). `seq_lr` [S] fp32: GSPO's per-sequence mean log-ratio (a dummy for the other kinds)."""

    kind: str
    bounds: ClipBounds
    seq_len: int
    seq_ids: Tensor | None
    seq_lr: Tensor

    def kernel_args(self, logp: Tensor) -> tuple[Tensor, Tensor]:
        return self.seq_lr, self.seq_ids if self.seq_ids is not None else logp  # (an unread pointer when padded)

    def cuda_args(self) -> tuple[Any, ...]:
        """(bounds, kind, seq_lr, seq_ids, seq_len) of the CUDA twin's entry points."""
        return self.bounds, KIND_CODES[self.kind], self.seq_lr, self.seq_ids, self.seq_len

    def constexprs(self, adv: Tensor, logp: Tensor) -> dict[str, Any]:
        return {
            "ADV_PER_TOKEN": adv.shape == logp.shape,
            "DUAL_CLIP": self.bounds.clip_c is not None,
            "KIND": KIND_CODES[self.kind],
            "PACKED": self.seq_ids is not None,
        }


def sequence_log_ratio_fused(logp: Tensor, old_logp: Tensor, mask: Tensor, starts: Tensor) -> Tensor:
    """Triton pass 1 of GSPO: [S] fp32 mean of logp - old_logp over each sequence's valid tokens (mask != 0), the
    sequences being the token ranges starts[s] .. starts[s + 1] - 1 of the flat inputs (starts: [S + 1] int32)."""
    num_seqs = starts.numel() - 1
    out = torch.empty(num_seqs, dtype=torch.float32, device=logp.device)
    if num_seqs > 0:
        _seq_log_ratio_kernel[(num_seqs,)](logp, old_logp, mask, starts, out, BLOCK=256)
    return out


def _launch(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    layout: _Layout,
    partials: Tensor | None = None,
    scale: tuple[Tensor, Tensor] | None = None,
    grad: Tensor | None = None,
) -> None:
    """Run _pg_loss_kernel forward (into `partials`) or backward (into `grad`, scaled by `scale`)."""
    num_elements = logp.numel()
    block, grid = _launch_meta(num_elements)
    seq_lr, seq_ids = layout.kernel_args(logp)
    grad_out, inv_denom = scale if scale is not None else (seq_lr, seq_lr)  # (unread fp32 pointers in the forward)
    _pg_loss_kernel[(grid,)](
        logp,
        old_logp,
        adv,
        mask,
        seq_lr,
        seq_ids,
        partials if partials is not None else seq_lr,
        grad_out,
        inv_denom,
        grad if grad is not None else logp,
        num_elements,
        max(layout.seq_len, 1),
        *_bound_args(layout.bounds),
        **layout.constexprs(adv, logp),
        BACKWARD=grad is not None,
        BLOCK=block,
    )


def pg_loss_partials(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, layout: _Layout) -> Tensor:
    """Triton forward: per-program partial sums.

    Args:
        logp, old_logp: [B, T] (or packed [N]) contiguous float. adv: per sequence or per token, contiguous float.
            mask: same shape as logp, contiguous float or uint8 (bool viewed as uint8).
    Returns:
        [num_programs, 8] fp32: loss*w, w, count, clip-high count, clip-low count, KL sum, ratio max, pad.
    """
    _, grid = _launch_meta(logp.numel())
    partials = torch.empty((grid, NUM_PARTIALS), dtype=torch.float32, device=logp.device)
    _launch(logp, old_logp, adv, mask, layout, partials=partials)
    return partials


def pg_loss_grad(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, grad_out: Tensor, inv_denom: Tensor, layout: _Layout
) -> Tensor:
    """Triton backward: d loss / d logp (logp's shape and dtype), scaled by grad_out (0-dim) and inv_denom (0-dim)."""
    grad = torch.empty_like(logp)
    if logp.numel():
        scale = (grad_out.to(torch.float32).reshape(1), inv_denom.reshape(1))
        _launch(logp, old_logp, adv, mask, layout, scale=scale, grad=grad)
    return grad


def _finish(totals: Tensor, num_tokens: float | Tensor | None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Loss, 1/D and metrics from the 7 reduced totals (same denominators as policy_loss.py)."""
    weight_sum, count = totals[1], totals[2]
    denom = weight_sum if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32, device=totals.device)
    # D is clamped to >= 1 like agg_loss: an empty batch (D == 0) gives loss 0 and gradient 0, never NaN.
    inv_denom = 1.0 / denom.to(torch.float32).clamp_min(1.0)
    inv_count = 1.0 / count.clamp_min(1.0)
    metrics = {
        "clipfrac_high": totals[3] * inv_count,
        "clipfrac_low": totals[4] * inv_count,
        "approx_kl": totals[5] * inv_count,
        "ratio_max": totals[6],
    }
    return totals[0] * inv_denom, inv_denom, metrics


def _reduce_partials(partials: Tensor) -> Tensor:
    """Fixed-order reduction of [P, 8] partials to [7] totals (sums, then the max of column 6)."""
    sums = partials[:, :6].sum(dim=0)
    rmax = partials[:, 6].max() if partials.shape[0] else partials.new_zeros(())
    return torch.cat([sums, rmax.reshape(1)])


class FusedSurrogateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, advantages, mask, layout, num_tokens, backend):
        if backend == "cuda":
            from megatron_dapo.ops import _cuda_twins

            totals = _cuda_twins.pg_loss(logp, old_logp, advantages, mask, *layout.cuda_args())
        else:
            totals = _reduce_partials(pg_loss_partials(logp, old_logp, advantages, mask, layout))
        loss, inv_denom, metrics = _finish(totals, num_tokens)
        ctx.save_for_backward(logp, old_logp, advantages, mask, inv_denom)
        ctx.params = (layout, backend)
        ctx.mark_non_differentiable(*metrics.values())
        return loss, metrics["clipfrac_high"], metrics["clipfrac_low"], metrics["approx_kl"], metrics["ratio_max"]

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        logp, old_logp, advantages, mask, inv_denom = ctx.saved_tensors
        layout, backend = ctx.params
        if backend == "cuda":
            from megatron_dapo.ops import _cuda_twins

            scale = (grad_loss, inv_denom)
            grad = _cuda_twins.pg_loss(logp, old_logp, advantages, mask, *layout.cuda_args(), grad_scale=scale)
        else:
            grad = pg_loss_grad(logp, old_logp, advantages, mask, grad_loss, inv_denom, layout)
        return grad, None, None, None, None, None, None


def _check_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, num_seqs: int | None) -> None:
    if num_seqs is None and logp.dim() != 2:
        raise ValueError(f"fused_surrogate_loss: logp must be [B, T], got shape {tuple(logp.shape)}")
    if num_seqs is not None and logp.dim() != 1:
        raise ValueError(f"fused_surrogate_loss: packed logp (cu_seqlens given) must be [N], got {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask)):
        if t.shape != logp.shape:
            raise ValueError(f"fused_surrogate_loss: {name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    per_seq = logp.shape[:1] if num_seqs is None else (num_seqs,)
    if advantages.shape not in (per_seq, logp.shape):
        raise ValueError(
            f"fused_surrogate_loss: advantages must be per sequence {tuple(per_seq)} or per token "
            f"{tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    if logp.numel() >= 2**31:
        raise ValueError(f"fused_surrogate_loss: {logp.numel()} tokens exceed the int32 indexing of the kernel")


def _aggregation_weights(
    valid: Tensor, seq_of: Tensor, num_seqs: int, num_tokens: float | Tensor | None, spec: Surrogate
) -> tuple[Tensor, float | Tensor | None]:
    """Per-token weights (valid's shape, fp32) and denominator that turn the kernel's sum(l * w) / D into
    `agg_loss(spec.agg)`: w = 1 (token-mean), 1 / tokens of its sequence (seq-mean-token-mean), 1 (token-sum) or
    1 / norm_length (token-sum-norm), zero off the mask; D for the sequence modes is the sequences with a valid
    token unless given. `seq_of`: each token's sequence index (valid's shape, int64)."""
    m = valid.to(torch.float32)
    if LOSS_DENOMINATOR_UNIT[spec.agg] == "tokens":
        return m, num_tokens
    seq_tokens = torch.zeros(num_seqs, dtype=torch.float32, device=m.device).index_add_(
        0, seq_of.reshape(-1), m.reshape(-1)
    )
    if spec.agg == "seq-mean-token-mean":
        weights = m / seq_tokens.clamp_min(1.0)[seq_of]
    elif spec.agg == "seq-mean-token-sum-norm":
        weights = m / float(spec.norm_length)
    else:
        weights = m
    if num_tokens is None:
        num_tokens = (seq_tokens > 0).to(torch.float32).sum()
    return weights, num_tokens


def _packed_reference(inputs: LossInputs, spec: Surrogate, cu_seqlens: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The reference on a packed layout: scatter the segments into padded rows and run `surrogate_loss` there."""
    starts = cu_seqlens.to(torch.long)
    lengths = starts[1:] - starts[:-1]
    num_seqs, width = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
    row = torch.repeat_interleave(torch.arange(num_seqs, device=starts.device), lengths)
    col = torch.arange(inputs.logp.numel(), device=starts.device) - starts[:-1][row]

    def rows(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        out = torch.zeros(num_seqs, width, dtype=t.dtype, device=t.device)
        return out.index_put((row, col), t)

    adv = inputs.advantages if inputs.advantages.shape == (num_seqs,) else rows(inputs.advantages)
    padded = LossInputs(
        rows(inputs.logp), rows(inputs.old_logp), adv, rows(inputs.mask), inputs.num_tokens, rows(inputs.weights)
    )
    return surrogate_loss(padded, spec)


def fused_surrogate_loss(
    inputs: LossInputs, spec: Surrogate, *, cu_seqlens: Tensor | None = None, backend: str | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Fused policy loss of any `Surrogate` (the kernel twin of `policy_loss.surrogate_loss`, same loss and metrics
    to fp32 rounding; the reference itself on CPU without the Triton interpreter).

    Args:
        inputs: LossInputs with [B, T] tensors (sequence = row), or with cu_seqlens packed [N] tensors of the
            sequences' tokens back to back (advantages [S] or [N]). logp fp32/bf16/fp16 is the only input that
            receives a gradient; mask bool or float (float values weight the loss; metrics count mask != 0).
        spec: the surrogate kind, clip bounds, aggregation and its constant (from the loss's config).
        cu_seqlens: [S + 1] int32/int64 sequence offsets of a packed layout, or None for padded rows.
        backend: "triton" (default) or "cuda" for CUDA tensors.
    Returns:
        loss: 0-dim fp32. metrics: 0-dim fp32 clipfrac_high, clipfrac_low, approx_kl, ratio_max.
    """
    logp, old_logp, advantages, mask = inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask
    num_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    _check_inputs(logp, old_logp, advantages, mask, num_seqs)
    chosen = kernel_backend(backend)
    if not use_triton(logp):
        return surrogate_loss(inputs, spec) if cu_seqlens is None else _packed_reference(inputs, spec, cu_seqlens)
    if not logp.is_cuda:
        chosen = "triton"  # the interpreter; the CUDA twin needs a GPU
    valid = mask != 0
    if cu_seqlens is None:
        num_seqs, seq_len = logp.shape[0], max(logp.shape[-1], 1)
        starts = torch.arange(num_seqs + 1, device=logp.device, dtype=torch.int32) * seq_len
        seq_of = torch.arange(num_seqs, device=logp.device).unsqueeze(-1).expand_as(logp)
        seq_ids = None
    else:
        seq_len, starts = 1, cu_seqlens.to(device=logp.device, dtype=torch.int32).contiguous()
        lengths = (starts[1:] - starts[:-1]).to(torch.long)
        if int(starts[0]) != 0 or int(starts[-1]) != logp.numel() or bool((lengths < 0).any()):
            raise ValueError(f"fused_surrogate_loss: cu_seqlens must rise from 0 to {logp.numel()}, got {cu_seqlens}")
        seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=logp.device), lengths)
        seq_ids = seq_of.to(torch.int32).contiguous()
    num_tokens = inputs.num_tokens
    if spec.agg != "token-mean":
        mask, num_tokens = _aggregation_weights(valid, seq_of, num_seqs, num_tokens, spec)
    if inputs.weights is not None:
        weights = inputs.weights
        if weights.shape != logp.shape:
            raise ValueError(f"fused_surrogate_loss: weights shape {tuple(weights.shape)} != logp {tuple(logp.shape)}")
        # sum(l * mask * w) / D: the kernel's float mask weight carries the IS weight (zero stays zero).
        m = mask.to(torch.float32)
        if num_tokens is None:
            num_tokens = m.sum()  # D stays the mask's, not the sum of the weights folded in below
        mask = torch.where(m != 0, m * weights.detach().to(torch.float32), torch.zeros_like(m))
    if mask.dtype == torch.bool:
        mask = mask.contiguous().view(torch.uint8)
    logp, old_logp, mask = logp.contiguous(), old_logp.detach().contiguous(), mask.contiguous()
    if spec.kind == "gspo" and chosen == "cuda":
        from megatron_dapo.ops import _cuda_twins

        seq_lr = _cuda_twins.seq_log_ratio(logp.detach(), old_logp, mask, starts)
    elif spec.kind == "gspo":
        seq_lr = sequence_log_ratio_fused(logp.detach(), old_logp, mask, starts)
    else:
        seq_lr = torch.zeros(1, dtype=torch.float32, device=logp.device)
    layout = _Layout(spec.kind, spec.bounds, seq_len, seq_ids, seq_lr)
    outs = FusedSurrogateFunction.apply(
        logp, old_logp, advantages.detach().contiguous(), mask, layout, num_tokens, chosen
    )
    loss, high, low, kl, rmax = outs
    return loss, {"clipfrac_high": high, "clipfrac_low": low, "approx_kl": kl, "ratio_max": rmax}


clipped_pg_loss = clip_loss_entry(
    fused_surrogate_loss,
    "clipped_pg_loss",
    """Fused DAPO clipped surrogate: `fused_surrogate_loss` of the "clip" kind with keyword clip constants; the
    arguments, loss and metrics of `policy_loss.dapo_policy_loss` (to fp32 rounding), plus `backend=` ("triton", the
    default, or "cuda" for CUDA tensors: see `fused_surrogate_loss`).

    ratio = exp(logp - old_logp); l = max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)); with clip_ratio_c,
    l = min(l, -A c) where A < 0. loss = sum(l * mask) / max(D, 1), D = num_tokens or mask.sum(). Shapes: logp,
    old_logp, mask [B, T]; advantages [B] or [B, T]; weights [B, T] or None.
    """,
)
