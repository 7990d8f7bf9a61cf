"""DAPO for people with their own Megatron training scripts: three pieces, no megatron import here.

    your forward_step_func(data_iterator, model)
        output = model(tokens, position_ids, None)            # [B, S, V_local] vocab-parallel logits
        return output, dapo_loss_func(tokens, loss_mask, old_logp, advantages, num_tokens=D, ...)
                                 |
                                 v   loss_func(output) -> (scaled loss, {metric: [numerator, denominator]})
    get_forward_backward_func()(...)  --> grads = d(sum of per-token losses) / D, whatever the TP/PP/DP split

1. `dapo_loss_func(...)` builds the `loss_func` a Megatron forward_step_func returns. It accepts vocab-parallel logits
   [B, S, V_local] (GPTModel's output without labels), per-token log-probs [B, S] already aligned with the tokens,
   or (with `output_weight=`) the last hidden states [B, S, H] so that no [B, S, V] logits exist. It is the keyword
   form of `make_loss_func(LossBatch(...), LossContext(...), loss)`, which groups the micro-batch's tensors and the
   rank's context (the actor's own call).
2. `logprobs_and_entropy` / `linear_logprobs_and_entropy` (re-exported from megatron_dapo.ops),
   `sequence_logprobs_and_entropy` / `sequence_logprobs_from_hidden`: per-token log-probs and entropy from
   vocab-parallel logits or from hidden states + LM-head weight, with temperature and Megatron's padded vocab masked
   out. `get_logprob_impl(name)` is the registry behind `actor.logprob_impl` ("reference", "fused", "fused_linear").
   `PackedLayout.build(tokens, lengths)` packs a micro-batch into one THD row (cu_seqlens for Megatron's
   PackedSeqParams); `dapo_loss_func(..., packed=layout)` then takes the packed output and unpacks per-token values.
3. `add_dapo_args(parser)` / `dapo_config_from_args(args)` / `dapo_loss_config_from_args(args)`: every
   AlgorithmConfig field as `--dapo-<field>`, every policy loss's own field as `--dapo-loss-<field>`.

Pieces 1 and 2 live in megatron_dapo/actor/loss.py (the actor's own loss plumbing, pure torch) and are re-exported
here; this module is the stable public face. Normalisation is described there: the loss of one micro-batch is
sum(l * mask) / D with D = `num_tokens`, the valid-token count of the WHOLE mini-batch (all micro-batches, all
data-parallel ranks), and the loss is multiplied by num_microbatches * dp_size to undo Megatron's averaging, so the
final gradient is exactly d(sum over all tokens of l) / D. (The alternative, Megatron's
`calculate_per_token_loss=True` path, divides by a token count Megatron computes itself; we keep D explicit so the
sequence-mean aggregations (loss.loss_agg_mode "seq-mean-*") work the same way.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Callable
from typing import Any

from megatron_dapo.actor.loss import LOSS_DENOMINATOR_UNIT
from megatron_dapo.actor.loss import LossBatch
from megatron_dapo.actor.loss import LossContext
from megatron_dapo.actor.loss import dapo_loss_func
from megatron_dapo.actor.loss import get_logprob_fn
from megatron_dapo.actor.loss import get_logprob_impl
from megatron_dapo.actor.loss import local_loss_denominator
from megatron_dapo.actor.loss import make_loss_func
from megatron_dapo.actor.loss import sequence_logprobs_and_entropy
from megatron_dapo.actor.loss import sequence_logprobs_from_hidden
from megatron_dapo.actor.packing import PackedLayout
from megatron_dapo.algorithms import POLICY_LOSSES
from megatron_dapo.algorithms import PolicyLossConfig
from megatron_dapo.algorithms import get_policy_loss
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import ConfigError
from megatron_dapo.config import coerce_field
from megatron_dapo.ops import linear_logprobs_and_entropy
from megatron_dapo.ops import logprobs_and_entropy

__all__ = [
    "LOSS_DENOMINATOR_UNIT",
    "LossBatch",
    "LossContext",
    "PackedLayout",
    "add_dapo_args",
    "dapo_config_from_args",
    "dapo_loss_config_from_args",
    "dapo_loss_func",
    "get_logprob_fn",
    "get_logprob_impl",
    "linear_logprobs_and_entropy",
    "local_loss_denominator",
    "logprobs_and_entropy",
    "make_loss_func",
    "sequence_logprobs_and_entropy",
    "sequence_logprobs_from_hidden",
]

ARG_PREFIX = "dapo"
LOSS_PREFIX = "loss_"  # --dapo-loss-<field>: the policy loss's own fields


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
    """argparse `type=` for a field annotation: config.coerce_field, its error as argparse's."""

    def convert(text: str) -> Any:
        try:
            return coerce_field(text, tp, flag)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def _flag(name: str) -> str:
    return f"--{ARG_PREFIX}-{name.replace('_', '-')}"


