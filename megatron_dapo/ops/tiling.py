"""Tile sizes of the fused LM head (ops/linear_logprob_entropy.py), in plain Python so the planner (plan.py) sizes
the op's scratch with the same numbers without importing torch or Triton.

A tile is [Tc tokens, Vc vocab columns] of logits: Tc = all tokens up to TileBudget.max_tokens (more are split into
even chunks), Vc = the largest power of two with Tc * Vc within the budget's elements (at least min_vocab, at most
the shard's real columns). Scratch is one tile, so the op's extra memory is bounded whatever T is.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class TileBudget:
    """How big a tile of the fused LM head may be."""

    max_tokens: int
    """Token rows per tile (the d_weight GEMM's contraction length); more tokens are split into even chunks."""
    forward_elements: int
    """fp32 logits per forward tile (its scratch: 4 B each)."""
    backward_elements: int
    """Logits per backward tile (its scratch: fp32 logits + d logits in the weight dtype, 6 B each for bf16)."""
    min_vocab: int
    """Narrowest vocab tile when the token count would ask for less (the GEMMs stay long in N)."""


# GPU: 4096 tokens a tile keeps every GEMM long in all three dims at the 7B shape (M=4096, N=1024..2048, K=H);
# 16 MiB of forward scratch (the forward's memory target) and 48 MiB of backward scratch (bf16), so the backward's
# extra memory stays within 1.2 GB at Qwen2.5-7B's shape with the 1.09 GB d_weight counted (docs/kernels.md). Not
# tuned on a GPU yet: tools/bench/logprob_kernels.py --tile-sweep measures other budgets.
GPU_BUDGET = TileBudget(max_tokens=4096, forward_elements=4 << 20, backward_elements=8 << 20, min_vocab=256)
# Interpreter: a few vocab tiles at the tests' vocabularies (~100-300), few enough launches to stay quick (each
# program of the interpreter costs milliseconds); tests/ops/test_linear_logprob_entropy.py sets smaller ones.
INTERPRET_BUDGET = TileBudget(max_tokens=64, forward_elements=4096, backward_elements=8192, min_vocab=16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_shape(num_tokens: int, n_valid: int, elements: int, budget: TileBudget) -> tuple[int, int]:
    """(tokens, vocab columns) of one tile.

    Args:
        num_tokens: T (> 0).
        n_valid: real vocab columns of this shard (> 0).
        elements: logits a tile may hold (the forward's or the backward's budget).
        budget: the token cap and the narrowest vocab tile.

    Returns:
        (Tc, Vc): Tc = T split into even chunks of at most budget.max_tokens; Vc = the largest power of two with
        Tc * Vc <= elements, at least budget.min_vocab, at most n_valid.
    """
    tc = _cdiv(num_tokens, _cdiv(num_tokens, budget.max_tokens))
    vc = max(budget.min_vocab, elements // tc)
    vc = 1 << (vc.bit_length() - 1)
    return tc, min(vc, n_valid)


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[(start, end), ...] covering range(n) in steps of `size`."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def scratch_bytes(num_tokens: int, n_valid: int, hidden: int, b: int, train: bool, budget: TileBudget = GPU_BUDGET):
    """Bytes the fused LM head allocates beyond its inputs, outputs and their gradients, for one call.

    Args:
        num_tokens: T; n_valid: this shard's real vocab columns; hidden: h; b: bytes of the weight dtype.
        train: the backward's scratch (else the forward's).
        budget: tile sizes (default: the GPU's).

    Returns:
        forward: one fp32 tile + the carried online state [4, Tc] fp32. backward: one fp32 tile + one tile of d
        logits in the weight dtype, the fp32 d_hidden accumulator [T, h], and an fp32 [Vc, h] d_weight accumulator
        when T takes several token chunks.
    """
    if num_tokens == 0 or n_valid == 0:
        return 0
    if not train:
        tc, vc = tile_shape(num_tokens, n_valid, budget.forward_elements, budget)
        return tc * vc * 4 + 16 * tc
    tc, vc = tile_shape(num_tokens, n_valid, budget.backward_elements, budget)
    dw_acc = vc * hidden * 4 if tc < num_tokens else 0
    return tc * vc * (4 + b) + num_tokens * hidden * 4 + dw_acc
