"""The actor's loss plumbing: the log-prob implementation registry, per-sequence log-probs, loss denominators and
the Megatron `loss_func` factory. Pure torch: no megatron import (megatron_dapo.integration re-exports it).

    actor.logprob_impl --get_logprob_impl--> LogprobImpl(name, fn, takes_hidden)
        "reference"     fn(logits [T, V_local], labels [T], ...)         chunked pure torch (ops/reference.py)
        "fused"         fn(logits [T, V_local], labels [T], ...)         ops.logprobs_and_entropy
        "fused_linear"  fn(hidden [T, H], weight [V_local, H], labels, ...)  ops.linear_logprobs_and_entropy

    model output (last stage)
        logits [B, S, V_local] --sequence_logprobs_and_entropy-----------\
        hidden [B, S, H] + W   --sequence_logprobs_from_hidden------------+--> logp, entropy [B, S] (token-aligned)
                                                                          |
    make_loss_func(LossBatch(tokens, loss_mask, old_logp, advantages, num_tokens=D, ...), LossContext(...), loss)
        -> loss_func(output) -> (loss, metrics)      (dapo_loss_func: the integration API's keyword form of it)

Every implementation takes keyword arguments (temperature, tp_group, vocab_size) and returns fp32 (logp, entropy)
[T] each, differentiable w.r.t. its float inputs. Register a new one with `@register_logprob_impl(name)`; the
config check (`actor.logprob_impl`) reads the registry, so there is one switch and one list of names.

Normalisation (DESIGN.md, "token-level loss normalisation is global"): the loss of one micro-batch is
sum(l * mask) / D, where D = `num_tokens` is the valid-token count of the WHOLE mini-batch (all micro-batches, all
data-parallel ranks). Megatron's schedule then divides the returned loss by num_microbatches, and DDP pre-scales grads
by 1 / dp_size before its SUM all-reduce; the loss is multiplied by num_microbatches * dp_size to undo both, so the
final gradient is exactly d(sum over all tokens of l) / D.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.actor.packing import PackedLayout
from megatron_dapo.actor.packing import SharedPrefixLayout
from megatron_dapo.algorithms import LossInputs
from megatron_dapo.algorithms import PolicyLossConfig
from megatron_dapo.algorithms import get_policy_loss
from megatron_dapo.algorithms import loss_name
from megatron_dapo.algorithms.loss_configs import LOSS_DENOMINATOR_UNIT
from megatron_dapo.choices import LOSS_KERNELS
from megatron_dapo.config import choices
from megatron_dapo.config import register_choices
from megatron_dapo.metrics import Reduce
from megatron_dapo.metrics import Stat
from megatron_dapo.metrics import Stats
from megatron_dapo.registry import Registry

__all__ = [
    "LOGPROB_IMPLS",
    "LOSS_DENOMINATOR_UNIT",
    "LogprobImpl",
    "LOSS_KERNELS",
    "LossBatch",
    "LossContext",
    "dapo_loss_func",
    "loss_kernel",
    "make_loss_func",
    "get_logprob_fn",
    "get_logprob_impl",
    "local_loss_denominator",
    "micro_batch_logprobs",
    "register_logprob_impl",
    "sequence_logprobs_and_entropy",
    "sequence_logprobs_from_hidden",
]

LogProbFn = Callable[..., tuple[Tensor, Tensor]]


# ---------------------------------------------------------------------------------------------------------------
# the log-prob implementation registry (actor.logprob_impl)
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LogprobImpl:
    """One registered log-prob/entropy implementation.

    Attributes:
        name: the `actor.logprob_impl` value.
        fn: the function. takes_hidden=False: fn(logits [T, V_local], labels [T], *, temperature, tp_group,
            vocab_size); takes_hidden=True: fn(hidden [T, H], weight [V_local, H], labels [T], *, temperature,
            tp_group, vocab_size). Returns (logp, entropy) [T] fp32.
        takes_hidden: the model's last stage must return hidden states (no logits) and the LM-head weight is passed.
        kernel: the GPU implementation of its fused ops, "triton" or "cuda" (the csrc twins), or None for the
            pure-torch references; the policy loss then runs ops.pg_loss.fused_surrogate_loss on the same backend.
    """

    name: str
    fn: LogProbFn
    takes_hidden: bool = False
    kernel: str | None = None


LOGPROB_IMPLS: Registry[LogprobImpl] = Registry("actor.logprob_impl", "logprob impl")


def register_logprob_impl(
    name: str, *, takes_hidden: bool = False, kernel: str | None = None
) -> Callable[[LogProbFn], LogProbFn]:
    """Register a log-prob/entropy implementation under `name` (config field `actor.logprob_impl`)."""

    def wrap(fn: LogProbFn) -> LogProbFn:
        LOGPROB_IMPLS.add(name, LogprobImpl(name=name, fn=fn, takes_hidden=takes_hidden, kernel=kernel))
        if name not in choices("actor.logprob_impl"):  # the built-in ones are declared in choices.py
            register_choices("actor.logprob_impl", name)
        return fn

    return wrap


def get_logprob_impl(name: str) -> LogprobImpl:
    """The implementation registered as `name`; an unknown name raises ValueError naming the config field."""
    return LOGPROB_IMPLS.lookup(name)


def get_logprob_fn(impl: str = "fused") -> LogProbFn:
    """The function of a logits-input implementation ("reference" or "fused"); kept for outside users of
    `integration.get_logprob_fn`. Hidden-state implementations ("fused_linear") raise: they need the LM-head weight,
    see `sequence_logprobs_from_hidden`."""
    found = get_logprob_impl(impl)
    if found.takes_hidden:
        raise ValueError(f"get_logprob_fn: {impl!r} takes hidden states and a weight; use get_logprob_impl")
    return found.fn


# The ops are imported at call time: config validation reads this registry without importing Triton.
@register_logprob_impl("reference")
def _reference(logits: Tensor, labels: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
    from megatron_dapo.ops.reference import logprobs_and_entropy_chunked

    return logprobs_and_entropy_chunked(logits, labels, **kwargs)


@register_logprob_impl("fused", kernel="triton")
def _fused(logits: Tensor, labels: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
    from megatron_dapo.ops import logprobs_and_entropy

    return logprobs_and_entropy(logits, labels, **kwargs)


@register_logprob_impl("fused_cuda", kernel="cuda")
def _fused_cuda(logits: Tensor, labels: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
    """ "fused" on the CUDA C++ twins of csrc/ (GPU only; the library must be built, csrc/README.md)."""
    from megatron_dapo.ops import logprobs_and_entropy

    return logprobs_and_entropy(logits, labels, backend="cuda", **kwargs)


@register_logprob_impl("fused_linear", takes_hidden=True, kernel="triton")
def _fused_linear(hidden: Tensor, weight: Tensor, labels: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
    from megatron_dapo.ops import linear_logprobs_and_entropy

    return linear_logprobs_and_entropy(hidden, weight, labels, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# per-sequence log-probs
# ---------------------------------------------------------------------------------------------------------------
def _aligned(logp: Tensor, ent: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    pad = logp.new_zeros(tokens.shape[0], 1, dtype=torch.float32)
    return torch.cat([pad, logp.float()], dim=1), torch.cat([pad, ent.float()], dim=1)


def sequence_logprobs_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    logprob_fn: LogProbFn = _fused,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies aligned with the tokens (megatron_dapo.batch convention).

    Position t holds log p(tokens[t] | tokens[<t]) (from logits[t - 1]) and the entropy of that distribution;
    position 0 holds 0. Padded vocab columns (global id >= vocab_size) are ignored.

    Args:
        logits: [B, S, V_local] any float dtype, this rank's vocab shard (Megatron rank order in tp_group).
        tokens: [B, S] int64 global token ids.
        temperature: logits are divided by it (the sampling temperature).
        tp_group: tensor-parallel group of the vocab split, or None for the full vocab on this rank.
        vocab_size: true vocab size (HF config.vocab_size); None counts every column.
        logprob_fn: a logits-input implementation, see `get_logprob_impl` (default "fused").
    Returns:
        (logp, entropy): [B, S] fp32 each, differentiable w.r.t. logits; identical on every rank of tp_group.
    """
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(tokens.shape):
        raise ValueError(
            f"sequence_logprobs_and_entropy: logits {tuple(logits.shape)} must be [B, S, V_local] with [B, S] = "
            f"tokens {tuple(tokens.shape)}"
        )
    logp, ent = logprob_fn(
        logits[:, :-1], tokens[:, 1:], temperature=temperature, tp_group=tp_group, vocab_size=vocab_size
    )
    return _aligned(logp, ent, tokens)


