"""clipped_pg_loss (Triton, interpreter on CPU) against dapo_policy_loss, a float64 oracle and hand values."""

import math

import pytest
import torch

from megatron_dapo.algorithms.policy_loss import dapo_policy_loss
from megatron_dapo.ops import pg_loss as pg_mod
from megatron_dapo.ops.dispatch import kernel_backend as select_backend
from megatron_dapo.ops.pg_loss import clipped_pg_loss

METRICS = ("clipfrac_high", "clipfrac_low", "approx_kl", "ratio_max")
RTOL, ATOL = 1e-5, 2e-6  # fp32 row of the tolerance table (STYLE.md 5), atol tightened for O(1) values


def _oracle(logp, old_logp, adv, mask, eps_low, eps_high, clip_c, num_tokens):
    """float64 loss, d loss / d logp and metrics written from the spec (ties take the unclipped gradient).

    The ratio is rounded to fp32 once (as every implementation computes it), so tokens exactly on a bound in fp32
    stay on it here; everything after it is float64."""
    lp, old = logp.detach().double(), old_logp.double()
    a = adv.double()
    a = a[:, None].expand_as(lp) if a.dim() == 1 else a
    r = torch.exp(lp.float() - old.float()).double()
    unclipped, clipped = -a * r, -a * r.clamp(1 - eps_low, 1 + eps_high)
    loss_tok = torch.maximum(unclipped, clipped)
    grad_tok = torch.where(unclipped >= clipped, unclipped, torch.zeros_like(r))
    if clip_c is not None:
        capped = (a < 0) & (loss_tok > -a * clip_c)
        loss_tok = torch.where(capped, -a * clip_c, loss_tok)
        grad_tok = torch.where(capped, torch.zeros_like(r), grad_tok)
    w = mask.double()
    denom = max(float(w.sum() if num_tokens is None else num_tokens), 1.0)
    valid = mask != 0
    count = max(int(valid.sum()), 1)
    metrics = {
        "clipfrac_high": float(((a > 0) & (r > 1 + eps_high) & valid).sum()) / count,
        "clipfrac_low": float(((a < 0) & (r < 1 - eps_low) & valid).sum()) / count,
        "approx_kl": float(((old - lp) * valid).sum()) / count,
        "ratio_max": float(torch.where(valid, r, torch.zeros_like(r)).max()) if r.numel() else 0.0,
    }
    loss_sum = torch.where(valid, loss_tok * w, torch.zeros_like(w)).sum()
    return loss_sum / denom, torch.where(valid, grad_tok * w, torch.zeros_like(w)) / denom, metrics


def _inputs(b, t, adv_per_token, seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(b, t, generator=g) * scale
    adv = torch.randn(b, t, generator=g) if adv_per_token else torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0, -2:] = False
    return logp, old, adv, mask


def _run(fn, logp, old, adv, mask, dy, **kw):
    loss, metrics = fn(logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss * dy, logp)
    return loss, metrics, grad


@pytest.mark.parametrize("adv_per_token", [False, True])
@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("num_tokens", [None, 37, "tensor"])
def test_matches_reference_and_oracle(adv_per_token, clip_c, num_tokens):
    logp, old, adv, mask = _inputs(4, 9, adv_per_token)
    # Large negative advantages and ratios above c so the dual clip is active for some tokens.
    old[1, :4] -= 2.0
    adv[1] = -1.0
    mask[1, :4] = True
    if num_tokens == "tensor":
        num_tokens = torch.tensor(41.0)
    dy = torch.randn(())
    kw = {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": clip_c, "num_tokens": num_tokens}
    loss, metrics, grad = _run(clipped_pg_loss, logp, old, adv, mask, dy, **kw)
    ref_loss, ref_metrics, ref_grad = _run(dapo_policy_loss, logp, old, adv, mask, dy, **kw)
    o_loss, o_grad, o_metrics = _oracle(logp, old, adv, mask, 0.2, 0.28, clip_c, num_tokens)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.double(), o_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad.double(), o_grad * dy.double(), rtol=RTOL, atol=ATOL)
    for k in METRICS:
        assert metrics[k].dtype == torch.float32 and metrics[k].dim() == 0 and not metrics[k].requires_grad
        torch.testing.assert_close(metrics[k], ref_metrics[k], rtol=RTOL, atol=ATOL, msg=k)
        assert metrics[k].item() == pytest.approx(o_metrics[k], rel=RTOL, abs=ATOL), k
    if clip_c is not None:  # the case really exercised the dual clip
        r = torch.exp(logp.detach() - old)
        a = adv if adv.dim() == 2 else adv[:, None].expand_as(r)
        assert ((a < 0) & (r > clip_c) & mask).any()


