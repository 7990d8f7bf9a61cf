"""linear_logprobs_and_entropy: the tiled GEMM + kernel path (interpreter kernels and fp32 GEMMs here, cuBLAS and
compiled kernels on a GPU) and the chunked CPU path, against float64 oracles.

Half precision: the tiled path rounds d logits to the weight dtype before the two gradient GEMMs (what a GPU must
do to run them on tensor cores, and what torch's own bf16 LM-head backward does). Its gradients are therefore
checked as the style guide says, err(ours) <= 2 * err(oracle with that rounding) + atol, where the oracle is float64
with d logits rounded to the dtype; forward values against float64 at the dtype's tolerance.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dapo.ops import linear_logprob_entropy as lle
from megatron_dapo.ops import logprob_entropy as le
from megatron_dapo.ops import tiling
from megatron_dapo.ops.reference import Columns
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_chunked
from megatron_dapo.ops.reference import linear_logprobs_and_entropy_naive
from megatron_dapo.ops.reference import logprobs_and_entropy_naive
from tests.ops._tp import TOLERANCES
from tests.ops._tp import assert_close

HALF = (torch.float16, torch.bfloat16)


def _chunked(hidden, weight, labels, **kw):
    return linear_logprobs_and_entropy_chunked(hidden, weight, labels, chunk_tokens=3, **kw)


PATHS = {"tiled": lle.linear_logprobs_and_entropy, "chunked": _chunked}


class _RoundGrad(torch.autograd.Function):
    """Identity forward; backward rounds the incoming gradient to `dtype` (the tiled path's d logits)."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


def _oracle(round_to: torch.dtype | None = None):
    """float64 LM head (fn(hidden, weight, labels, **kw)); with round_to, d logits (1 / temperature included) are
    rounded to that dtype on their way back, as the tiled path rounds them before its gradient GEMMs."""

    def fn(hidden, weight, labels, **kw):
        logits = hidden @ weight.T
        if round_to is not None:
            logits = _RoundGrad.apply(logits, round_to)
        return logprobs_and_entropy_naive(logits, labels, **kw)

    return fn


def _run(fn, hidden, weight, labels, g_logp, g_ent, **kw):
    """Forward + backward; returns float64 CPU (logp, entropy, d hidden, d weight)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, labels, **kw)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    return tuple(t.detach().double().cpu() for t in (logp, ent, h.grad, w.grad))


def _check(fn, hidden, weight, labels, dtype, vocab_size=None, rounded=False, device="cpu", **kw):
    """fn (on `device`) against float64 on the CPU. rounded: half-precision gradients by the error ratio to the
    rounded-d-logits oracle."""
    g_logp, g_ent = torch.randn(labels.shape), torch.randn(labels.shape)
    on = [t.to(device) for t in (hidden, weight, labels, g_logp, g_ent)]
    got = _run(fn, *on, vocab_size=vocab_size, **kw)
    w_true = weight if vocab_size is None else weight[:vocab_size]
    args = (hidden.double(), w_true.double(), labels, g_logp.double(), g_ent.double())
    ref = _run(_oracle(), *args, **kw)
    if vocab_size is not None:  # padded weight rows get exactly zero gradient
        assert torch.equal(got[3][vocab_size:], torch.zeros_like(got[3][vocab_size:]))
        got = got[:3] + (got[3][:vocab_size],)
    for name, a, b in zip(("logp", "entropy"), got[:2], ref[:2]):
        assert_close(a, b, dtype, name)
    if not (rounded and dtype in HALF):
        for name, a, b in zip(("d_hidden", "d_weight"), got[2:], ref[2:]):
            assert_close(a, b, dtype, name)
        return
    rnd = _run(_oracle(round_to=dtype), *args, **kw)
    atol = TOLERANCES[dtype][1]
    for name, a, r, b in zip(("d_hidden", "d_weight"), got[2:], rnd[2:], ref[2:]):
        err, err_ref = (a - b).abs().max().item(), (r.to(dtype).double() - b).abs().max().item()
        assert err <= 2 * err_ref + atol, f"{name}: max error {err:.3g} > 2 * {err_ref:.3g} (rounded oracle) + {atol}"


SMALL = tiling.TileBudget(max_tokens=8, forward_elements=128, backward_elements=256, min_vocab=8)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles of at most 8 tokens and 16 / 32 vocab columns (at T = 8), so the shapes below cross tile edges."""
    monkeypatch.setattr(lle, "INTERPRET_BUDGET", SMALL)


CASES = [  # (T, H, V, temperature, vocab_size): several token chunks and vocab tiles at SMALL
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
    _check(PATHS[path], hidden, weight, labels, dtype, vocab_size=vocab_size, rounded=path == "tiled",
           temperature=temperature)  # fmt: skip


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 17])
@pytest.mark.parametrize("vocab", [1, 15, 16, 33])
def test_tile_edges(num_tokens, vocab):
    """T = 1, T below / at / above the token cap (8 here) and not a multiple of it; vocab below, at and past a
    vocab tile (16 columns at T <= 8 with the interpreter's budgets), a single column included."""
    hidden = torch.randn(num_tokens, 12)
    weight = torch.randn(vocab, 12) * 0.7
    labels = torch.randint(0, vocab, (num_tokens,))
    _check(lle.linear_logprobs_and_entropy, hidden, weight, labels, torch.float32, temperature=1.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic(dtype):
    """Two runs give bit-identical outputs and gradients (no atomics, fixed GEMM and tile order)."""
    hidden = torch.randn(19, 16).to(dtype)
    weight = (torch.randn(45, 16) * 0.5).to(dtype)
    labels = torch.randint(0, 45, (19,))
    g = torch.randn(2, 19)
    runs = [_run(lle.linear_logprobs_and_entropy, hidden, weight, labels, g[0], g[1], temperature=0.8) for _ in "ab"]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


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


def test_tile_shape():
    budget = tiling.TileBudget(max_tokens=4096, forward_elements=4 << 20, backward_elements=8 << 20, min_vocab=256)
    # Qwen2.5-7B's benchmark shape: all 4096 tokens in one chunk, 1024 / 2048 vocab columns.
    assert tiling.tile_shape(4096, 152064, budget.forward_elements, budget) == (4096, 1024)
    assert tiling.tile_shape(4096, 152064, budget.backward_elements, budget) == (4096, 2048)
    assert tiling.tile_shape(1, 152064, budget.forward_elements, budget) == (1, 152064)  # one tile: the whole shard
    assert tiling.tile_shape(20000, 38016, budget.backward_elements, budget) == (4000, 2048)  # 5 even token chunks
    for tokens in (1, 3, 255, 4096, 4097, 9000, 1 << 20):
        for n_valid in (1, 300, 19008, 152064):
            tc, vc = tiling.tile_shape(tokens, n_valid, budget.backward_elements, budget)
            assert 1 <= tc <= budget.max_tokens and 1 <= vc <= n_valid
            assert tc * min(vc, budget.min_vocab) <= budget.backward_elements  # bounded whatever T is
            assert vc == n_valid or vc & (vc - 1) == 0  # a power of two unless it is the shard
            chunks = tiling.chunks(tokens, tc)
            assert chunks[-1][1] == tokens and max(b - a for a, b in chunks) - min(b - a for a, b in chunks) <= tc


class _Log(TorchDispatchMode):
    """Records the largest tensor any op creates and the matmuls (mm / addmm) run."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.matmuls = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0].rstrip("_") in ("mm", "addmm"):
            self.matmuls.append(func.__name__)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_each_logit_tile_once_and_bounded_scratch(monkeypatch):
    """Backward: 3 matmuls per tile (logits, d hidden, d weight), i.e. the logits are computed once; no tensor larger
    than the inputs, their gradients or one tile is ever created."""
    budget = tiling.TileBudget(max_tokens=16, forward_elements=96, backward_elements=192, min_vocab=4)
    monkeypatch.setattr(lle, "INTERPRET_BUDGET", budget)
    num_tokens, hdim, vocab = 40, 8, 100
    hidden = torch.randn(num_tokens, hdim, requires_grad=True)
    weight = (torch.randn(vocab, hdim) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (num_tokens,))
    with _Log() as fwd:
        logp, ent = lle.linear_logprobs_and_entropy(hidden, weight, labels)
    with _Log() as bwd:
        (logp.sum() + ent.sum()).backward()
    tc, vc_f = tiling.tile_shape(num_tokens, vocab, budget.forward_elements, budget)
    _, vc_b = tiling.tile_shape(num_tokens, vocab, budget.backward_elements, budget)
    n_tok = -(-num_tokens // tc)
    assert (tc, vc_f, vc_b, n_tok) == (14, 4, 8, 3)
    assert len(fwd.matmuls) == n_tok * -(-vocab // vc_f)
    assert len(bwd.matmuls) == 3 * n_tok * -(-vocab // vc_b)
    assert max(fwd.max_numel, bwd.max_numel) <= max(vocab * hdim, num_tokens * hdim, 3 * num_tokens)
    assert num_tokens * vocab > vocab * hdim  # so a [T, V] tensor would have been seen


def test_forward_carry_equals_one_pass():
    """The log-prob kernel's carried state: a row streamed over several launches = the same row in one launch."""
    logits = torch.randn(6, 90) * 3
    labels = torch.randint(0, 90, (6,))
    cols = Columns(0.9, 0, 90)
    whole = le.logprob_entropy_forward(logits, labels, cols)
    state, cuts = torch.empty(4, 6), [0, 7, 40, 41, 90]
    for i, (v0, v1) in enumerate(zip(cuts, cuts[1:])):
        part = le.logprob_entropy_forward(
            logits[:, v0:v1].contiguous(), labels, cols.window(v0, v1), state=state, carry_in=i > 0, carry_out=v1 < 90
        )
    torch.testing.assert_close(part, whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        le.logprob_entropy_forward(logits, labels, Columns(1.0, 0, 90), carry_out=True)


def test_shard_of_padding_only():
    """A TP rank whose shard is all padding (n_valid = 0): stats (-inf, 0, 0), zero weight gradient."""
    hidden = torch.randn(3, 8)
    weight = torch.randn(5, 8, requires_grad=True)
    cols = Columns(1.0, 5, 0)
    stats = lle.linear_forward(hidden, weight, torch.zeros(3, dtype=torch.int64), cols)
    assert torch.equal(stats[0], torch.full((3,), float("-inf"))) and torch.equal(stats[1:], torch.zeros(2, 3))
    d_h, d_w = lle.linear_backward(hidden, weight, torch.zeros(3, dtype=torch.int64), stats, torch.ones(2, 3), cols)
    assert not d_h.any() and not d_w.any()


def test_chunked_reference_never_builds_full_logits():
    num_tokens, hdim, vocab, chunk = 64, 16, 1000, 8
    hidden, weight = torch.randn(num_tokens, hdim), torch.randn(vocab, hdim) * 0.3
    labels = torch.randint(0, vocab, (num_tokens,))
    results = []
    for ct in (chunk, None):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _Log() as log:
            logp, ent = linear_logprobs_and_entropy_chunked(h, w, labels, chunk_tokens=ct)
            (logp.sum() - ent.sum()).backward()
        results.append((log.max_numel, logp, ent, h.grad, w.grad))
    # largest tensors: one [chunk, V] logits chunk or the [V, H] weight gradient, never [T, V]
    assert results[0][0] <= max(chunk * vocab, vocab * hdim) < num_tokens * vocab
    assert results[1][0] >= num_tokens * vocab  # the detector sees the unchunked run's [T, V]
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# GPU (tools/gpu/device_check.sh runs these): cuBLAS GEMMs with fp32 output and the compiled kernels
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 300, 4099])
def test_cuda_matches_float64(dtype, num_tokens):
    """Real GPU tiles: T = 4099 takes two token chunks (the fp32 d_weight accumulator), V = 4096 rows with 4000 real
    (padding), a vocab tile boundary inside the shard."""
    hdim, vocab, true_vocab = 256, 4096, 4000
    hidden = torch.randn(num_tokens, hdim).to(dtype)
    weight = (torch.randn(vocab, hdim) * 0.1).to(dtype)
    labels = torch.randint(0, true_vocab, (num_tokens,))
    budget = tiling.TileBudget(max_tokens=4096, forward_elements=1 << 20, backward_elements=1 << 20, min_vocab=256)
    old, lle.GPU_BUDGET = lle.GPU_BUDGET, budget
    try:
        _check(lle.linear_logprobs_and_entropy, hidden, weight, labels, dtype, vocab_size=true_vocab, rounded=True,
               device="cuda")  # fmt: skip
    finally:
        lle.GPU_BUDGET = old