def sequence_logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    logprob_fn: LogProbFn = _fused_linear,
) -> tuple[Tensor, Tensor]:
    """`sequence_logprobs_and_entropy` from the last hidden states and the LM-head weight: no [B, S, V] logits.

    Args:
        hidden: [B, S, H] any float dtype, the final-norm output (replicated over tp_group, i.e. already gathered
            when sequence parallel is on).
        weight: [V_local, H] same dtype, this rank's vocab shard of the output layer (or the tied embedding).
        tokens: [B, S] int64 global token ids.
        temperature, tp_group, vocab_size: as in `sequence_logprobs_and_entropy`.
        logprob_fn: a hidden-input implementation (default "fused_linear").
    Returns:
        (logp, entropy): [B, S] fp32 each, 0 at position 0; differentiable w.r.t. hidden (the full gradient on every
        tp rank) and weight (this rank's shard).
    """
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(tokens.shape) or hidden.shape[2] != weight.shape[-1]:
        raise ValueError(
            f"sequence_logprobs_from_hidden: hidden {tuple(hidden.shape)} must be [B, S, H] with [B, S] = tokens "
            f"{tuple(tokens.shape)} and H = weight {tuple(weight.shape)}[1]"
        )
    logp, ent = logprob_fn(
        hidden[:, :-1], weight, tokens[:, 1:], temperature=temperature, tp_group=tp_group, vocab_size=vocab_size
    )
    return _aligned(logp, ent, tokens)


