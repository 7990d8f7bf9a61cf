"""logprobs_and_entropy: Triton kernel (interpreter here, CUDA when present) and chunked CPU path vs float64 oracle."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dapo.ops import logprob_entropy as le
from megatron_dapo.ops.reference import logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import logprobs_and_entropy_naive
from tests.ops._tp import TOLERANCES
from tests.ops._tp import assert_close


def _triton(logits, labels, **kw):
    """The kernel path whatever the device (CPU goes through the interpreter under TRITON_INTERPRET=1)."""
    return le.logprobs_and_entropy(logits, labels, **kw)


def _chunked(logits, labels, **kw):
    return logprobs_and_entropy_chunked(logits, labels, chunk_tokens=2, **kw)


PATHS = {"triton": _triton, "chunked": _chunked}


def _run(fn, x, labels, g_logp, g_ent, **kw):
    """Forward + backward with upstream grads; returns float64 (logp, entropy, d logits)."""
    leaf = x.detach().clone().requires_grad_()
    logp, ent = fn(leaf, labels, **kw)
    if x.dtype != torch.float64:
        assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    return logp.double(), ent.double(), leaf.grad.double()


def _check(fn, x, labels, dtype, vocab_size=None, **kw):
    g_logp, g_ent = torch.randn(labels.shape), torch.randn(labels.shape)
    got = _run(fn, x, labels, g_logp, g_ent, vocab_size=vocab_size, **kw)
    if vocab_size is not None:  # the oracle sees only the true vocabulary; padding must get exactly zero gradient
        assert torch.equal(got[2][..., vocab_size:], torch.zeros_like(got[2][..., vocab_size:]))
        x, got = x[..., :vocab_size], (got[0], got[1], got[2][..., :vocab_size])
    ref = _run(logprobs_and_entropy_naive, x.double(), labels, g_logp.double(), g_ent.double(), **kw)
    for name, a, b in zip(("logp", "entropy", "grad"), got, ref):
        assert_close(a, b, dtype, name)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CASES = [  # (T, V, temperature, vocab_size)
    pytest.param(3, 423, 1.0, None, id="T3-V423"),
    pytest.param(5, 300, 0.6, 290, id="T5-V300-temp0.6-pad10"),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,vocab,temperature,vocab_size", CASES)
def test_matches_float64(path, dtype, num_tokens, vocab, temperature, vocab_size):
    x = (torch.randn(num_tokens, vocab) * 4).to(dtype)
    labels = torch.randint(0, vocab_size or vocab, (num_tokens,))
    _check(PATHS[path], x, labels, dtype, vocab_size=vocab_size, temperature=temperature)


@pytest.mark.parametrize("path", list(PATHS))
def test_extreme_logits_and_neg_inf(path):
    x = torch.randn(4, 260)
    x[0, 7] = 1e4  # one dominant logit: entropy ~ 0, p ~ one-hot
    x[1, :130] = -1e4
    x[1, 200] = 1e4
    x[2, 1::2] = float("-inf")  # -inf columns (e.g. masked vocabulary) count as p = 0
    x[3, :] = float("-inf")
    x[3, 5] = 3.0  # a single finite column: logp = 0, entropy = 0
    labels = torch.tensor([7, 3, 4, 5])
    _check(PATHS[path], x, labels, torch.float32, temperature=0.5)
    leaf = x.clone().requires_grad_()
    logp, ent = PATHS[path](leaf, labels)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[2, 1::2] == 0).all()
    assert logp[3] == 0 and ent[3] == 0


@pytest.mark.parametrize("path", list(PATHS))
def test_padding_values_are_ignored(path):
    x = torch.randn(3, 140)
    labels = torch.tensor([0, 99, 50])
    out = PATHS[path](x, labels, vocab_size=100)
    x[:, 100:] = 1e30  # garbage in the padded columns must not change anything
    out_garbage = PATHS[path](x, labels, vocab_size=100)
    for a, b in zip(out, out_garbage):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", list(PATHS))
def test_leading_dims_int32_strided_and_single_output(path):
    base = torch.randn(2, 3, 200)
    x = base[..., :150]  # row stride 200 != 150
    labels = torch.randint(0, 150, (2, 3), dtype=torch.int32)
    leaf = x.clone().requires_grad_()
    logp, ent = PATHS[path](leaf, labels)
    assert logp.shape == (2, 3) and ent.shape == (2, 3)
    logp.sum().backward()  # entropy unused: its upstream gradient is None
    ref_leaf = x.double().requires_grad_()
    ref_logp, _ = logprobs_and_entropy_naive(ref_leaf, labels.long())
    ref_logp.sum().backward()
    assert_close(logp, ref_logp, torch.float32, "logp")
    assert_close(leaf.grad, ref_leaf.grad, torch.float32, "grad")


@pytest.mark.parametrize(
    "labels,kw,msg",
    [
        (torch.tensor([0, 10]), {}, "labels must be in"),
        (torch.tensor([0, 9]), {"vocab_size": 9}, "labels must be in"),
        (torch.tensor([0, -1]), {}, "labels must be in"),
        (torch.tensor([0, 1]), {"temperature": 0.0}, "temperature"),
        (torch.tensor([0, 1, 2]), {}, "labels shape"),
        (torch.tensor([0, 1]), {"vocab_size": 11}, "vocab_size"),
    ],
)
@pytest.mark.parametrize("path", list(PATHS))
def test_bad_input(path, labels, kw, msg):
    with pytest.raises(ValueError, match=msg):
        PATHS[path](torch.randn(2, 10), labels, **kw)


def test_cpu_dispatch_uses_chunked_reference(monkeypatch):
    """Without the interpreter, CPU tensors go to the chunked reference (the kernel is never launched)."""
    monkeypatch.setattr(le, "use_triton", lambda t: False)
    monkeypatch.setattr(le, "LogProbEntropyFunction", None)  # would raise if the kernel path were taken
    x, labels = torch.randn(3, 50), torch.tensor([1, 2, 3])
    logp, ent = le.logprobs_and_entropy(x, labels, temperature=0.9)
    ref_logp, ref_ent = logprobs_and_entropy_naive(x, labels, temperature=0.9)
    assert_close(logp, ref_logp, torch.float32, "logp")
    assert_close(ent, ref_ent, torch.float32, "entropy")


def test_real_vocab_chunked_reference():
    """Qwen2.5's vocabulary (151936, padded by Megatron) on the CPU path with its default chunking."""
    vocab, true_vocab = 151936, 151665
    x = (torch.randn(3, vocab) * 3).to(torch.bfloat16)
    labels = torch.tensor([0, 151664, 77777])
    g_logp, g_ent = torch.randn(3), torch.randn(3)
    got = _run(logprobs_and_entropy_chunked, x, labels, g_logp, g_ent, vocab_size=true_vocab)
    ref = _run(logprobs_and_entropy_naive, x[:, :true_vocab].double(), labels, g_logp.double(), g_ent.double())
    for name, a, b in zip(("logp", "entropy"), got, ref):
        assert_close(a, b, torch.bfloat16, name)
    assert_close(got[2][:, :true_vocab], ref[2], torch.bfloat16, "grad")
    assert (got[2][:, true_vocab:] == 0).all()