def _add_fields(group: argparse._ArgumentGroup, cls: type, defaults: Any, prefix: str, seen: set[str]) -> None:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if name in seen:  # a field several losses share (eps_low, loss_agg_mode, ...) is one flag
            continue
        seen.add(name)
        flag = _flag(name)
        default = getattr(defaults, f.name)
        group.add_argument(
            flag,
            dest=f"{ARG_PREFIX}_{name}",
            type=_converter(hints[f.name], flag),
            default=argparse.SUPPRESS,
            metavar=getattr(hints[f.name], "__name__", "VALUE").upper(),
            help=f"{docs.get(f.name, '')} (default: {default})".strip().replace("%", "%%"),
        )


def add_dapo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--dapo-<field>` per AlgorithmConfig field and `--dapo-loss-<field>` per field of the registered policy
    losses' configs (generated from the dataclasses; defaults shown: the loss's own, DAPO's where losses share one).

    Example: --dapo-policy-loss dapo --dapo-loss-eps-high 0.28 --dapo-loss-clip-ratio-c none
    --dapo-overlong-filtering true. Works as Megatron-LM's `extra_args_provider`. Returns the parser.
    """
    seen: set[str] = set()
    group = parser.add_argument_group("DAPO algorithm (megatron_dapo.config.AlgorithmConfig)")
    _add_fields(group, AlgorithmConfig, AlgorithmConfig(), "", seen)
    group = parser.add_argument_group(
        "Policy loss (megatron_dapo/algorithms/losses/, the one --dapo-policy-loss names)"
    )
    for name in ("dapo", *sorted(set(POLICY_LOSSES) - {"dapo"})):
        entry = POLICY_LOSSES[name]
        _add_fields(group, entry.config_cls, entry.make_config(), LOSS_PREFIX, seen)
    return parser


def _rename_flags(text: str, names: list[str], section: str, prefix: str) -> str:
    for name in names:
        text = text.replace(f"{section}.{name}", _flag(prefix + name))
    return text


def dapo_config_from_args(args: argparse.Namespace) -> AlgorithmConfig:
    """AlgorithmConfig from the `--dapo-*` arguments of `add_dapo_args` (unset ones keep their defaults).

    Raises ConfigError naming the flag when a value breaks a rule (e.g. max_gen_batches 0 without a time bound).
    """
    values = {}
    for f in dataclasses.fields(AlgorithmConfig):
        dest = f"{ARG_PREFIX}_{f.name}"
        if hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    try:
        return AlgorithmConfig(**values)
    except ConfigError as err:
        raise ConfigError(
            f"--{ARG_PREFIX}-* arguments: {_rename_flags(str(err), list(values), 'algorithm', '')}"
        ) from None


def dapo_loss_config_from_args(args: argparse.Namespace, max_response_length: int | None = None) -> PolicyLossConfig:
    """The policy loss's config (pass it to `dapo_loss_func(loss=...)`) from `--dapo-policy-loss` and the
    `--dapo-loss-*` arguments; unset fields keep the loss's defaults. A flag that is not a field of the chosen loss,
    or a value breaking the loss's rules, raises ConfigError naming the flag. `max_response_length` resolves Dr.
    GRPO's norm_length 0 (the generation cap); without it dr_grpo needs --dapo-loss-norm-length.
    """
    name = getattr(args, f"{ARG_PREFIX}_policy_loss", AlgorithmConfig().policy_loss)
    try:
        entry = get_policy_loss(name)
    except ValueError as err:
        raise ConfigError(f"{_flag('policy_loss')}: {err}") from None
    given = {
        key[len(f"{ARG_PREFIX}_{LOSS_PREFIX}") :]: val
        for key, val in vars(args).items()
        if key.startswith(f"{ARG_PREFIX}_{LOSS_PREFIX}")
    }
    try:
        cfg = entry.make_config(given)
    except ValueError as err:
        text = str(err)
        field = text.split(":", 1)[0]
        raise ConfigError(f"{_flag(LOSS_PREFIX + field)}:{text.split(':', 1)[1]} (policy loss {name!r})") from None
    if getattr(cfg, "norm_length", None) == 0 and max_response_length is not None:
        cfg = dataclasses.replace(cfg, norm_length=max_response_length)
    return cfg