def test_hand_values():
    ln2 = math.log(2.0)
    old = torch.zeros(2, 3)
    logp = torch.tensor([[ln2, 0.0, -ln2], [ln2, 0.0, -ln2]], requires_grad=True)  # ratios 2, 1, 0.5 (exact)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3)
    loss, m = clipped_pg_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    (grad,) = torch.autograd.grad(loss, logp)
    # A=+1: l = [-1.28, -1, -0.5]; A=-1: l = [2, 1, 0.8]; D = 6
    assert loss.item() == pytest.approx((-1.28 - 1 - 0.5 + 2 + 1 + 0.8) / 6, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, -0.5], [2.0, 1.0, 0.0]]) / 6)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 6)
    assert m["clipfrac_low"].item() == pytest.approx(1 / 6)
    assert m["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["ratio_max"].item() == pytest.approx(2.0)
    # dual clip c = 1.5 caps the A<0, ratio 2 token at 1.5 with zero gradient
    loss, _ = clipped_pg_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=1.5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx((-1.28 - 1 - 0.5 + 1.5 + 1 + 0.8) / 6, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, -0.5], [0.0, 1.0, 0.0]]) / 6)


@pytest.mark.parametrize("eps_low,eps_high", [(0.5, 1.0), (0.0, 0.0), (0.5, 0.0), (0.0, 1.0)])
def test_ratio_exactly_on_bounds(eps_low, eps_high):
    """Ratios 0.5, 1, 2 are exact in fp32 (fp32 ln2 rounds back to 2.0 under exp); with these eps they sit on the
    bounds. Convention: the unclipped branch equals the clipped one there, the gradient is the unclipped -A r, and
    the strict clip-fraction comparisons do not count the token."""
    ln2 = torch.tensor(math.log(2.0), dtype=torch.float32).item()
    row = torch.tensor([ln2, 0.0, -ln2])
    assert torch.equal(torch.exp(row), torch.tensor([2.0, 1.0, 0.5]))
    logp = torch.stack([row, row]).requires_grad_()
    old = torch.zeros(2, 3)
    adv = torch.tensor([0.7, -1.3])
    mask = torch.ones(2, 3, dtype=torch.bool)
    kw = {"eps_low": eps_low, "eps_high": eps_high}
    dy = torch.tensor(1.7)
    loss, m, grad = _run(clipped_pg_loss, logp, old, adv, mask, dy, **kw)
    ref_loss, ref_m, ref_grad = _run(dapo_policy_loss, logp, old, adv, mask, dy, **kw)
    o_loss, o_grad, o_m = _oracle(logp, old, adv, mask, eps_low, eps_high, None, None)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad.double(), o_grad * 1.7, rtol=RTOL, atol=ATOL)
    for k in METRICS:
        torch.testing.assert_close(m[k], ref_m[k], rtol=RTOL, atol=ATOL, msg=k)
        assert m[k].item() == pytest.approx(o_m[k], rel=RTOL, abs=ATOL), k
    r = torch.tensor([2.0, 1.0, 0.5])
    lo, hi = 1 - eps_low, 1 + eps_high
    on_bound = (r == lo) | (r == hi)
    assert on_bound.any()
    # every token on a bound keeps the full unclipped gradient -A r / D
    expected_on_bound = (-adv[:, None] * r / 6 * 1.7).expand(2, 3)
    torch.testing.assert_close(grad[:, on_bound], expected_on_bound[:, on_bound])


