"""Pure-torch references of the fused ops: the CPU path (chunked, memory-bounded) and the float64 test oracles.

Conventions shared with the Triton kernels (see ops/logprob_entropy.py):
- Vocab-parallel layout is Megatron's: rank r of `tp_group` holds global columns [r * V_local, (r + 1) * V_local).
- `vocab_size` is the true global vocabulary; columns with global id >= vocab_size (Megatron's padding) are ignored
  (treated as probability 0, gradient 0). None means every column counts. Logits equal to -inf are also allowed.
- Each rank computes per-token stats of its own shard (lse, entropy, target logit); `combine_vocab_shards` merges
  them with one all_gather of [3, T] fp32. The backward pass needs no communication for the logits gradient.

The chunked functions never hold more than [chunk_tokens, V_local] fp32 temporaries; the `*_naive` ones build the
whole [T, V] float64 problem and are for tests only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

# Elements of fp32 scratch per chunk of the CPU path (a few such temporaries live at once): 4M -> 16 MB each.
CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------------------------
# vocab-parallel helpers (shared by the kernels and the references)
# ---------------------------------------------------------------------------------------------------------------
def vocab_shard(v_local: int, tp_group: dist.ProcessGroup | None, vocab_size: int | None) -> tuple[int, int, int]:
    """This rank's vocab slice: (class_start, n_valid, global_vocab_size).

    n_valid is the number of leading local columns that are real tokens (the rest is padding).
    """
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    padded = v_local * world
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValueError(f"logprobs_and_entropy: vocab_size={vocab_size} must be in (0, V_local * tp = {padded}]")
    class_start = rank * v_local
    n_valid = max(0, min(v_local, vocab_size - class_start))
    return class_start, n_valid, vocab_size


class Columns(NamedTuple):
    """The vocabulary columns one kernel launch sees: scores are multiplied by inv_temp (1 / temperature), column 0
    is global token id class_start, the first n_valid columns are real tokens (the rest Megatron's padding)."""

    inv_temp: float
    class_start: int
    n_valid: int

    @classmethod
    def of_shard(cls, v_local: int, tp_group: dist.ProcessGroup | None, vocab_size: int | None, temperature: float):
        """This rank's shard of v_local columns (`vocab_shard`) at `temperature`."""
        class_start, n_valid, _ = vocab_shard(v_local, tp_group, vocab_size)
        return cls(1.0 / temperature, class_start, n_valid)

    def window(self, v0: int, v1: int) -> Columns:
        """Columns [v0, v1) of these (v1 <= n_valid): a vocab tile of the shard."""
        return Columns(self.inv_temp, self.class_start + v0, v1 - v0)


def check_inputs(scores: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float, name: str) -> None:
    """Shape/temperature checks; label range is checked only for CPU labels (on CUDA it would force a sync)."""
    if scores.shape[:-1] != labels.shape:
        raise ValueError(f"{name}: labels shape {tuple(labels.shape)} != leading shape {tuple(scores.shape[:-1])}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: labels must be int64 or int32, got {labels.dtype}")
    if not temperature > 0.0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    if labels.device.type == "cpu" and labels.numel() > 0:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name}: labels must be in [0, {vocab_size}), got min={lo} max={hi}")


class FlatInputs(NamedTuple):
    """A public entry's inputs as its kernels take them: scores [N, last] with unit column stride, labels [N]
    int64 contiguous, the global vocab size, and the labels' leading shape the results are reshaped back to."""

    scores: torch.Tensor
    labels: torch.Tensor
    vocab_size: int
    lead: torch.Size

    def unflatten(self, logp: torch.Tensor, ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] results -> the labels' leading shape."""
        return logp.reshape(self.lead), ent.reshape(self.lead)


