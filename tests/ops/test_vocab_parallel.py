"""Vocab-parallel (TP=2, gloo) log-prob/entropy ops: outputs equal the unsharded oracle, each rank's logits/weight
gradient equals its slice of the full gradient, and the hidden gradient is the full one on every rank.

One two-process run per op covers the Triton kernels (interpreter) and the chunked CPU path, including Megatron
vocab padding where the second rank holds only padding columns.
"""

import torch

from megatron_dapo.ops.linear_logprob_entropy import linear_logprobs_and_entropy
from megatron_dapo.ops.logprob_entropy import logprobs_and_entropy
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_naive
from megatron_dapo.ops.reference import logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import logprobs_and_entropy_naive
from tests.ops._tp import assert_close
from tests.ops._tp import run_gloo
from tests.ops._tp import shard

F32 = torch.float32


def _pad_rows(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Append zeros along dim up to size n (the gradient of padding columns)."""
    shape = list(t.shape)
    shape[dim] = n - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _labels(num_tokens: int, vocab_size: int) -> torch.Tensor:
    labels = torch.randint(0, vocab_size, (num_tokens,))
    labels[0], labels[1] = 0, vocab_size - 1  # one label on each end of the vocabulary
    return labels


def _logprob_worker(rank, world, group):
    torch.manual_seed(1)  # same data on every rank
    paths = {"triton": logprobs_and_entropy, "chunked": logprobs_and_entropy_chunked}
    for v_local, vocab_size in [(211, 400), (64, 60)]:  # second case: rank 1 holds padding only
        num_tokens = 5
        x = torch.randn(num_tokens, world * v_local) * 3
        labels = _labels(num_tokens, vocab_size)
        g_logp, g_ent = torch.randn(num_tokens), torch.randn(num_tokens)
        ref_x = x[:, :vocab_size].double().requires_grad_()
        ref_logp, ref_ent = logprobs_and_entropy_naive(ref_x, labels, temperature=0.8)
        ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
        ref_grad = shard(_pad_rows(ref_x.grad, world * v_local, 1), rank, world, 1)
        for name, fn in paths.items():
            local = shard(x, rank, world, 1).clone().requires_grad_()
            logp, ent = fn(local, labels, temperature=0.8, tp_group=group, vocab_size=vocab_size)
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            tag = f"{name} rank{rank} V_local={v_local}"
            assert_close(logp, ref_logp, F32, f"{tag} logp")
            assert_close(ent, ref_ent, F32, f"{tag} entropy")
            assert_close(local.grad, ref_grad, F32, f"{tag} grad")


def _linear_worker(rank, world, group):
    torch.manual_seed(2)
    paths = {"triton": linear_logprobs_and_entropy, "chunked": linear_logprobs_and_entropy_chunked}
    for v_local, vocab_size in [(50, 90), (32, 30)]:
        num_tokens, hdim = 6, 20
        hidden = torch.randn(num_tokens, hdim)
        weight = torch.randn(world * v_local, hdim) * 0.5
        labels = _labels(num_tokens, vocab_size)
        g_logp, g_ent = torch.randn(num_tokens), torch.randn(num_tokens)
        ref_h = hidden.double().requires_grad_()
        ref_w = weight[:vocab_size].double().requires_grad_()
        ref_logp, ref_ent = linear_logprobs_and_entropy_naive(ref_h, ref_w, labels)
        ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
        ref_dw = shard(_pad_rows(ref_w.grad, world * v_local, 0), rank, world, 0)
        for name, fn in paths.items():
            h = hidden.clone().requires_grad_()
            w = shard(weight, rank, world, 0).clone().requires_grad_()
            logp, ent = fn(h, w, labels, tp_group=group, vocab_size=vocab_size)
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            tag = f"{name} rank{rank} V_local={v_local}"
            assert_close(logp, ref_logp, F32, f"{tag} logp")
            assert_close(ent, ref_ent, F32, f"{tag} entropy")
            assert_close(h.grad, ref_h.grad, F32, f"{tag} d_hidden (full, all-reduced)")
            assert_close(w.grad, ref_dw, F32, f"{tag} d_weight (own shard)")


def test_logprobs_and_entropy_tp2():
    run_gloo(_logprob_worker)


def test_linear_logprobs_and_entropy_tp2():
    run_gloo(_linear_worker)