@pytest.mark.gpu
def test_cuda_deterministic_at_a_real_shape():
    """Bit-identical outputs and gradients over two runs at a Qwen-like shard (T=2048, H=1024, V=38016 bf16)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2048, 1024, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(38016, 1024, device="cuda", generator=gen) * 0.03).bfloat16()
    labels = torch.randint(0, 38016, (2048,), device="cuda", generator=gen)
    g = torch.randn(2, 2048, device="cuda", generator=gen)
    runs = [_run(lle.linear_logprobs_and_entropy, hidden, weight, labels, g[0], g[1], temperature=0.9) for _ in "ab"]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_fp32_accumulation_fallback(monkeypatch):
    """Where torch refuses an fp32 accumulator for half inputs, the product is added instead: same gradients."""
    hidden = torch.randn(700, 128, device="cuda").bfloat16()
    weight = (torch.randn(3000, 128, device="cuda") * 0.1).bfloat16()
    labels = torch.randint(0, 3000, (700,), device="cuda")
    g = torch.randn(2, 700, device="cuda")
    budget = tiling.TileBudget(max_tokens=256, forward_elements=1 << 18, backward_elements=1 << 18, min_vocab=256)
    monkeypatch.setattr(lle, "GPU_BUDGET", budget)
    native = _run(lle.linear_logprobs_and_entropy, hidden, weight, labels, g[0], g[1])
    monkeypatch.setattr(lle, "_fp32_accumulate_supported", lambda device, dtype: False)
    added = _run(lle.linear_logprobs_and_entropy, hidden, weight, labels, g[0], g[1])
    for a, b in zip(native, added):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