def flat_inputs(
    scores: torch.Tensor,
    labels: torch.Tensor,
    v_local: int,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    temperature: float,
    name: str,
) -> FlatInputs:
    """Checks (`vocab_shard`, `check_inputs`) and flattens scores [..., last] (logits or hidden) and labels [...]."""
    _, _, vocab_size = vocab_shard(v_local, tp_group, vocab_size)
    check_inputs(scores, labels, vocab_size, temperature, name)
    x = scores.reshape(-1, scores.shape[-1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    return FlatInputs(x, labels.reshape(-1).to(torch.int64).contiguous(), vocab_size, labels.shape)


def combine_vocab_shards(stats: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Merge per-shard stats into global ones.

    Args:
        stats: [3, T] fp32: local lse, local entropy (of the shard's own softmax), target logit (0 off-shard).
        tp_group: the tensor-parallel group, or None (then stats are returned unchanged).

    Returns:
        [3, T] fp32 global (lse, entropy, target logit). With w_r = exp(lse_r - lse) the share of shard r,
        H = sum_r w_r * (H_r - log w_r).
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return stats
    parts = [torch.empty_like(stats) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, stats.contiguous(), group=tp_group)
    return merge_stats(torch.stack(parts))


def merge_stats(allstats: torch.Tensor) -> torch.Tensor:
    """Stats of disjoint vocab slices [R, 3, T] (lse, entropy, target logit) -> stats of their union [3, T].

    With w_r = exp(lse_r - lse) the share of slice r: lse = logsumexp_r lse_r, H = sum_r w_r * (H_r - log w_r),
    target logit = sum_r (0 on the slices without the label).
    """
    lse_r, ent_r, zt_r = allstats[:, 0], allstats[:, 1], allstats[:, 2]
    lse = torch.logsumexp(lse_r, dim=0)
    log_w = lse_r - lse
    w = torch.exp(log_w)
    ent = torch.where(w > 0, w * (ent_r - log_w), torch.zeros_like(w)).sum(0)
    return torch.stack([lse, ent, zt_r.sum(0)])


# ---------------------------------------------------------------------------------------------------------------
# per-chunk math
# ---------------------------------------------------------------------------------------------------------------
def _scaled(x: torch.Tensor, inv_temp: float, n_valid: int) -> torch.Tensor:
    """fp32 z = x / temperature with padding columns set to -inf (always a fresh tensor)."""
    z = x.to(torch.float32) * inv_temp
    if n_valid < z.shape[-1]:
        z[:, n_valid:] = float("-inf")
    return z


def _chunk_stats(z: torch.Tensor, labels_local: torch.Tensor) -> torch.Tensor:
    """[3, C] fp32 (lse, entropy, target logit) of the shard softmax of z [C, V_local] (fp32, no padding columns).

    Three passes over the tile beyond z itself: log_softmax (torch's fused kernel), exp, and an in-place product
    summed per row; lse comes back from any one column (z_j - logp_j), the label's. Rows where that is not finite
    (a -inf logit at the label, or 0 * -inf in the entropy) are redone by `_chunk_stats_safe`.
    """
    if z.shape[1] == 0:
        return _chunk_stats_safe(z, labels_local)
    logp = torch.log_softmax(z, dim=1)
    on = (labels_local >= 0) & (labels_local < z.shape[1])
    idx = labels_local.clamp(0, z.shape[1] - 1)[:, None]
    z_label = z.gather(1, idx)[:, 0]
    lse = z_label - logp.gather(1, idx)[:, 0]
    ent = -torch.exp(logp).mul_(logp).sum(1)
    stats = torch.stack([lse, ent, torch.where(on, z_label, torch.zeros_like(z_label))])
    bad = ~(torch.isfinite(lse) & torch.isfinite(ent))
    if bool(bad.any()):
        stats[:, bad] = _chunk_stats_safe(z[bad], labels_local[bad])
    return stats


def _chunk_stats_safe(z: torch.Tensor, labels_local: torch.Tensor) -> torch.Tensor:
    """`_chunk_stats` for any z (-inf columns, all -inf rows, no columns): every step guarded, more passes."""
    lse = torch.logsumexp(z, dim=1) if z.shape[1] else z.new_full((z.shape[0],), float("-inf"))
    logp = z - lse[:, None]
    p = torch.exp(logp)
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(1)
    on = (labels_local >= 0) & (labels_local < z.shape[1])
    if z.shape[1]:
        zt = z.gather(1, labels_local.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
        zt = torch.where(on, zt, torch.zeros_like(lse))
    else:
        zt = torch.zeros_like(lse)
    ent = torch.where(torch.isfinite(lse), ent, torch.zeros_like(ent))
    return torch.stack([lse, ent, zt])


def _chunk_dz(z: torch.Tensor, labels_local: torch.Tensor, stats: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d(g_logp * logp + g_ent * H) / dz for z [C, V_local]; stats [3, C] global; g [2, C] (g_logp, g_ent)."""
    logp = z - stats[0][:, None]
    p = torch.exp(logp)
    dz = -g[1][:, None] * torch.where(p > 0, p * (logp + stats[1][:, None]), torch.zeros_like(p))
    dz -= g[0][:, None] * p
    on = (labels_local >= 0) & (labels_local < z.shape[1])
    rows = torch.nonzero(on)[:, 0]
    dz[rows, labels_local[rows]] += g[0][rows]
    return dz


def outputs_from_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global stats [3, T] -> (logp = target logit - lse, entropy), [T] fp32 each."""
    return stats[2] - stats[0], stats[1]


def _chunk_tokens(v_local: int, chunk_tokens: int | None) -> int:
    return chunk_tokens if chunk_tokens is not None else max(1, CHUNK_ELEMENTS // max(1, v_local))


# ---------------------------------------------------------------------------------------------------------------
# logits -> (logp, entropy), chunked
# ---------------------------------------------------------------------------------------------------------------
class _ChunkedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, tp_group, vocab_size, chunk_tokens):
        class_start, n_valid, _ = vocab_shard(logits.shape[1], tp_group, vocab_size)
        stats = logits.new_empty((3, logits.shape[0]), dtype=torch.float32)
        for c in range(0, logits.shape[0], chunk_tokens):
            # Only the real columns: padding would put -inf into the softmax and send every row to the slow path.
            z = logits[c : c + chunk_tokens, :n_valid].to(torch.float32) * (1.0 / temperature)
            stats[:, c : c + chunk_tokens] = _chunk_stats(z, labels[c : c + chunk_tokens] - class_start)
        stats = combine_vocab_shards(stats, tp_group)
        # Saved: the inputs themselves and [3, T] fp32, i.e. 12 bytes per token beyond the logits (labels are shifted
        # per chunk, so no [T] int64 copy is kept).
        ctx.save_for_backward(logits, labels, stats)
        ctx.args = (temperature, class_start, n_valid, chunk_tokens)
        return outputs_from_stats(stats)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, labels, stats = ctx.saved_tensors
        temperature, class_start, n_valid, chunk_tokens = ctx.args
        g = torch.stack([g_logp, g_ent]).to(torch.float32)
        grad = torch.empty_like(logits)
        for c in range(0, logits.shape[0], chunk_tokens):
            sl = slice(c, c + chunk_tokens)
            z = _scaled(logits[sl], 1.0 / temperature, n_valid)
            dz = _chunk_dz(z, labels[sl] - class_start, stats[:, sl], g[:, sl])
            grad[sl] = dz * (1.0 / temperature)
        return grad, None, None, None, None, None


def logprobs_and_entropy_chunked(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked torch twin of `ops.logprobs_and_entropy` (the CPU path). Same arguments and results.

    Args:
        logits: [..., V_local] any float dtype, this rank's vocab shard.
        labels: [...] int64 global token ids.
        temperature: logits are divided by it.
        tp_group: vocab-parallel group (Megatron rank order) or None.
        vocab_size: true global vocab size; columns >= it are padding and ignored. None: all count.
        chunk_tokens: tokens per chunk; default keeps each fp32 temporary at CHUNK_ELEMENTS.

    Returns:
        (logp, entropy): [...] fp32 each, differentiable.
    """
    f = flat_inputs(logits, labels, logits.shape[-1], tp_group, vocab_size, temperature, "logprobs_and_entropy")
    ct = _chunk_tokens(f.scores.shape[1], chunk_tokens)
    return f.unflatten(*_ChunkedLogProbEntropy.apply(f.scores, f.labels, temperature, tp_group, f.vocab_size, ct))


# ---------------------------------------------------------------------------------------------------------------
# hidden @ weight.T -> (logp, entropy), chunked over tokens
# ---------------------------------------------------------------------------------------------------------------
LINEAR_CHUNK_TOKENS = 2048  # token rows per tile of the linear path (the contraction length of the dW matmul)


def _linear_tiles(num_tokens: int, chunk_tokens: int | None, chunk_vocab: int | None) -> tuple[int, int]:
    """(tokens, vocab columns) per tile: about CHUNK_ELEMENTS fp32 logits, with both matmul dims long.

    Tiles long in both directions keep every matmul compute-bound: dW[v] += dz.T @ h contracts over the tile's
    tokens, d_hidden[t] += dz @ W[v] over its vocab columns (a tile of few tokens x the whole vocabulary made the
    dW update rewrite all of dW per tile, ~4x slower than naive torch on CPU at T=4096, H=1024, V=32000).
    """
    ct = chunk_tokens or max(1, min(num_tokens, LINEAR_CHUNK_TOKENS))
    return ct, chunk_vocab or max(1, CHUNK_ELEMENTS // ct)


def _tile_logits(h32: torch.Tensor, weight: torch.Tensor, v0: int, v1: int, inv_temp: float) -> torch.Tensor:
    """fp32 z = h32 @ weight[v0:v1].T / temperature ([C, v1 - v0]; fp32 products like the kernel's tl.dot)."""
    z = h32 @ weight[v0:v1].to(torch.float32).T
    return z.mul_(inv_temp)


class _ChunkedLinearLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, vocab_size, chunk_tokens, chunk_vocab):
        class_start, n_valid, _ = vocab_shard(weight.shape[0], tp_group, vocab_size)
        inv_temp = 1.0 / temperature
        stats = hidden.new_empty((3, hidden.shape[0]), dtype=torch.float32)
        # A shard of padding only: lse = -inf, entropy 0, target logit 0 (what an all -inf row gives).
        stats[0], stats[1:] = float("-inf"), 0.0
        for c in range(0, hidden.shape[0], chunk_tokens):
            sl = slice(c, c + chunk_tokens)
            h32, lab = hidden[sl].to(torch.float32), labels[sl] - class_start
            # only the real columns [0, n_valid) are visited; padding rows of the weight never enter the softmax
            parts = [
                _chunk_stats(_tile_logits(h32, weight, v0, min(v0 + chunk_vocab, n_valid), inv_temp), lab - v0)
                for v0 in range(0, n_valid, chunk_vocab)
            ]
            if parts:
                stats[:, sl] = parts[0] if len(parts) == 1 else merge_stats(torch.stack(parts))
        stats = combine_vocab_shards(stats, tp_group)
        ctx.save_for_backward(hidden, weight, labels, stats)
        ctx.args = (inv_temp, class_start, n_valid, chunk_tokens, chunk_vocab, tp_group)
        return outputs_from_stats(stats)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, labels, stats = ctx.saved_tensors
        inv_temp, class_start, n_valid, chunk_tokens, chunk_vocab, tp_group = ctx.args
        g = torch.stack([g_logp, g_ent]).to(torch.float32)
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # padding rows stay 0
        for c in range(0, hidden.shape[0], chunk_tokens):
            sl = slice(c, c + chunk_tokens)
            h32, lab = hidden[sl].to(torch.float32), labels[sl] - class_start
            for v0 in range(0, n_valid, chunk_vocab):
                v1 = min(v0 + chunk_vocab, n_valid)
                z = _tile_logits(h32, weight, v0, v1, inv_temp)
                dlogits = _chunk_dz(z, lab - v0, stats[:, sl], g[:, sl]).mul_(inv_temp)
                d_hidden[sl].addmm_(dlogits, weight[v0:v1].to(torch.float32))
                d_weight[v0:v1].addmm_(dlogits.T, h32)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(d_hidden, group=tp_group)
        return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype), None, None, None, None, None, None


def linear_logprobs_and_entropy_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked torch twin of `ops.linear_logprobs_and_entropy` (the CPU path). Same arguments and results.

    Only [chunk_tokens, chunk_vocab] logits tiles exist at a time; a token's stats over several vocab tiles are
    merged as vocab shards are (`merge_stats`). The hidden gradient is summed over tp_group (the full gradient);
    the weight gradient is this rank's shard. Arguments as in `logprobs_and_entropy_chunked`, with hidden [..., H]
    and weight [V_local, H] (same float dtype) in place of logits; chunk_tokens / chunk_vocab default to tiles of
    about CHUNK_ELEMENTS fp32 (LINEAR_CHUNK_TOKENS tokens).
    """
    f = flat_inputs(hidden, labels, weight.shape[0], tp_group, vocab_size, temperature, "linear_logprobs_and_entropy")
    ct, cv = _linear_tiles(f.scores.shape[0], chunk_tokens, chunk_vocab)
    return f.unflatten(
        *_ChunkedLinearLogProbEntropy.apply(f.scores, weight, f.labels, temperature, tp_group, f.vocab_size, ct, cv)
    )


# ---------------------------------------------------------------------------------------------------------------
# float64 oracles (tests only; whole [T, V] in memory, plain autograd)
# ---------------------------------------------------------------------------------------------------------------
def logprobs_and_entropy_naive(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsharded float64 oracle. logits [T, V] (full vocab), labels [T]; returns float64 (logp, entropy) [T]."""
    z = logits.to(torch.float64) / temperature
    if vocab_size is not None and vocab_size < z.shape[-1]:
        z = z[..., :vocab_size]
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    # where() inside the product: p * where(...) keeps 0 * (-inf) out of both the value and its gradient.
    ent = -(p * torch.where(p > 0, logp_all, torch.zeros_like(p))).sum(-1)
    return logp_all.gather(-1, labels[..., None])[..., 0], ent


def linear_logprobs_and_entropy_naive(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsharded float64 oracle of the fused LM head: hidden [T, H], weight [V, H], labels [T]."""
    logits = hidden.to(torch.float64) @ weight.to(torch.float64).T
    return logprobs_and_entropy_naive(logits, labels, temperature=temperature, vocab_size=vocab_size)
