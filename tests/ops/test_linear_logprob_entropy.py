"""linear_logprobs_and_entropy: fused LM head kernels (interpreter here) and chunked CPU path vs float64 oracle."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dapo.ops import linear_logprob_entropy as lle
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_naive
from tests.ops._tp import TOLERANCES
from tests.ops._tp import assert_close


def _chunked(hidden, weight, labels, **kw):
    return linear_logprobs_and_entropy_chunked(hidden, weight, labels, chunk_tokens=3, **kw)


PATHS = {"triton": lle.linear_logprobs_and_entropy, "chunked": _chunked}


def _run(fn, hidden, weight, labels, g_logp, g_ent, **kw):
    """Forward + backward; returns float64 (logp, entropy, d hidden, d weight)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, labels, **kw)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    return logp.double(), ent.double(), h.grad.double(), w.grad.double()


def _check(fn, hidden, weight, labels, dtype, vocab_size=None, **kw):
    g_logp, g_ent = torch.randn(labels.shape), torch.randn(labels.shape)
    got = _run(fn, hidden, weight, labels, g_logp, g_ent, vocab_size=vocab_size, **kw)
    w_true = weight if vocab_size is None else weight[:vocab_size]
    ref = _run(linear_logprobs_and_entropy_naive, hidden.double(), w_true.double(), labels, g_logp.double(),
               g_ent.double(), **kw)  # fmt: skip
    if vocab_size is not None:  # padded weight rows get exactly zero gradient
        assert torch.equal(got[3][vocab_size:], torch.zeros_like(got[3][vocab_size:]))
        got = got[:3] + (got[3][:vocab_size],)
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight"), got, ref):
        assert_close(a, b, dtype, name)


CASES = [  # (T, H, V, temperature, vocab_size): several token, H and vocab tiles in the interpreter blocks
    pytest.param(5, 24, 100, 1.0, None, id="T5-H24-V100"),
    pytest.param(18, 40, 70, 0.7, 61, id="T18-H40-V70-temp0.7-pad9"),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens,hdim,vocab,temperature,vocab_size", CASES)
def test_matches_float64(path, dtype, num_tokens, hdim, vocab, temperature, vocab_size):
    hidden = torch.randn(num_tokens, hdim).to(dtype)
    weight = (torch.randn(vocab, hdim) * 0.4).to(dtype)
    labels = torch.randint(0, vocab_size or vocab, (num_tokens,))
    _check(PATHS[path], hidden, weight, labels, dtype, vocab_size=vocab_size, temperature=temperature)


@pytest.mark.parametrize("path", list(PATHS))
def test_extreme_logits_leading_dims(path):
    hidden = torch.randn(2, 2, 16)
    weight = torch.randn(40, 16)
    hidden[0, 0] *= 300.0  # logits ~ +-1e3..1e4: near one-hot rows
    labels = torch.randint(0, 40, (2, 2))
    got = _run(PATHS[path], hidden, weight, labels, torch.ones(2, 2), torch.ones(2, 2), temperature=0.5)
    ref = _run(linear_logprobs_and_entropy_naive, hidden.reshape(4, 16).double(), weight.double(), labels.reshape(4),
               torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), temperature=0.5)  # fmt: skip
    assert got[0].shape == (2, 2)
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight"), got, ref):
        assert_close(a.reshape(b.shape), b, torch.float32, name)


def test_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        lle.linear_logprobs_and_entropy(torch.randn(2, 4), torch.randn(5, 4).half(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="H=4"):
        lle.linear_logprobs_and_entropy(torch.randn(2, 4), torch.randn(5, 3), torch.tensor([0, 1]))
    for fn in PATHS.values():
        with pytest.raises(ValueError, match="labels must be in"):
            fn(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 5]))