def test_dual_clip_exactly_at_c():
    """A < 0 and ratio == c exactly: l == -A c; convention: the gradient is the unclipped -A r (torch.clamp(l,
    max=cap) semantics). torch.minimum would give half of it at this single tie point."""
    ln2 = torch.tensor(math.log(2.0), dtype=torch.float32).item()
    logp = torch.tensor([[ln2, ln2]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, m = clipped_pg_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=2.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(2.0)
    torch.testing.assert_close(grad, torch.tensor([[2.0, 0.0]]))
    assert m["ratio_max"].item() == 2.0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_masking_edge_cases():
    logp, old, adv, mask = _inputs(3, 5, False, seed=3)
    adv[1] = -1.0  # -A * inf = +inf would win the max: the kernel must still add exactly 0 for the masked token
    mask[1] = False  # a fully masked row
    # masked-out tokens may hold anything: padding log-probs far apart would overflow exp()
    with torch.no_grad():
        logp[1, 0] = 0.0
    old[1, 0] = -200.0
    dy = torch.randn(())
    loss, m, grad = _run(clipped_pg_loss, logp, old, adv, mask, dy)
    o_loss, o_grad, o_m = _oracle(logp, old, adv, mask, 0.2, 0.28, None, None)
    torch.testing.assert_close(loss.double(), o_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad.double(), o_grad * dy.double(), rtol=RTOL, atol=ATOL)
    assert torch.isfinite(loss) and torch.all(grad[1] == 0)
    assert m["ratio_max"].item() == pytest.approx(o_m["ratio_max"], rel=RTOL)


@pytest.mark.parametrize("num_tokens", [None, 0, torch.tensor(0.0)])
def test_empty_mask_gives_zero_not_nan(num_tokens):
    logp, old, adv, _ = _inputs(2, 4, True, seed=5)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    loss, m, grad = _run(clipped_pg_loss, logp, old, adv, mask, torch.tensor(1.0), num_tokens=num_tokens)
    ref_loss, ref_m, ref_grad = _run(dapo_policy_loss, logp, old, adv, mask, torch.tensor(1.0), num_tokens=num_tokens)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert ref_loss.item() == 0.0 and torch.all(ref_grad == 0)
    for k in METRICS:
        assert m[k].item() == 0.0 and ref_m[k].item() == 0.0, k


def test_float_mask_weights_and_several_programs():
    """Float mask values weight the loss (D = mask.sum()); metrics count tokens with mask != 0. 3 x 700 tokens span
    three 1024-token programs, so the fixed-order partial reduction is exercised."""
    logp, old, adv, _ = _inputs(3, 700, False, seed=7)
    mask = torch.rand(3, 700) * (torch.rand(3, 700) > 0.3)
    dy = torch.randn(())
    loss, m, grad = _run(clipped_pg_loss, logp, old, adv, mask, dy, clip_ratio_c=2.5)
    ref_loss, ref_m, ref_grad = _run(dapo_policy_loss, logp, old, adv, mask, dy, clip_ratio_c=2.5)
    o_loss, o_grad, o_m = _oracle(logp, old, adv, mask, 0.2, 0.28, 2.5, None)
    assert pg_mod._launch_meta(logp.numel())[1] == 3
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.double(), o_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    for k in METRICS:
        torch.testing.assert_close(m[k], ref_m[k], rtol=RTOL, atol=ATOL, msg=k)
        assert m[k].item() == pytest.approx(o_m[k], rel=RTOL, abs=ATOL), k
    loss2, m2, grad2 = _run(clipped_pg_loss, logp, old, adv, mask, dy, clip_ratio_c=2.5)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)  # deterministic


def test_bf16_logp():
    logp, old, adv, mask = _inputs(3, 8, False, seed=11)
    lp16 = logp.detach().bfloat16().requires_grad_()
    dy = torch.randn(())
    loss, m, grad = _run(clipped_pg_loss, lp16, old, adv, mask, dy)
    ref_loss, ref_m, ref_grad = _run(dapo_policy_loss, lp16, old, adv, mask, dy)
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-2, atol=3e-3)
    for k in METRICS:
        torch.testing.assert_close(m[k], ref_m[k], rtol=1e-5, atol=1e-5, msg=k)


