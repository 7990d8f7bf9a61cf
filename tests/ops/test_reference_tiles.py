"""The chunked CPU path of the fused LM head with several vocab tiles per token (stats merged across tiles)."""

import pytest
import torch

from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_naive
from tests.ops._tp import assert_close


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(4, 7), (16, 64), (3, 1000)])
def test_vocab_tiles_match_float64(chunk_tokens, chunk_vocab):
    num_tokens, hdim, vocab, vocab_size, temperature = 10, 8, 60, 53, 0.8
    hidden, weight = torch.randn(num_tokens, hdim), torch.randn(vocab, hdim) * 0.7
    weight[5] = 40.0  # one dominant column: the merge must rescale the other tiles' sums correctly
    labels = torch.randint(0, vocab_size, (num_tokens,))
    g_logp, g_ent = torch.randn(num_tokens), torch.randn(num_tokens)
    results = []
    for fn, dtype in ((linear_logprobs_and_entropy_chunked, torch.float32), (None, torch.float64)):
        h, w = hidden.to(dtype).detach().requires_grad_(), weight.to(dtype).detach().requires_grad_()
        if fn is None:
            logp, ent = linear_logprobs_and_entropy_naive(h, w[:vocab_size], labels, temperature=temperature)
        else:
            kw = {"chunk_tokens": chunk_tokens, "chunk_vocab": chunk_vocab, "vocab_size": vocab_size}
            logp, ent = fn(h, w, labels, temperature=temperature, **kw)
        ((logp * g_logp.to(dtype)).sum() + (ent * g_ent.to(dtype)).sum()).backward()
        results.append((logp, ent, h.grad, w.grad[:vocab_size], w.grad[vocab_size:]))
    (got, ref) = results
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight"), got[:4], ref[:4]):
        assert_close(a, b, torch.float32, name)
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # padding rows of the weight get exactly 0
