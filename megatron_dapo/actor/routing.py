"""Routing replay for MoE actors (actor.routing_replay), on megatron-core 0.16.1's RouterReplay.

    r2: the old-log-prob pass records each token's top-k experts per MoE layer; the update replays them, so every
        mini-batch and epoch routes as the policy that computed pi_old did (the importance ratio compares the same
        expert mixture).
    r3: the rollout engine's routing (what sampled the tokens) is replayed in both the old-log-prob pass and the
        update.

megatron's TopKRouter (moe_enable_routing_replay) owns one RouterReplay per layer: action RECORD stores the top-k
indices [tokens, k] it computed; REPLAY_FORWARD uses `target_topk_idx` instead (the probabilities are the router's
own scores gathered at those indices, so gradients still reach the router); REPLAY_BACKWARD pops a FIFO list (one
entry per `set_target_indices`) for the recompute of a full-recompute backward. megatron drives these through a
process-global list and static methods; `RoutingReplay` drives one model's instances directly (and takes them off
that list), per micro-batch:

    forward of micro-batch m:  set_target_indices(m's indices) on every layer, action REPLAY_FORWARD
    backward of micro-batch m: a hook on the stage's output switches to REPLAY_BACKWARD before the recompute runs;
                               the FIFO pops m's indices (backwards run in forward order under megatron's schedules)
    after the pass:            indices and actions cleared (nothing is held between passes)

Token order: the router sees the stage's hidden states [S, b, H] flattened s-major (row s * b + j): one packed row
(b = 1, T tokens: the micro-batch's rows back to back, then the alignment pad) or a padded micro-batch [b, width].
`routing_in_order` / `routing_by_row` convert between that order and per-row tensors [n_i, layers, k]. Tokens
without a given routing (the alignment pad, columns past a row's length, positions past a row's RoutedExperts: the
last token, which an engine never feeds) get experts 0..k-1 and do not count for the agreement: their outputs feed
no log-prob that is used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dapo.actor.distributed import ParallelGroups
from megatron_dapo.actor.packing import PackedLayout
from megatron_dapo.batch import RoutedExperts


def _filler(count: int, layers: int, k: int) -> Tensor:
    return torch.arange(k, dtype=torch.int64).expand(count, layers, k)


def routing_in_order(
    rows: list[Tensor], layout: PackedLayout | None, width: int, layers: int, k: int
) -> tuple[Tensor, Tensor]:
    """Per-row routing [n_i, layers, k] -> ([T, layers, k] int64 in the routers' token order, [T] bool: the tokens
    that have a given routing): packed (layout given: T = layout.num_tokens, row i at cu_seqlens[i]) or padded
    ([width, b] s-major: token (s, j) at s * b + j)."""
    if layout is not None:
        out = _filler(layout.num_tokens, layers, k).clone()
        real = torch.zeros(layout.num_tokens, dtype=torch.bool)
        cu = layout.cu_seqlens.tolist()
        for i, r in enumerate(rows):
            n = min(len(r), cu[i + 1] - cu[i])
            out[cu[i] : cu[i] + n] = r[:n]
            real[cu[i] : cu[i] + n] = True
        return out, real
    out = _filler(width * len(rows), layers, k).clone().view(width, len(rows), layers, k)
    real = torch.zeros(width, len(rows), dtype=torch.bool)
    for j, r in enumerate(rows):
        n = min(len(r), width)
        out[:n, j] = r[:n]
        real[:n, j] = True
    return out.view(width * len(rows), layers, k), real.view(-1)


def routing_by_row(flat: Tensor, layout: PackedLayout | None, lengths: list[int], width: int) -> list[Tensor]:
    """Inverse of `routing_in_order`: [T, layers, k] in the routers' order -> per row [n_i, layers, k] (n_i =
    lengths[i], the row's real tokens)."""
    if layout is not None:
        cu = layout.cu_seqlens.tolist()
        return [flat[cu[i] : cu[i] + n] for i, n in enumerate(lengths)]
    grid = flat.view(width, len(lengths), *flat.shape[1:])
    return [grid[:n, j] for j, n in enumerate(lengths)]