def test_cpu_fallback_runs_reference(monkeypatch):
    logp, old, adv, mask = _inputs(2, 5, False, seed=2)
    monkeypatch.setattr(pg_mod, "use_triton", lambda t: False)
    loss, m = clipped_pg_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    ref_loss, ref_m = dapo_policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    assert torch.equal(loss, ref_loss) and all(torch.equal(m[k], ref_m[k]) for k in METRICS)


def test_bad_inputs_and_backend(monkeypatch):
    logp, old, adv, mask = _inputs(2, 5, False)
    with pytest.raises(ValueError, match="old_logp shape"):
        clipped_pg_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="advantages must be"):
        clipped_pg_loss(logp, old, adv[:1], mask)
    with pytest.raises(ValueError, match="logp must be"):
        clipped_pg_loss(logp[0], old[0], adv, mask[0])
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        clipped_pg_loss(logp, old, adv, mask, clip_ratio_c=0.9)
    monkeypatch.setenv("MEGATRON_DAPO_KERNEL_BACKEND", "cuda")  # removed: no environment variable selects one
    assert select_backend() == "triton" and select_backend("cuda") == "cuda"
    loss, _ = clipped_pg_loss(
        logp, old, adv, mask, backend="cuda"
    )  # CPU tensors: the interpreter, whatever the GPU one
    torch.testing.assert_close(loss, dapo_policy_loss(logp, old, adv, mask)[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="kernel backend: unknown 'cudnn'"):
        clipped_pg_loss(logp, old, adv, mask, backend="cudnn")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_gpu_matches_reference(backend, clip_c):
    from megatron_dapo.ops import _cuda_twins

    if backend == "cuda" and not _cuda_twins.available():
        pytest.skip("CUDA twins library not built (csrc/README.md)")
    logp, old, adv, mask = (t.detach().cuda() for t in _inputs(16, 300, True, seed=13))
    logp.requires_grad_()
    dy = torch.randn((), device="cuda")
    kw = {"clip_ratio_c": clip_c, "num_tokens": torch.tensor(3000.0, device="cuda")}
    loss, m, grad = _run(lambda *a, **k: clipped_pg_loss(*a, backend=backend, **k), logp, old, adv, mask, dy, **kw)
    ref_loss, ref_m, ref_grad = _run(dapo_policy_loss, logp, old, adv, mask, dy, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    for k in METRICS:
        torch.testing.assert_close(m[k], ref_m[k], rtol=RTOL, atol=ATOL, msg=k)
    loss2, _, grad2 = _run(lambda *a, **k: clipped_pg_loss(*a, backend=backend, **k), logp, old, adv, mask, dy, **kw)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)  # no atomics: bitwise reproducible


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
@pytest.mark.parametrize("num_tokens", [None, 7.0])
def test_loss_agg_modes_match_reference(mode, num_tokens):
    """The kernel's sequence-mean modes (per-token weights + a sequence denominator) against agg_loss's, value,
    gradient and metrics; rows without valid tokens (row 2) must not count as sequences."""
    logp, old, adv, mask = _inputs(5, 9, adv_per_token=False, seed=11)
    mask[2] = False
    dy = torch.tensor(1.7)
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, num_tokens=num_tokens, loss_agg_mode=mode)
    loss, metrics, grad = _run(clipped_pg_loss, logp, old, adv, mask, dy, **kw)
    ref_loss, ref_metrics, ref_grad = _run(dapo_policy_loss, logp, old, adv, mask, dy, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL, atol=ATOL)
    for key in METRICS:
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=RTOL, atol=ATOL, msg=key)
    if mode == "seq-mean-token-mean" or (mode != "token-mean" and num_tokens is None):
        # the mode really differs from token-mean here (token-sum over an explicit D is token-mean by definition)
        token_mean, _ = dapo_policy_loss(logp, old, adv, mask, num_tokens=num_tokens)
        assert abs(float(token_mean) - float(loss.detach())) > 1e-3


def test_unknown_loss_agg_mode_is_named():
    logp, old, adv, mask = _inputs(2, 4, adv_per_token=False)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        clipped_pg_loss(logp, old, adv, mask, loss_agg_mode="seq-mean")
