"""DAPO policy loss at huge log-ratios (issue 9): finite loss AND gradient, equal across implementations.

Before the fix, `dapo_policy_loss` returned a finite loss but a NaN gradient once a valid token's logp - old_logp
passed ~88.7 (fp32 exp overflow, then 0 * inf in the backward of the inactive branch). Every implementation is
checked here, value and gradient, against two float64 oracles that share no code with the package:
- `_spec_oracle`: the documented semantics token by token in Python floats (decisions on the log-ratio,
  log-ratio clamped to +-20 before exp, ties unclipped);
- `_verl_oracle`: verl's compute_policy_loss_vanilla formulas (clamp to [-20, 20], exp, maximum, dual clip with
  min/where) in float64 torch with autograd, reduced with verl's token-mean agg_loss.
"""

import math

import pytest
import torch

from megatron_dapo.algorithms.policy_loss import dapo_policy_loss
from megatron_dapo.ops.pg_loss import clipped_pg_loss

IMPLS = {"reference": dapo_policy_loss, "triton": clipped_pg_loss}
EPS_LOW, EPS_HIGH = 0.2, 0.28
LOG_RATIOS = [100.0, -100.0, 1000.0, -1000.0, 88.8, -88.8, 25.0, -25.0, 19.5, -19.5, 0.3, -0.3, 0.0]


def _spec_oracle(log_ratios, advs, mask, clip_c):
    """float64 per-token loss and d loss / d logp from the spec, then token-mean over the valid tokens."""
    log_lo, log_hi = math.log1p(-EPS_LOW), math.log1p(EPS_HIGH)
    losses, grads = [], []
    for r, a in zip(log_ratios, advs, strict=True):
        ratio = math.exp(min(max(r, -20.0), 20.0))
        if a > 0 and r > log_hi:
            loss, grad = -a * (1 + EPS_HIGH), 0.0
        elif a < 0 and r < log_lo:
            loss, grad = -a * (1 - EPS_LOW), 0.0
        elif a < 0 and clip_c is not None and r > math.log(clip_c):
            loss, grad = -a * clip_c, 0.0
        else:
            loss, grad = -a * ratio, (-a * ratio if abs(r) <= 20.0 else 0.0)
        losses.append(loss)
        grads.append(grad)
    count = max(sum(mask), 1)
    total = sum(v for v, m in zip(losses, mask, strict=True) if m) / count
    return total, [g / count if m else 0.0 for g, m in zip(grads, mask, strict=True)]


def _verl_oracle(log_ratios, advs, mask, clip_c):
    """verl's vanilla PPO loss formulas in float64 (token-mean), value and autograd gradient wrt log_prob."""
    log_prob = torch.tensor(log_ratios, dtype=torch.float64, requires_grad=True)
    old_log_prob = torch.zeros_like(log_prob)
    advantages = torch.tensor(advs, dtype=torch.float64)
    response_mask = torch.tensor(mask, dtype=torch.float64)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    if clip_c is None:
        pg_losses = clip_pg_losses1
    else:
        clip_pg_losses2 = torch.min(-advantages * clip_c, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = (pg_losses * response_mask).sum() / response_mask.sum().clamp_min(1.0)
    loss.backward()
    return loss.item(), log_prob.grad.tolist()


def _case(seed: int):
    """Every log-ratio with a positive and a negative advantage; a few valid tokens masked out."""
    g = torch.Generator().manual_seed(seed)
    log_ratios = LOG_RATIOS * 2
    advs = [1.3] * len(LOG_RATIOS) + [-0.7] * len(LOG_RATIOS)
    mask = (torch.rand(len(log_ratios), generator=g) > 0.15).tolist()
    mask[0] = mask[len(LOG_RATIOS)] = True  # +100 with A > 0 and with A < 0 always valid
    return log_ratios, advs, mask


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_huge_log_ratios_value_and_gradient(impl, clip_c, seed):
    log_ratios, advs, mask = _case(seed)
    # logp and old_logp both large in magnitude, as real log-probs of very unlikely tokens are.
    old = torch.full((1, len(log_ratios)), -5.0)
    old[0, 2::3] = -500.0
    logp = (old + torch.tensor(log_ratios)).requires_grad_()
    r32 = (logp.detach() - old)[0].tolist()  # the fp32 log-ratios the implementations see
    m = torch.tensor([mask])
    loss, metrics = IMPLS[impl](
        logp, old, torch.tensor([advs]), m, eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_ratio_c=clip_c
    )
    dy = 1.7
    (grad,) = torch.autograd.grad(loss * dy, logp)
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad)), (loss, grad)
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    for name, oracle in (("spec", _spec_oracle), ("verl", _verl_oracle)):
        o_loss, o_grad = oracle(r32, advs, mask, clip_c)
        assert loss.item() == pytest.approx(o_loss, rel=1e-5, abs=1e-6), name
        torch.testing.assert_close(grad[0].double(), torch.tensor(o_grad, dtype=torch.float64) * dy, rtol=1e-5,
                                   atol=1e-6, msg=lambda s, n=name: f"{impl} vs {n} oracle: {s}")  # fmt: skip