def micro_batch_logprobs(
    output: Tensor,
    tokens: Tensor,
    *,
    packed: PackedLayout | SharedPrefixLayout | None = None,
    output_weight: Tensor | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    logprob_fn: LogProbFn = _fused,
    needed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row log-probs and entropies [b, S] of one micro-batch from the model's last-stage output.

    Args:
        output: logits [b, S, V_local], or hidden states [b, S, H] when `output_weight` is given; packed: the same
            for the one packed row, [1, T, V_local] / [1, T, H].
        tokens: [b, S] int64, the micro-batch's rows (the layout's source rows when packed).
        packed: the micro-batch's PackedLayout (actor.packing) or SharedPrefixLayout (actor.shared_prefix), or None
            for padded rows.
        output_weight: [V_local, H] LM-head weight for hidden-state input (a hidden-input `logprob_fn`).
        temperature, tp_group, vocab_size, logprob_fn: as in `sequence_logprobs_and_entropy`.
        needed: [b, S] bool/float or None; packed only: the LM head and log-prob op run only on the packed
            positions that predict these (row, column) tokens (e.g. the response), every other value is 0. The
            prompt's predictions are most of a packed row and nobody reads them.
    Returns:
        (logp, entropy): [b, S] fp32, token-aligned (position t: log p(tokens[t] | tokens[<t])), 0 at column 0; when
        packed also 0 past each row's length (and outside `needed`). Differentiable w.r.t. output (and
        output_weight).
    """
    kwargs = dict(temperature=temperature, tp_group=tp_group, vocab_size=vocab_size, logprob_fn=logprob_fn)
    select = None if packed is None or needed is None else needed.bool() & packed.valid
    if select is not None and bool(select.any()):  # (none: a dummy micro-batch, computed whole as before)
        return _packed_logprobs_at(output, packed, select, output_weight, **kwargs)
    source = packed.tokens if packed is not None else tokens
    if output_weight is not None:
        logp, ent = sequence_logprobs_from_hidden(output, output_weight, source, **kwargs)
    else:
        logp, ent = sequence_logprobs_and_entropy(output, source, **kwargs)
    if packed is not None:
        return packed.unpack(logp), packed.unpack(ent)
    return logp, ent


def _packed_logprobs_at(
    output: Tensor,
    packed: PackedLayout | SharedPrefixLayout,
    select: Tensor,
    output_weight: Tensor | None,
    *,
    logprob_fn: LogProbFn,
    **kwargs: object,
) -> tuple[Tensor, Tensor]:
    """`micro_batch_logprobs` of a packed micro-batch at the (row, column) positions `select` [b, S] bool only:
    the packed target positions q = index[select] are predicted from output[q - 1] (logits or hidden states) with
    labels tokens[q]; the n values are scattered back into [b, S] fp32 zeros (row-major, as `select` is read)."""
    if output.dim() != 3 or output.shape[0] != 1 or output.shape[1] != packed.num_tokens:
        raise ValueError(f"micro_batch_logprobs: packed output must be [1, {packed.num_tokens}, *], got {output.shape}")
    q = packed.index[select]
    src = output[0, q - 1]
    labels = packed.tokens[0, q]
    if output_weight is not None:
        logp, ent = logprob_fn(src, output_weight, labels, **kwargs)
    else:
        logp, ent = logprob_fn(src, labels, **kwargs)
    zeros = torch.zeros(select.shape, dtype=torch.float32, device=output.device)
    return zeros.masked_scatter(select, logp.float()), zeros.masked_scatter(select, ent.float())


# ---------------------------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------------------------
def local_loss_denominator(loss_mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """This rank's share of the loss denominator D: valid tokens ("token-mean"), or for the sequence-mean
    aggregations (loss.loss_agg_mode "seq-mean-*") the responses with at least one valid token. Sum it over
    micro-batches and all-reduce it (SUM) over data-parallel ranks to get the `num_tokens` of `dapo_loss_func`.

    Args:
        loss_mask: [B, S] float/bool, 1 on trained response tokens.
    Returns:
        0-dim fp32 tensor.
    """
    mask = loss_mask.to(torch.float32)
    if loss_agg_mode not in LOSS_DENOMINATOR_UNIT:
        raise ValueError(f"loss.loss_agg_mode: unknown {loss_agg_mode!r}; choose one of {list(LOSS_DENOMINATOR_UNIT)}")
    if LOSS_DENOMINATOR_UNIT[loss_agg_mode] == "sequences":
        return (mask.sum(dim=-1) > 0).to(torch.float32).sum()
    return mask.sum()


def _two(numerator: Tensor, denominator: Tensor) -> Tensor:
    return torch.stack([numerator.detach().float().reshape(()), denominator.detach().float().reshape(())])


LOSS_METRICS: dict[str, Reduce] = {
    "loss": Reduce.MEAN,
    "clipfrac_high": Reduce.MEAN,
    "clipfrac_low": Reduce.MEAN,
    "approx_kl": Reduce.MEAN,
    "entropy": Reduce.MEAN,
    "ratio_max": Reduce.MAX,
    "ref_kl": Reduce.MEAN,
}
"""What `dapo_loss_func`'s loss_func reports and how each combines over micro-batches, pipeline stages and DP ranks:
MEAN as a 2-element [numerator, denominator] tensor (Megatron-LM's convention), MAX as a 0-dim tensor. "ref_kl" only
for a loss with a KL term (`algorithms.policy_loss.uses_reference`)."""


def loss_metric_stats(metrics: dict[str, Tensor]) -> Stats:
    """One micro-batch's loss_func metrics as Stats (LOSS_METRICS), for `megatron_dapo.metrics.merge_stats`."""
    out: Stats = {}
    for key, value in metrics.items():
        if LOSS_METRICS[key] is Reduce.MEAN:
            num, den = value.double().tolist()
            out[key] = Stat.mean(num, den)
        else:
            out[key] = Stat(LOSS_METRICS[key], float(value))
    return out


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch's inputs of the policy loss (batch.py alignment: position t is token t).

    tokens: [B, S] int64 prompt + response tokens. loss_mask: [B, S] float, 1 on trained response tokens.
    old_logp: [B, S] float, the behaviour policy's log-probs (0 where the mask is 0). advantages: [B] float.
    num_tokens: D, the denominator of the WHOLE mini-batch: the sum of `local_loss_denominator` over micro-batches
    and data-parallel ranks. response_mask: [B, S] float, tokens whose entropy is reported (None: loss_mask).
    is_weight: [B, S] float or None, rollout-correction importance weights (ActorBatch.is_weight), passed to the loss
    as `weights` only when given (algorithm.rollout_correction "none" runs exactly the uncorrected call; MIS's
    rejected tokens are already out of loss_mask, hence out of D). ref_logp: [B, S] float or None, a frozen reference
    model's log-probs, required by a loss with a KL term (`algorithms.policy_loss.uses_reference`). packed: the
    micro-batch packed into one row (actor/packing.py): the output is then [1, T, *] for the packed tokens and the
    per-token values are unpacked to [B, S] before the loss; the LM head runs only on the positions that predict
    response tokens (response_mask or loss_mask).
    """

    tokens: Tensor
    loss_mask: Tensor
    old_logp: Tensor
    advantages: Tensor
    num_tokens: float | Tensor
    response_mask: Tensor | None = None
    is_weight: Tensor | None = None
    ref_logp: Tensor | None = None
    packed: PackedLayout | SharedPrefixLayout | None = None


@dataclass(frozen=True)
class LossContext:
    """How one rank reads the model's output and scales the loss for Megatron (the same for every micro-batch).

    temperature: the sampling temperature the logits are divided by. tp_group / vocab_size: the vocab-parallel group
    and the true vocab size (see `sequence_logprobs_and_entropy`). num_microbatches: micro-batches per optimizer step
    on this rank (Megatron divides the loss by it); dp_size: data-parallel size (Megatron DDP averages gradients over
    it); pass 1 for both if your loop already sums micro-batch losses and all-reduces gradients with SUM.
    logprob_fn: the log-prob/entropy implementation (`get_logprob_impl(name).fn`), a hidden-input one when
    output_weight is given. output_weight: [V_local, H] LM-head weight (this rank's shard): the output is then the
    last hidden states and log-probs come from `sequence_logprobs_from_hidden` (no logits). loss_kernel: the policy
    loss's implementation: None for the pure-torch reference, "triton" or "cuda" for the fused kernel
    (ops.pg_loss.fused_surrogate_loss, every registered loss; it falls back to the reference on CPU without the
    Triton interpreter). `kernels(actor.logprob_impl, actor.loss_kernel)` resolves the last two from the config.
    """

    temperature: float = 1.0
    tp_group: dist.ProcessGroup | None = None
    vocab_size: int | None = None
    num_microbatches: int = 1
    dp_size: int = 1
    logprob_fn: LogProbFn = _fused
    output_weight: Tensor | None = None
    loss_kernel: str | None = None


def loss_kernel(logprob_impl: str, choice: str = "auto") -> str | None:
    """The policy loss's kernel (LossContext.loss_kernel) for actor.logprob_impl and actor.loss_kernel: "auto" takes
    the log-prob implementation's backend (None for "reference"), "reference" is None, "triton" / "cuda" as named."""
    if choice not in LOSS_KERNELS:
        raise ValueError(f"actor.loss_kernel: unknown {choice!r}; choose one of {list(LOSS_KERNELS)}")
    if choice == "auto":
        return get_logprob_impl(logprob_impl).kernel
    return None if choice == "reference" else choice


def make_loss_func(
    batch: LossBatch, ctx: LossContext, loss: PolicyLossConfig | None = None
) -> Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]:
    """Build the `loss_func(output_tensor)` of one micro-batch for a Megatron forward_step_func.

    The policy loss is the registered one whose config `loss` is (a PolicyLossConfig subclass from
    algorithms/losses/, e.g. RunConfig.loss; None: DAPO with the paper's constants), divided by the global
    denominator batch.num_tokens.

    Returns:
        loss_func(output_tensor) -> (loss, metrics). output_tensor is [B, S, V_local] logits, [B, S, H] hidden
        states (with ctx.output_weight) or [B, S] fp32 log-probs aligned with the tokens. loss: 0-dim fp32,
        sum(l * mask) / D * num_microbatches * dp_size. metrics: 2-element fp32 tensors [numerator, denominator]
        (Megatron-LM's reduction convention: sum both over micro-batches and DP ranks, then divide): "loss"
        (numerator loss * D, denominator this micro-batch's share of D), "clipfrac_high", "clipfrac_low",
        "approx_kl", "entropy" (logits or hidden input only), "ref_kl" (a loss with a KL term); plus "ratio_max"
        (0-dim). LOSS_METRICS says how each combines.
    """
    loss_cfg = loss if loss is not None else get_policy_loss("dapo").make_config()
    policy_loss = get_policy_loss(loss_name(loss_cfg))
    tokens, num_tokens = batch.tokens, batch.num_tokens
    resp = (batch.response_mask if batch.response_mask is not None else batch.loss_mask).to(torch.float32)
    mask = batch.loss_mask.to(torch.float32)
    scale = float(ctx.num_microbatches * ctx.dp_size)
    kwargs = dict(
        temperature=ctx.temperature, tp_group=ctx.tp_group, vocab_size=ctx.vocab_size, logprob_fn=ctx.logprob_fn
    )
    is_weight_f32 = None if batch.is_weight is None else batch.is_weight.to(torch.float32)
    needed = (resp > 0) | (mask > 0)  # packed: the LM head runs on these predictions only

    def loss_func(output_tensor: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        entropy = None
        if ctx.output_weight is not None or output_tensor.dim() == 3:
            logp, entropy = micro_batch_logprobs(
                output_tensor, tokens, packed=batch.packed, output_weight=ctx.output_weight, needed=needed, **kwargs
            )
        elif tuple(output_tensor.shape) == tuple(tokens.shape):
            logp = output_tensor.float()
        else:
            raise ValueError(
                f"dapo loss_func: output must be [B, S, V_local] logits or [B, S] log-probs with [B, S] = "
                f"{tuple(tokens.shape)}, got {tuple(output_tensor.shape)}"
            )
        inputs = LossInputs(logp, batch.old_logp, batch.advantages, mask, num_tokens, is_weight_f32, batch.ref_logp)
        loss, stats = policy_loss(inputs, loss_cfg, ctx.loss_kernel or False)
        count = mask.sum()
        denom = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss.device).clamp_min(1.0)
        metrics = {"loss": _two(loss.detach() * denom, local_loss_denominator(mask, loss_cfg.loss_agg_mode))}
        for key in ("clipfrac_high", "clipfrac_low", "approx_kl", "ref_kl"):
            if key in stats:
                metrics[key] = _two(stats[key] * count, count)
        metrics["ratio_max"] = stats["ratio_max"].detach().float().reshape(())
        if entropy is not None:
            metrics["entropy"] = _two((entropy.detach() * resp).sum(), resp.sum())
        return loss * scale, metrics

    return loss_func


def dapo_loss_func(
    tokens: Tensor,
    loss_mask: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    num_tokens: float | Tensor,
    loss: PolicyLossConfig | None = None,
    response_mask: Tensor | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    num_microbatches: int = 1,
    dp_size: int = 1,
    logprob_fn: LogProbFn = _fused,
    output_weight: Tensor | None = None,
    packed: PackedLayout | SharedPrefixLayout | None = None,
    fused_loss: bool | str = False,
    is_weight: Tensor | None = None,
    ref_logp: Tensor | None = None,
) -> Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]:
    """The integration API's keyword form of `make_loss_func` (megatron_dapo.integration; outside Megatron scripts
    call it in their forward_step_func): the fields of LossBatch and LossContext as keywords, fused_loss being
    LossContext.loss_kernel (True means "triton", False the reference). The actor calls `make_loss_func`."""
    kernel = "triton" if fused_loss is True else (fused_loss or None)
    batch = LossBatch(tokens, loss_mask, old_logp, advantages, num_tokens, response_mask, is_weight, ref_logp, packed)
    ctx = LossContext(temperature, tp_group, vocab_size, num_microbatches, dp_size, logprob_fn, output_weight, kernel)
    return make_loss_func(batch, ctx, loss)
