"""The fused policy-loss kernel's GSPO and CISPO kinds and the packed layout (Triton interpreter on CPU) against the
reference `surrogate_loss`; the padded and packed layouts of the same tokens give the same loss and gradient."""

import pytest
import torch

from megatron_dapo.algorithms import LossInputs
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import sequence_log_ratio
from megatron_dapo.algorithms.policy_loss import surrogate_loss
from megatron_dapo.ops.pg_loss import fused_surrogate_loss
from megatron_dapo.ops.pg_loss import sequence_log_ratio_fused

SPECS = {
    "clip-token-mean": Surrogate("clip", ClipBounds.make(0.2, 0.28, 3.0), "token-mean"),
    "clip-seq-mean": Surrogate("clip", ClipBounds.make(0.2, 0.2, None), "seq-mean-token-mean"),
    "clip-norm": Surrogate("clip", ClipBounds.make(0.2, 0.2, None), "seq-mean-token-sum-norm", 37.0),
    "gspo": Surrogate("gspo", ClipBounds.make(3e-4, 4e-4, None), "seq-mean-token-mean"),
    "cispo": Surrogate("cispo", ClipBounds.make(None, 0.28, None), "token-mean"),
    "cispo-floor-seqsum": Surrogate("cispo", ClipBounds.make(0.1, 0.28, None), "seq-mean-token-sum"),
}


def _padded(lengths: list[int], width: int, seed: int, kind: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    b = len(lengths)
    old = -torch.rand(b, width, generator=gen) * 4 - 0.01
    spread = 3e-4 if kind == "gspo" else 0.4
    logp = old + (torch.rand(b, width, generator=gen) - 0.5) * 2 * spread
    if kind == "gspo":
        logp = logp + (torch.rand(b, 1, generator=gen) - 0.5) * 2e-3
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    adv = torch.randn(b, generator=gen)
    return logp.to(dtype), old, adv, mask


def _pack(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t[mask]


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kind_matches_reference(name, dtype):
    spec = SPECS[name]
    # lengths not multiples of anything, one empty row, one row longer than the 256-token GSPO block
    lengths = [1, 0, 7, 300, 33, 129]
    logp, old, adv, mask = _padded(lengths, 301, seed=len(name), kind=spec.kind, dtype=dtype)
    weights = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(3))
    for w in (None, weights):
        x = logp.clone().requires_grad_(True)
        loss, metrics = fused_surrogate_loss(LossInputs(x, old, adv, mask, weights=w), spec)
        loss.backward()
        y = logp.clone().requires_grad_(True)
        ref, ref_metrics = surrogate_loss(LossInputs(y, old, adv, mask, weights=w), spec)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-6)
        torch.testing.assert_close(x.grad.float(), y.grad.float(), **tol)
        assert x.grad.dtype == dtype
        for key, value in ref_metrics.items():
            torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", list(SPECS))
def test_packed_layout_equals_padded_rows(name):
    """The same sequences packed back to back with cu_seqlens (no padding) give the padded rows' loss, gradient and
    metrics, on the kernel and on the reference fallback."""
    spec = SPECS[name]
    lengths = [5, 0, 260, 3, 17]
    logp, old, adv, mask = _padded(lengths, 260, seed=11, kind=spec.kind)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = logp.clone().requires_grad_(True)
    want, want_metrics = fused_surrogate_loss(LossInputs(x, old, adv, mask), spec)
    want.backward()
    for per_token_adv in (False, True):
        y = _pack(logp, mask).clone().requires_grad_(True)
        a = _pack(adv[:, None].expand_as(logp), mask) if per_token_adv else adv
        packed = LossInputs(y, _pack(old, mask), a, torch.ones(int(mask.sum()), dtype=torch.bool))
        loss, metrics = fused_surrogate_loss(packed, spec, cu_seqlens=cu)
        loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y.grad, x.grad[mask], rtol=1e-5, atol=1e-7)
        for key, value in want_metrics.items():
            torch.testing.assert_close(metrics[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_packed_reference_fallback_matches(monkeypatch):
    """Without the interpreter (plain CPU), the packed call runs the reference through padded rows: same loss."""
    import megatron_dapo.ops.pg_loss as pg

    spec = SPECS["gspo"]
    lengths = [4, 9, 1]
    logp, old, adv, mask = _padded(lengths, 9, seed=5, kind="gspo")
    cu = torch.tensor([0, 4, 13, 14], dtype=torch.int32)
    packed = LossInputs(logp[mask], old[mask], adv, torch.ones(14, dtype=torch.bool))
    kernel, _ = fused_surrogate_loss(packed, spec, cu_seqlens=cu)
    monkeypatch.setattr(pg, "use_triton", lambda t: False)
    fallback, _ = fused_surrogate_loss(packed, spec, cu_seqlens=cu)
    torch.testing.assert_close(fallback, kernel, rtol=1e-5, atol=1e-6)


def test_sequence_log_ratio_kernel_matches_torch():
    lengths = [0, 1, 255, 256, 257, 513]
    logp, old, _, mask = _padded(lengths, 513, seed=2, kind="cispo")
    mask[3, 10:20] = False  # holes inside a sequence are skipped, not counted
    starts = torch.arange(len(lengths) + 1, dtype=torch.int32) * 513
    got = sequence_log_ratio_fused(logp.contiguous(), old.contiguous(), mask.to(torch.float32).contiguous(), starts)
    want = sequence_log_ratio(torch.where(mask, logp - old, torch.zeros_like(logp)), mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert float(got[0]) == 0.0


def test_bad_packed_inputs_are_refused():
    spec = SPECS["gspo"]
    x = torch.zeros(5)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to 5"):
        fused_surrogate_loss(LossInputs(x, x, torch.zeros(2), x > -1), spec, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"advantages must be per sequence \(2,\)"):
        fused_surrogate_loss(LossInputs(x, x, torch.zeros(3), x > -1), spec, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="packed logp"):
        fused_surrogate_loss(
            LossInputs(x[None], x[None], torch.zeros(1), x[None] > -1), spec, cu_seqlens=torch.tensor([0, 5])
        )