class _MaxAllocLog(TorchDispatchMode):
    """Records the largest tensor (any dtype) any op creates."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_chunked_reference_never_builds_full_logits():
    num_tokens, hdim, vocab, chunk = 64, 16, 1000, 8
    hidden, weight = torch.randn(num_tokens, hdim), torch.randn(vocab, hdim) * 0.3
    labels = torch.randint(0, vocab, (num_tokens,))
    results = []
    for ct in (chunk, None):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _MaxAllocLog() as log:
            logp, ent = linear_logprobs_and_entropy_chunked(h, w, labels, chunk_tokens=ct)
            (logp.sum() - ent.sum()).backward()
        results.append((log.max_numel, logp, ent, h.grad, w.grad))
    # largest tensors: one [chunk, V] logits chunk or the [V, H] weight gradient, never [T, V]
    assert results[0][0] <= max(chunk * vocab, vocab * hdim) < num_tokens * vocab
    assert results[1][0] >= num_tokens * vocab  # the detector sees the unchunked run's [T, V]
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_kernel_matches_float64(dtype):
    num_tokens, hdim, vocab, true_vocab = 300, 256, 4096, 4000
    hidden = torch.randn(num_tokens, hdim, device="cuda").to(dtype)
    weight = (torch.randn(vocab, hdim, device="cuda") * 0.1).to(dtype)
    labels = torch.randint(0, true_vocab, (num_tokens,), device="cuda")
    g_logp, g_ent = torch.randn(num_tokens, device="cuda"), torch.randn(num_tokens, device="cuda")
    got = _run(lle.linear_logprobs_and_entropy, hidden, weight, labels, g_logp, g_ent, vocab_size=true_vocab)
    ref = _run(linear_logprobs_and_entropy_naive, hidden.double(), weight[:true_vocab].double(), labels,
               g_logp.double(), g_ent.double())  # fmt: skip
    rtol, atol = TOLERANCES[dtype]
    # fp32 on GPU: allow tf32-free ieee dots but a longer reduction than the CPU tests (H=256)
    for a, b in zip(got[:3] + (got[3][:true_vocab],), ref):
        torch.testing.assert_close(a, b, rtol=rtol * 10, atol=atol * 10)


def test_num_vocab_splits_fills_the_gpu_and_never_leaves_a_split_empty():
    from megatron_dapo.ops.linear_logprob_entropy import num_vocab_splits

    # Qwen2.5 at TP=8 (V_local 19008 -> 297 tiles of 64), T = 2048 tokens in 32 row blocks, 132 SMs: 9 splits,
    # so 288 programs instead of 32 (two waves over the SMs).
    assert num_vocab_splits(32, 297, 132, 8) == 9
    assert num_vocab_splits(1024, 297, 132, 8) == 1  # enough row blocks already
    assert num_vocab_splits(32, 1, 132, 8) == 1 and num_vocab_splits(32, 0, 132, 8) == 1
    for rows in (1, 3, 40):
        for tiles in range(1, 60):
            s = num_vocab_splits(rows, tiles, 132, 2)
            per = -(-tiles // s)
            assert 1 <= s <= tiles and (s - 1) * per < tiles, (rows, tiles, s)


@pytest.mark.parametrize("num_sms", [1, 3, 64])
def test_vocab_split_merge_matches_float64(monkeypatch, num_sms):
    """The forward's vocab split (merged like TP shards) gives the same outputs and gradients for any split count."""
    from megatron_dapo.ops import linear_logprob_entropy as lle

    calls = []
    real_merge = lle.merge_stats
    monkeypatch.setattr(lle, "merge_stats", lambda s: calls.append(s.shape[0]) or real_merge(s))
    monkeypatch.setattr(lle, "INTERPRET_NUM_SMS", num_sms)
    hidden = torch.randn(20, 24, requires_grad=True)
    weight = (torch.randn(203, 24) * 0.5).requires_grad_()
    labels = torch.randint(0, 203, (20,))
    logp, ent = lle.linear_logprobs_and_entropy(hidden, weight, labels, temperature=0.7)
    (logp.sum() + 0.5 * ent.sum()).backward()
    ref_h, ref_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    r_logp, r_ent = linear_logprobs_and_entropy_naive(ref_h, ref_w, labels, temperature=0.7)
    (r_logp.sum() + 0.5 * r_ent.sum()).backward()
    assert (calls[0] if calls else 1) == lle.num_vocab_splits(2, 7, num_sms, 1)
    assert num_sms == 1 or calls, "the split path was not taken"
    for got, want, name in ((logp, r_logp, "logp"), (ent, r_ent, "entropy"), (hidden.grad, ref_h.grad, "d_hidden"),
                            (weight.grad, ref_w.grad, "d_weight")):  # fmt: skip
        assert_close(got, want, torch.float32, name)
