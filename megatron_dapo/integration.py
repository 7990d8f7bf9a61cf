"""DAPO for people with their own Megatron training scripts: three pieces, no megatron import here.

    your forward_step_func(data_iterator, model)
        output = model(tokens, position_ids, None)            # [B, S, V_local] vocab-parallel logits
        return output, dapo_loss_func(tokens, loss_mask, old_logp, advantages, num_tokens=D, ...)
                                 |
                                 v   loss_func(output) -> (scaled loss, {metric: [numerator, denominator]})
    get_forward_backward_func()(...)  --> grads = d(sum of per-token losses) / D, whatever the TP/PP/DP split

1. `dapo_loss_func(...)` builds the `loss_func` a Megatron forward_step_func returns. It accepts vocab-parallel logits
   [B, S, V_local] (GPTModel's output without labels) or per-token log-probs [B, S] already aligned with the tokens.
2. `logprobs_and_entropy` (re-exported from megatron_dapo.ops) and `sequence_logprobs_and_entropy`: per-token
   log-probs and entropy from vocab-parallel logits, with temperature and Megatron's padded vocab masked out.
3. `add_dapo_args(parser)` / `dapo_config_from_args(args)`: every AlgorithmConfig field as `--dapo-<field>`.

Normalisation (DESIGN.md, "token-level loss normalisation is global"): the loss of one micro-batch is
sum(l * mask) / D, where D = `num_tokens` is the valid-token count of the WHOLE mini-batch (all micro-batches, all
data-parallel ranks). Megatron's schedule then divides the returned loss by num_microbatches, and DDP pre-scales grads
by 1 / dp_size before its SUM all-reduce; the loss is multiplied by num_microbatches * dp_size to undo both, so the
final gradient is exactly d(sum over all tokens of l) / D. (The alternative, Megatron's
`calculate_per_token_loss=True` path, divides by a token count Megatron computes itself; we keep D explicit so the
sequence-mean aggregations (algorithm.loss_agg_mode "seq-mean-*") work the same way.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.algorithms import get_policy_loss
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import ConfigError
from megatron_dapo.ops import logprobs_and_entropy
from megatron_dapo.ops.reference import logprobs_and_entropy_chunked

__all__ = [
    "add_dapo_args",
    "dapo_config_from_args",
    "dapo_loss_func",
    "get_logprob_fn",
    "local_loss_denominator",
    "logprobs_and_entropy",
    "sequence_logprobs_and_entropy",
]

LogProbFn = Callable[..., tuple[Tensor, Tensor]]

# What each registered policy loss divides by (its `num_tokens` argument): "tokens" (token-mean) or "sequences"
# (seq-mean-* aggregations). Losses not listed divide by tokens.
LOSS_DENOMINATOR_UNIT = {"token-mean": "tokens", "seq-mean-token-mean": "sequences", "seq-mean-token-sum": "sequences"}

ARG_PREFIX = "dapo"


def get_logprob_fn(impl: str = "fused") -> LogProbFn:
    """The log-prob/entropy implementation named by `actor.logprob_impl`: "fused" (megatron_dapo.ops dispatch) or
    "reference" (the chunked pure-torch version). Both take (logits, labels, *, temperature, tp_group, vocab_size)."""
    if impl == "fused":
        return logprobs_and_entropy
    if impl == "reference":
        return logprobs_and_entropy_chunked
    raise ValueError(f"actor.logprob_impl: unknown {impl!r}; choose 'fused' or 'reference'")


def sequence_logprobs_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    logprob_fn: LogProbFn = logprobs_and_entropy,
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
        logprob_fn: implementation, see `get_logprob_fn`.
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
    pad = logp.new_zeros(tokens.shape[0], 1)
    return torch.cat([pad, logp.float()], dim=1), torch.cat([pad, ent.float()], dim=1)


def local_loss_denominator(loss_mask: Tensor, loss_agg_mode: str = "token-mean") -> Tensor:
    """This rank's share of the loss denominator D: valid tokens ("token-mean"), or for the sequence-mean
    aggregations (algorithm.loss_agg_mode "seq-mean-*") the responses with at least one valid token. Sum it over
    micro-batches and all-reduce it (SUM) over data-parallel ranks to get the `num_tokens` of `dapo_loss_func`.

    Args:
        loss_mask: [B, S] float/bool, 1 on trained response tokens.
    Returns:
        0-dim fp32 tensor.
    """
    mask = loss_mask.to(torch.float32)
    if loss_agg_mode not in LOSS_DENOMINATOR_UNIT:
        raise ValueError(
            f"algorithm.loss_agg_mode: unknown {loss_agg_mode!r}; choose one of {list(LOSS_DENOMINATOR_UNIT)}"
        )
    if LOSS_DENOMINATOR_UNIT[loss_agg_mode] == "sequences":
        return (mask.sum(dim=-1) > 0).to(torch.float32).sum()
    return mask.sum()


def _two(numerator: Tensor, denominator: Tensor) -> Tensor:
    return torch.stack([numerator.detach().float().reshape(()), denominator.detach().float().reshape(())])


def dapo_loss_func(
    tokens: Tensor,
    loss_mask: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    num_tokens: float | Tensor,
    algorithm: AlgorithmConfig | None = None,
    response_mask: Tensor | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    num_microbatches: int = 1,
    dp_size: int = 1,
    logprob_fn: LogProbFn = logprobs_and_entropy,
) -> Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]:
    """Build the `loss_func(output_tensor)` of one micro-batch for a Megatron forward_step_func.

    The policy loss is `algorithm.policy_loss` from the registry (default "dapo": decoupled clip with eps_low /
    effective_eps_high, optional dual clip clip_ratio_c), divided by the global denominator `num_tokens`.

    Args:
        tokens: [B, S] int64 prompt + response tokens of this micro-batch.
        loss_mask: [B, S] float, 1 on trained response tokens (batch.py alignment: position t is token t).
        old_logp: [B, S] float, log-probs of the behaviour policy (0 where the mask is 0).
        advantages: [B] float.
        num_tokens: D, the denominator of the WHOLE mini-batch: sum of `local_loss_denominator` over micro-batches
            and data-parallel ranks.
        algorithm: loss hyperparameters (AlgorithmConfig defaults when None).
        response_mask: [B, S] float, tokens whose entropy is reported (default: loss_mask).
        temperature: sampling temperature the logits are divided by.
        tp_group / vocab_size: vocab-parallel group and true vocab size (see `sequence_logprobs_and_entropy`).
        num_microbatches: micro-batches per optimizer step on this rank (Megatron divides the loss by it).
        dp_size: data-parallel size (Megatron DDP averages gradients over it). Pass 1 for both if your loop already
            sums micro-batch losses and all-reduces gradients with SUM.
        logprob_fn: log-prob/entropy implementation.
    Returns:
        loss_func(output_tensor) -> (loss, metrics). output_tensor is [B, S, V_local] logits or [B, S] fp32
        log-probs aligned with the tokens. loss: 0-dim fp32, sum(l * mask) / D * num_microbatches * dp_size.
        metrics: 2-element fp32 tensors [numerator, denominator] (Megatron-LM's reduction convention: sum both over
        micro-batches and DP ranks, then divide): "loss" (numerator loss * D, denominator this micro-batch's share
        of D),
        "clipfrac_high", "clipfrac_low", "approx_kl", "entropy" (logits input only); plus "ratio_max" (0-dim).
    """
    alg = algorithm if algorithm is not None else AlgorithmConfig()
    policy_loss = get_policy_loss(alg.policy_loss)
    resp = (response_mask if response_mask is not None else loss_mask).to(torch.float32)
    mask = loss_mask.to(torch.float32)
    scale = float(num_microbatches * dp_size)

    def loss_func(output_tensor: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        entropy = None
        if output_tensor.dim() == 3:
            logp, entropy = sequence_logprobs_and_entropy(
                output_tensor,
                tokens,
                temperature=temperature,
                tp_group=tp_group,
                vocab_size=vocab_size,
                logprob_fn=logprob_fn,
            )
        elif tuple(output_tensor.shape) == tuple(tokens.shape):
            logp = output_tensor.float()
        else:
            raise ValueError(
                f"dapo loss_func: output must be [B, S, V_local] logits or [B, S] log-probs with [B, S] = "
                f"{tuple(tokens.shape)}, got {tuple(output_tensor.shape)}"
            )
        loss, stats = policy_loss(
            logp,
            old_logp,
            advantages,
            mask,
            eps_low=alg.eps_low,
            eps_high=alg.effective_eps_high,
            clip_ratio_c=alg.clip_ratio_c,
            num_tokens=num_tokens,
            loss_agg_mode=alg.loss_agg_mode,
        )
        count = mask.sum()
        denom = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss.device).clamp_min(1.0)
        metrics = {"loss": _two(loss.detach() * denom, local_loss_denominator(mask, alg.loss_agg_mode))}
        for key in ("clipfrac_high", "clipfrac_low", "approx_kl"):
            metrics[key] = _two(stats[key] * count, count)
        metrics["ratio_max"] = stats["ratio_max"].detach().float().reshape(())
        if entropy is not None:
            metrics["entropy"] = _two((entropy.detach() * resp).sum(), resp.sum())
        return loss * scale, metrics

    return loss_func


# ---------------------------------------------------------------------------------------------------------------
# argparse: --dapo-<field> for every AlgorithmConfig field
# ---------------------------------------------------------------------------------------------------------------
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (first sentence), read from the source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _converter(tp: Any, flag: str) -> Callable[[str], Any]:
    """argparse `type=` for a field annotation: int, float, str, bool, or X | None ("none"/"null" -> None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(tp) if t is not type(None)]
        base = _converter(inner[0], flag)
        return lambda text: None if text.strip().lower() in ("none", "null") else base(text)
    if tp is bool:

        def to_bool(text: str) -> bool:
            low = text.strip().lower()
            if low in ("true", "yes", "on", "1"):
                return True
            if low in ("false", "no", "off", "0"):
                return False
            raise argparse.ArgumentTypeError(f"{flag}: expected a boolean, got {text!r}")

        return to_bool
    if tp in (int, float, str):

        def convert(text: str) -> Any:
            try:
                return tp(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{flag}: expected {tp.__name__}, got {text!r}") from None

        return convert
    raise TypeError(f"{flag}: unsupported AlgorithmConfig field type {tp!r}")


def _flag(name: str) -> str:
    return f"--{ARG_PREFIX}-{name.replace('_', '-')}"


def add_dapo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one `--dapo-<field>` argument per AlgorithmConfig field (generated from the dataclass, defaults shown).

    Example: --dapo-eps-low 0.2 --dapo-eps-high 0.28 --dapo-clip-ratio-c none --dapo-overlong-filtering true.
    Works as Megatron-LM's `extra_args_provider`. Returns the parser.
    """
    hints = typing.get_type_hints(AlgorithmConfig)
    docs = _field_docs(AlgorithmConfig)
    defaults = AlgorithmConfig()
    group = parser.add_argument_group("DAPO algorithm (megatron_dapo.config.AlgorithmConfig)")
    for f in dataclasses.fields(AlgorithmConfig):
        flag = _flag(f.name)
        default = getattr(defaults, f.name)
        group.add_argument(
            flag,
            dest=f"{ARG_PREFIX}_{f.name}",
            type=_converter(hints[f.name], flag),
            default=argparse.SUPPRESS,
            metavar=getattr(hints[f.name], "__name__", "VALUE").upper(),
            help=f"{docs.get(f.name, '')} (default: {default})".strip().replace("%", "%%"),
        )
    return parser


def dapo_config_from_args(args: argparse.Namespace) -> AlgorithmConfig:
    """AlgorithmConfig from the `--dapo-*` arguments of `add_dapo_args` (unset ones keep their defaults).

    Raises ConfigError naming the flag when a value breaks a rule (e.g. eps_high < eps_low).
    """
    values = {}
    for f in dataclasses.fields(AlgorithmConfig):
        dest = f"{ARG_PREFIX}_{f.name}"
        if hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    try:
        return AlgorithmConfig(**values)
    except ConfigError as err:
        text = str(err)
        for name in values:
            text = text.replace(f"algorithm.{name}", _flag(name))
        raise ConfigError(f"--{ARG_PREFIX}-* arguments: {text}") from None