def moe_layer_flags(config: Any) -> list[bool]:
    """Per decoder layer of the whole model, whether it is MoE (megatron's moe_layer_freq: an int k puts the MoE
    block in every k-th layer from the first, a list gives each layer's 0 / 1; GLM-4.5's dense first layers)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(x) for x in freq]


class RoutingReplay:
    """Drives the RouterReplay instances of one model's MoE layers (this pipeline stage's), in layer order. Routing
    is indexed by MoE layer (dense layers have no router and no entry), as the engines record it."""

    def __init__(self, model: Any) -> None:
        """model: the unwrapped GPTModel built with config.moe_enable_routing_replay."""
        from megatron.core.transformer.moe.router_replay import RouterReplay
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        flags = moe_layer_flags(model.config)
        layers = [layer for layer in model.decoder.layers if flags[layer.layer_number - 1]]
        self.replays = [layer.mlp.router.router_replay for layer in layers]
        if any(r is None for r in self.replays):
            raise ValueError("RoutingReplay: every MoE layer must be built with moe_enable_routing_replay")
        for r in self.replays:  # driven here, not through megatron's process-global static methods
            RouterReplay.global_router_replay_instances.remove(r)
        self.topk = int(model.config.moe_router_topk)
        self.num_experts = int(model.config.num_moe_experts)
        self.total_layers = sum(flags)
        """MoE layers of the whole model."""
        self.first_layer = sum(flags[: layers[0].layer_number - 1]) if layers else 0
        """The MoE-layer index of this stage's first MoE layer."""
        self._real: Tensor | None = None  # [T] bool: the replayed forward's tokens that count for agreement
        self.agree = torch.zeros(len(self.replays), dtype=torch.float64)
        """Per layer, replayed tokens whose replayed top-k set equals the router's own (since `pop_agreement`)."""
        self.count = torch.zeros(len(self.replays), dtype=torch.float64)
        for j, r in enumerate(self.replays):
            r.get_replay_topk = self._counting(r, j)

    def _counting(self, replay: Any, j: int) -> Any:
        """replay.get_replay_topk that also counts, in a replayed forward, the real tokens whose replayed experts are
        the ones the router itself would pick (the top-k of the same scores): routing agreement."""
        replayed = replay.get_replay_topk

        def get_replay_topk(scores: Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                            default_compute_topk: Any = None) -> tuple[Tensor, Tensor]:  # fmt: skip
            probs, idx = replayed(scores, topk, num_groups, group_topk, default_compute_topk)
            if replay.router_replay_action == self._actions.REPLAY_FORWARD and self._real is not None:
                with torch.no_grad():
                    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    same = (own.sort(-1).values == idx.sort(-1).values).all(-1)
                    real = self._real.to(same.device)
                    self.agree[j] += float(same[real].sum())
                    self.count[j] += float(real.sum())
            return probs, idx

        return get_replay_topk

    @property
    def num_layers(self) -> int:
        return len(self.replays)

    def record(self) -> None:
        """The next forward records each layer's top-k (read with `recorded`)."""
        for r in self.replays:
            r.clear_indices()
            r.set_router_replay_action(self._actions.RECORD)

    def recorded(self) -> Tensor:
        """[T, layers, k] int64: what the last forward routed, in the routers' token order."""
        return torch.stack([r.get_recorded_indices().cpu() for r in self.replays], dim=1)

    def replay(self, ordered: Tensor, device: torch.device, real: Tensor | None = None) -> None:
        """The next forward (and the recompute of its backward) routes token t of layer j to ordered[t, j]; real
        [T] bool marks the tokens that count for the agreement (None: all)."""
        self._real = real if real is not None else torch.ones(len(ordered), dtype=torch.bool)
        for j, r in enumerate(self.replays):
            r.set_target_indices(ordered[:, j].to(device, torch.int64).contiguous())
            r.set_router_replay_action(self._actions.REPLAY_FORWARD)

    def replay_rows(self, routed: RoutedExperts | None, layout: Any, width: int, device: torch.device) -> bool:
        """Replay a micro-batch's given routing in the next forward: routed holds its rows' experts (every layer's,
        an engine's under r3, or this stage's), laid out as the micro-batch is (`layout` packed, else padded to
        `width`). None (no routing given, or an empty micro-batch): the routers route freely. Returns True when
        replaying."""
        if routed is None:
            self.off()
            return False
        rows = [routed.row(i) for i in range(len(routed))]
        if rows and rows[0].shape[1] != self.num_layers:  # every layer's routing: this stage's layers of it
            rows = [r[:, self.first_layer : self.first_layer + self.num_layers] for r in rows]
        packed = layout if isinstance(layout, PackedLayout) else None
        ordered, real = routing_in_order(rows, packed, width, self.num_layers, self.topk)
        self.replay(ordered, device, real)
        return True

    def backward_hook(self, grad: Tensor) -> Tensor:
        """Registered on a replayed forward's output: its backward (and recompute) pops the FIFO of indices."""
        for r in self.replays:
            r.set_router_replay_action(self._actions.REPLAY_BACKWARD)
        return grad

    def pop_agreement(self) -> tuple[Tensor, Tensor]:
        """(agreeing tokens, replayed tokens) per local layer since the last call, float64 [layers]; then zeroed."""
        out = (self.agree.clone(), self.count.clone())
        self.agree.zero_()
        self.count.zero_()
        return out

    def agreement_metrics(self, prefix: str, groups: ParallelGroups) -> dict[str, float]:
        """Routing agreement of the replayed forwards since the last call (collective over all ranks): per MoE layer
        the fraction of replayed tokens whose replayed top-k set is the one the router itself picks now, as
        {prefix}/routing_agreement (all layers, token-weighted), {prefix}/routing_agreement_min (worst layer) and
        {prefix}/routing_agreement_layer_{i} (i over the model's MoE layers). {} when nothing was replayed."""
        stats = torch.zeros(2, self.total_layers, dtype=torch.float64, device=groups.device)
        agree, count = self.pop_agreement()
        stats[0, self.first_layer : self.first_layer + len(agree)] = agree.to(groups.device)
        stats[1, self.first_layer : self.first_layer + len(count)] = count.to(groups.device)
        # Each stage holds its layers, each DP rank its tokens; TP ranks repeat the same routing (counted once).
        for group in (groups.pp_group, groups.dp_group):
            dist.all_reduce(stats, group=group)
        if stats[1].sum() == 0:
            return {}
        per_layer = (stats[0] / stats[1].clamp_min(1)).tolist()
        out = {f"{prefix}/routing_agreement": float(stats[0].sum() / stats[1].sum())}
        out[f"{prefix}/routing_agreement_min"] = min(per_layer)
        out.update({f"{prefix}/routing_agreement_layer_{i}": v for i, v in enumerate(per_layer)})
        return out

    def off(self) -> None:
        """Back to the routers' own top-k; indices dropped."""
        self._real = None
        for r in self.replays:
            r.clear_indices()
            r.clear_router_replay_action()