class _Fp32AllocLog(TorchDispatchMode):
    """Records the largest fp32 tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.max_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.max_fp32 = max(self.max_fp32, t.numel())
        return out


def test_chunked_reference_memory_is_bounded():
    num_tokens, vocab, chunk = 64, 1000, 8
    x = torch.randn(num_tokens, vocab).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (num_tokens,))
    results = []
    for ct in (chunk, None):
        leaf = x.clone().requires_grad_()
        with _Fp32AllocLog() as log:
            logp, ent = logprobs_and_entropy_chunked(leaf, labels, chunk_tokens=ct, temperature=0.8)
            (logp.sum() + 2 * ent.sum()).backward()
        results.append((log.max_fp32, logp, ent, leaf.grad))
    # fp32 temporaries stay at one chunk; the bf16 gradient [T, V] itself is the only full-size tensor
    assert results[0][0] <= chunk * vocab
    # the detector works: one big chunk (the default here) does allocate [T, V] fp32
    assert results[1][0] >= num_tokens * vocab
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernel_matches_float64(dtype):
    x = (torch.randn(37, 151936, device="cuda") * 3).to(dtype)
    labels = torch.randint(0, 151665, (37,), device="cuda")
    rtol, atol = TOLERANCES[dtype]
    g_logp, g_ent = torch.randn(37, device="cuda"), torch.randn(37, device="cuda")
    got = _run(_triton, x, labels, g_logp, g_ent, vocab_size=151665, temperature=0.7)
    ref = _run(logprobs_and_entropy_naive, x[:, :151665].double(), labels, g_logp.double(), g_ent.double(),
               temperature=0.7)  # fmt: skip
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    torch.testing.assert_close(got[2][:, :151665], ref[2], rtol=rtol, atol=atol)
