"""logprobs_and_entropy(backend=...): routing to the CUDA C++ twins (csrc/) and its errors.

On CPU: an explicit backend="cuda" is refused, the environment variable is ignored, unknown names are refused, and
the autograd wrapper's "cuda" branch is driven through stand-ins that honour the twins' contract (argument order,
temperature not its inverse, shard-local [3, T] stats), so the wiring is checked without a GPU. On a GPU (marked
`gpu`): the real twins against the float64 oracle, with vocab padding, fp32 and bf16.
"""

import shutil

import pytest
import torch

from csrc import build as csrc_build
from megatron_dapo.ops import _cuda_twins
from megatron_dapo.ops import logprob_entropy as le
from megatron_dapo.ops.reference import _chunk_dz
from megatron_dapo.ops.reference import _chunk_stats
from megatron_dapo.ops.reference import logprobs_and_entropy_naive
from tests.ops._tp import assert_close


def _oracle(x, labels, g_logp, g_ent, **kw):
    leaf = x.detach().double().requires_grad_()
    vocab_size = kw.get("vocab_size")
    logp, ent = logprobs_and_entropy_naive(leaf, labels, **kw)
    ((logp * g_logp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    grad = leaf.grad
    if vocab_size is not None:
        grad = grad.clone()
        grad[:, vocab_size:] = 0.0
    return logp, ent, grad


def _run(fn, x, labels, g_logp, g_ent):
    leaf = x.detach().clone().requires_grad_()
    logp, ent = fn(leaf, labels)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    return logp, ent, leaf.grad


def test_explicit_cuda_backend_on_cpu_is_refused():
    x, labels = torch.randn(3, 40), torch.randint(0, 40, (3,))
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors, got logits on cpu"):
        le.logprobs_and_entropy(x, labels, backend="cuda")
    with pytest.raises(ValueError, match="unknown 'cutlass'"):
        le.logprobs_and_entropy(x, labels, backend="cutlass")


def test_no_environment_variable_selects_a_backend(monkeypatch):
    """The one kernel switch is actor.logprob_impl: the removed MEGATRON_DAPO_KERNEL_BACKEND changes nothing."""
    monkeypatch.setenv("MEGATRON_DAPO_KERNEL_BACKEND", "bogus")
    x, labels = torch.randn(3, 40) * 3, torch.randint(0, 40, (3,))
    g_logp, g_ent = torch.randn(3), torch.randn(3)
    got = _run(le.logprobs_and_entropy, x, labels, g_logp, g_ent)
    for name, a, b in zip(("logp", "entropy", "grad"), got, _oracle(x, labels, g_logp, g_ent)):
        assert_close(a, b, torch.float32, name)
    from megatron_dapo.actor.loss import get_logprob_impl

    assert [get_logprob_impl(n).kernel for n in ("reference", "fused", "fused_cuda", "fused_linear")] == [
        None, "triton", "cuda", "triton"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        get_logprob_impl("fused_cuda").fn(x, labels)


def _fake_stats(logits, labels, temperature, class_start, n_valid):
    """CPU stand-in with the contract of _cuda_twins.logprob_entropy_stats (shard stats [3, T] and logp [T])."""
    z = logits.double() / temperature
    z[:, n_valid:] = float("-inf")
    stats = _chunk_stats(z, labels - class_start).float()
    return stats, stats[2] - stats[0]


def _fake_grad(logits, labels, stats, g_logp, g_ent, temperature, class_start, n_valid):
    z = logits.double() / temperature
    z[:, n_valid:] = float("-inf")
    g = torch.stack([g_logp, g_ent]).double()
    dz = _chunk_dz(z, labels - class_start, stats.double(), g) / temperature
    dz[:, n_valid:] = 0.0
    return dz.to(logits.dtype)


def test_cuda_branch_wiring_with_stand_ins(monkeypatch):
    calls = []
    monkeypatch.setattr(_cuda_twins, "logprob_entropy_stats", lambda *a: calls.append("fwd") or _fake_stats(*a))
    monkeypatch.setattr(_cuda_twins, "logprob_entropy_grad", lambda *a: calls.append("bwd") or _fake_grad(*a))
    num_tokens, vocab, vocab_size, temperature = 6, 50, 45, 0.7
    x, labels = torch.randn(num_tokens, vocab) * 3, torch.randint(0, vocab_size, (num_tokens,))
    g_logp, g_ent = torch.randn(num_tokens), torch.randn(num_tokens)

    def fn(leaf, lab):
        return le.LogProbEntropyFunction.apply(leaf, lab, temperature, None, vocab_size, "cuda")

    got = _run(fn, x, labels, g_logp, g_ent)
    assert calls == ["fwd", "bwd"]
    ref = _oracle(x, labels, g_logp, g_ent, temperature=temperature, vocab_size=vocab_size)
    for name, a, b in zip(("logp", "entropy", "grad"), got, ref):
        assert_close(a, b, torch.float32, name)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real twins
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_lib(tmp_path_factory):
    if csrc_build.find_nvcc() is None and shutil.which("nvcc") is None:
        pytest.skip("nvcc not found (CUDA toolkit absent)")
    out = tmp_path_factory.mktemp("mdapo_cuda_le") / csrc_build.LIB_NAME
    return csrc_build.build_library(out, archs=["90"])


@pytest.mark.gpu
@pytest.mark.parametrize("via_impl", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_cuda_backend_matches_oracle(cuda_lib, monkeypatch, dtype, via_impl):
    monkeypatch.setenv("MEGATRON_DAPO_CUDA_LIB", str(cuda_lib))
    _cuda_twins.load_library.cache_clear()
    num_tokens, vocab, vocab_size, temperature = 37, 5000, 4900, 0.7
    x = (torch.randn(num_tokens, vocab, device="cuda") * 3).to(dtype)
    labels = torch.randint(0, vocab_size, (num_tokens,), device="cuda")
    g_logp, g_ent = torch.randn(num_tokens, device="cuda"), torch.randn(num_tokens, device="cuda")
    calls = []
    real_stats = _cuda_twins.logprob_entropy_stats
    monkeypatch.setattr(_cuda_twins, "logprob_entropy_stats", lambda *a: calls.append(1) or real_stats(*a))

    def fn(leaf, lab):
        if via_impl:  # actor.logprob_impl "fused_cuda", the run's switch
            from megatron_dapo.actor.loss import get_logprob_impl

            return get_logprob_impl("fused_cuda").fn(leaf, lab, temperature=temperature, vocab_size=vocab_size)
        return le.logprobs_and_entropy(leaf, lab, temperature=temperature, vocab_size=vocab_size, backend="cuda")

    try:
        got = _run(fn, x, labels, g_logp, g_ent)
    finally:
        _cuda_twins.load_library.cache_clear()
    assert calls, "the CUDA twin was not called"
    ref = _oracle(x, labels, g_logp, g_ent, temperature=temperature, vocab_size=vocab_size)
    # logp and entropy are fp32 results of an fp32 computation whatever the input dtype
    assert_close(got[0], ref[0], torch.float32, "logp")
    assert_close(got[1], ref[1], torch.float32, "entropy")
    assert_close(got[2], ref[2], dtype, "grad")
    assert torch.all(got[2][:, vocab_size:] == 0)