@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_reference_and_kernel_agree_bitwise_on_branches(clip_c):
    """The branch of every token is decided on the log-ratio, so reference and kernel pick the same one even for
    log-ratios one fp32 ulp either side of log(1 - eps_low), log(1 + eps_high) and log(c): identical gradient
    support (which tokens get a gradient) and clip fractions."""
    bounds = [math.log1p(-EPS_LOW), math.log1p(EPS_HIGH)] + ([math.log(clip_c)] if clip_c else [])
    rs = []
    for b in bounds:
        b32 = torch.tensor(b, dtype=torch.float32)
        rs += [torch.nextafter(b32, torch.tensor(-1e9)), b32, torch.nextafter(b32, torch.tensor(1e9))]
    r = torch.stack(rs)
    logp = torch.cat([r, r]).reshape(2, -1).clone().requires_grad_()
    old = torch.zeros_like(logp)
    adv = torch.tensor([0.9, -1.1])
    mask = torch.ones_like(old, dtype=torch.bool)
    outs = {}
    for name, fn in IMPLS.items():
        loss, metrics = fn(logp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_ratio_c=clip_c)
        (grad,) = torch.autograd.grad(loss, logp)
        outs[name] = (grad != 0, metrics["clipfrac_high"].item(), metrics["clipfrac_low"].item(), loss, grad)
    (s_ref, hi_ref, lo_ref, l_ref, g_ref), (s_k, hi_k, lo_k, l_k, g_k) = outs["reference"], outs["triton"]
    assert torch.equal(s_ref, s_k) and hi_ref == hi_k and lo_ref == lo_k
    torch.testing.assert_close(l_k, l_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_k, g_ref, rtol=1e-6, atol=1e-7)
    # on the bound itself (middle of each triple) the unclipped gradient is kept, one ulp outside it is not
    # (A > 0 row at log(1 + eps_high), A < 0 row at log(1 - eps_low))
    assert s_ref[0, 3 + 1] and not s_ref[0, 3 + 2]
    assert s_ref[1, 0 + 1] and not s_ref[1, 0 + 0]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_gpu_huge_log_ratios(backend, clip_c):
    """The same inputs on the GPU: compiled Triton (ex2.approx exp) and the CUDA C++ twin, against the oracles."""
    from megatron_dapo.ops import _cuda_twins

    if backend == "cuda" and not _cuda_twins.available():
        pytest.skip("CUDA twins not built (csrc/README.md)")
    log_ratios, advs, mask = _case(0)
    old = torch.full((1, len(log_ratios)), -5.0, device="cuda")
    logp = (old + torch.tensor(log_ratios, device="cuda")).requires_grad_()
    r32 = (logp.detach() - old)[0].tolist()
    adv = torch.tensor([advs], device="cuda")
    m = torch.tensor([mask], device="cuda")
    loss, _ = clipped_pg_loss(logp, old, adv, m, clip_ratio_c=clip_c, backend=backend)
    (grad,) = torch.autograd.grad(loss, logp)
    o_loss, o_grad = _spec_oracle(r32, advs, mask, clip_c)
    assert loss.item() == pytest.approx(o_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad[0].double().cpu(), torch.tensor(o_grad, dtype=torch.float64), rtol=1e-5, atol=1e-6)
