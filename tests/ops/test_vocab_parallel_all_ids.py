"""Vocab-parallel (TP=2, gloo) log-prob ops with a label on EVERY vocabulary id (issue 9).

The bug these catch: the forward kernels' last vocab tile overhangs the shard, and a label of the next shard whose
local index fell into that overhang picked up the -inf padding value, so logp = -inf for a band of ids (6.5% of
Qwen's vocabulary at TP=8). Random labels missed it. Here T = vocab_size tokens, token t has label t, and shard
sizes are multiples of no tile size; each case runs the Triton kernels in the interpreter with the interpreter
tiles and with the GPU tiles (the tiling compiled on an H100), plus the chunked CPU path, against a float64
oracle for logp, entropy and each rank's gradient slice.
"""

import pytest
import torch

from megatron_dapo.ops import linear_logprob_entropy as lle
from megatron_dapo.ops import logprob_entropy as le
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_naive
from megatron_dapo.ops.reference import logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import logprobs_and_entropy_naive
from tests.ops._tp import assert_close
from tests.ops._tp import run_gloo
from tests.ops._tp import shard

F32 = torch.float32
# (V_local, global vocab_size): 150 and 70 are multiples of none of the tiles (32, 128, 2048, 4096), so rank 0's
# last tile overhangs its shard in both; both carry Megatron vocab padding too (rank 1 holds 113 / 47 real columns).
# An unpadded case (150, 300) added nothing these two miss and cost a third of this file's interpreter time.
CASES = [(150, 263), (70, 117)]


def _pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = n - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


_INTERPRET_DEFAULTS = (le.INTERPRET_BLOCKS, lle.INTERPRET_BUDGET)


def _use_tiles(tiles: str) -> None:
    """Run the interpreter with the interpreter tiles or the GPU tiles (this process only): the log-prob kernels'
    vocab blocks and the fused LM head's tile budget (whose kernels are the log-prob kernels)."""
    gpu = tiles == "gpu_tiles"
    le.INTERPRET_BLOCKS = le.GPU_BLOCKS if gpu else _INTERPRET_DEFAULTS[0]
    lle.INTERPRET_BUDGET = lle.GPU_BUDGET if gpu else _INTERPRET_DEFAULTS[1]


def _logprob_worker(rank, world, group, path):
    torch.manual_seed(3)
    for v_local, vocab_size in CASES:
        x = torch.randn(vocab_size, world * v_local) * 4
        labels = torch.arange(vocab_size)
        g_logp, g_ent = torch.randn(vocab_size), torch.randn(vocab_size)
        ref_x = x[:, :vocab_size].double().requires_grad_()
        ref_logp, ref_ent = logprobs_and_entropy_naive(ref_x, labels, temperature=0.9)
        ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
        ref_grad = shard(_pad(ref_x.grad, world * v_local, 1), rank, world, 1)
        if path == "chunked":
            fn = logprobs_and_entropy_chunked
        else:
            _use_tiles(path)
            fn = le.logprobs_and_entropy
        local = shard(x, rank, world, 1).clone().requires_grad_()
        logp, ent = fn(local, labels, temperature=0.9, tp_group=group, vocab_size=vocab_size)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        tag = f"{path} rank{rank} V_local={v_local} vocab={vocab_size}"
        bad = (~torch.isfinite(logp)).nonzero().flatten().tolist()
        assert not bad, f"{tag}: non-finite logp for label ids {bad[:10]}... ({len(bad)} ids)"
        assert_close(logp, ref_logp, F32, f"{tag} logp")
        assert_close(ent, ref_ent, F32, f"{tag} entropy")
        assert_close(local.grad, ref_grad, F32, f"{tag} grad")


def _linear_worker(rank, world, group, path):
    torch.manual_seed(4)
    for v_local, vocab_size in CASES:
        hdim = 24
        hidden = torch.randn(vocab_size, hdim)
        weight = torch.randn(world * v_local, hdim) * 0.6
        labels = torch.arange(vocab_size)
        g_logp, g_ent = torch.randn(vocab_size), torch.randn(vocab_size)
        ref_h = hidden.double().requires_grad_()
        ref_w = weight[:vocab_size].double().requires_grad_()
        ref_logp, ref_ent = linear_logprobs_and_entropy_naive(ref_h, ref_w, labels, temperature=0.9)
        ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
        ref_dw = shard(_pad(ref_w.grad, world * v_local, 0), rank, world, 0)
        if path == "chunked":
            fn = linear_logprobs_and_entropy_chunked
        else:
            _use_tiles(path)
            fn = lle.linear_logprobs_and_entropy
        h = hidden.clone().requires_grad_()
        w = shard(weight, rank, world, 0).clone().requires_grad_()
        logp, ent = fn(h, w, labels, temperature=0.9, tp_group=group, vocab_size=vocab_size)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        tag = f"{path} rank{rank} V_local={v_local} vocab={vocab_size}"
        bad = (~torch.isfinite(logp)).nonzero().flatten().tolist()
        assert not bad, f"{tag}: non-finite logp for label ids {bad[:10]}... ({len(bad)} ids)"
        assert_close(logp, ref_logp, F32, f"{tag} logp")
        assert_close(ent, ref_ent, F32, f"{tag} entropy")
        assert_close(h.grad, ref_h.grad, F32, f"{tag} d_hidden")
        assert_close(w.grad, ref_dw, F32, f"{tag} d_weight")


@pytest.mark.parametrize("path", ["interpret_tiles", "gpu_tiles", "chunked"])
def test_logprobs_and_entropy_tp2_every_label(path):
    run_gloo(_logprob_worker, path)


@pytest.mark.parametrize("path", ["interpret_tiles", "gpu_tiles", "chunked"])
def test_linear_logprobs_and_entropy_tp2_every_label(path):
    run_gloo(_linear_worker, path)
