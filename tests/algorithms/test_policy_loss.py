"""dapo_policy_loss against values computed independently (scalar float64 formula, by hand)."""

import math

import pytest
import torch

from megatron_dapo.algorithms import agg_loss
from megatron_dapo.algorithms import dapo_policy_loss
from megatron_dapo.algorithms import get_policy_loss


def scalar_token_loss(lp, old, a, eps_low, eps_high, c):
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def scalar_reference(logp, old, adv, mask, eps_low, eps_high, c, num_tokens=None):
    total, count = 0.0, 0.0
    high = low = 0
    kl = 0.0
    rmax = 0.0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b][t]:
                continue
            a = adv[b] if adv.dim() == 1 else adv[b][t]
            a = float(a)
            lp, o = float(logp[b][t]), float(old[b][t])
            total += scalar_token_loss(lp, o, a, eps_low, eps_high, c)
            count += 1
            r = math.exp(lp - o)
            high += a > 0 and r > 1 + eps_high
            low += a < 0 and r < 1 - eps_low
            kl += o - lp
            rmax = max(rmax, r)
    denom = num_tokens if num_tokens is not None else count
    return total / max(denom, 1), high / max(count, 1), low / max(count, 1), kl / max(count, 1), rmax


@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("adv_dims", [1, 2])
def test_matches_scalar_formula(clip_c, adv_dims):
    b, t = 5, 7
    logp = torch.randn(b, t) * 0.5 - 1.0
    old = logp + torch.randn(b, t) * 0.6  # ratios spread over both clip bounds and past c
    adv = torch.randn(b) if adv_dims == 1 else torch.randn(b, t)
    mask = torch.rand(b, t) > 0.3
    loss, m = dapo_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=clip_c)
    ref = scalar_reference(logp.double(), old.double(), adv.double(), mask, 0.2, 0.28, clip_c)
    assert loss.item() == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert m["clipfrac_high"].item() == pytest.approx(ref[1], abs=1e-6)
    assert m["clipfrac_low"].item() == pytest.approx(ref[2], abs=1e-6)
    assert m["approx_kl"].item() == pytest.approx(ref[3], rel=1e-5, abs=1e-6)
    assert m["ratio_max"].item() == pytest.approx(ref[4], rel=1e-5)
    assert ref[1] > 0 and ref[2] > 0  # the data really exercises both clip sides
    assert all(v.dim() == 0 and v.dtype == torch.float32 for v in m.values())


def test_gradient_matches_finite_difference_formula():
    # d l / d logp = -A * r where the unclipped branch is active, 0 where the clipped branch is active.
    logp = torch.tensor([[0.0, 0.5, -0.5, 0.1]], requires_grad=True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4)
    loss, _ = dapo_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    r = [1.0, math.exp(0.5), math.exp(-0.5), math.exp(0.1)]
    # token 0: r=1 inside -> -A*r; token 1: A>0, r=1.65>1.28 -> clipped, 0; token 2: A<0, r=0.61<0.8 -> clipped, 0;
    # token 3: A<0, r=1.105 inside -> -A*r = 2*r.
    expected = torch.tensor([[-1.0 * r[0], 0.0, 0.0, 2.0 * r[3]]]) / 4
    torch.testing.assert_close(logp.grad, expected)


def test_asymmetric_bounds_exactly_at_the_bound():
    # Build ratios that are exactly representable, then put the bound exactly on them.
    logp = torch.tensor([[0.3, -0.4]])
    old = torch.zeros(1, 2)
    r = torch.exp(logp - old)
    eps_high = float(r[0, 0]) - 1.0
    eps_low = 1.0 - float(r[0, 1])
    assert torch.clamp(r, 1 - eps_low, 1 + eps_high).tolist() == r.tolist()
    lp = logp.clone().requires_grad_(True)
    adv = torch.tensor([[2.0, -3.0]])
    loss, m = dapo_policy_loss(lp, old, adv, torch.ones(1, 2), eps_low=eps_low, eps_high=eps_high)
    loss.backward()
    # At the bound both branches coincide and the gradient is the unclipped one (clamp passes it through).
    expected_loss = (-2.0 * r[0, 0] + 3.0 * r[0, 1]) / 2
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0 * r[0, 0], 3.0 * r[0, 1]]]) / 2)
    # Strictly beyond the bound is clipped (zero gradient, counted in clipfrac); at the bound is not counted.
    assert m["clipfrac_high"].item() == 0.0 and m["clipfrac_low"].item() == 0.0
    lp2 = (logp + torch.tensor([[1e-3, -1e-3]])).requires_grad_(True)
    loss2, m2 = dapo_policy_loss(lp2, old, adv, torch.ones(1, 2), eps_low=eps_low, eps_high=eps_high)
    loss2.backward()
    assert lp2.grad.abs().max().item() == 0.0
    assert m2["clipfrac_high"].item() == 0.5 and m2["clipfrac_low"].item() == 0.5


def test_asymmetry_positive_vs_negative_advantage():
    # Ratio 1.25 lies inside [0.8, 1.28] (clip-higher) but outside [0.8, 1.2] (symmetric clip).
    logp = torch.full((1, 1), math.log(1.25), requires_grad=True)
    old = torch.zeros(1, 1)
    for eps_high, expect_grad in ((0.28, -1.25), (0.2, 0.0)):
        logp.grad = None
        loss, _ = dapo_policy_loss(logp, old, torch.ones(1), torch.ones(1, 1), eps_low=0.2, eps_high=eps_high)
        loss.backward()
        assert logp.grad.item() == pytest.approx(expect_grad, rel=1e-6, abs=1e-7)


def test_dual_clip():
    # A < 0 with a huge ratio: PPO's loss -A*r grows without bound; dual clip caps it at -A*c, with zero gradient.
    logp = torch.tensor([[math.log(5.0), math.log(2.0)]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[-1.0, -1.0]])
    loss, _ = dapo_policy_loss(logp, old, adv, torch.ones(1, 2), clip_ratio_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 2]]))
    # Exactly at c both branches coincide.
    at_c = torch.tensor([[math.log(3.0)]])
    loss_c, _ = dapo_policy_loss(at_c, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio_c=3.0)
    assert loss_c.item() == pytest.approx(3.0, rel=1e-6)
    # Dual clip never touches positive advantages.
    pos, _ = dapo_policy_loss(logp.detach(), old, -adv, torch.ones(1, 2), clip_ratio_c=3.0)
    assert pos.item() == pytest.approx((-1.28 - 1.28) / 2, rel=1e-6)


def test_empty_mask_gives_zero_not_nan():
    logp = torch.randn(2, 3, requires_grad=True)
    loss, m = dapo_policy_loss(logp, logp.detach(), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)
    assert all(torch.isfinite(v) for v in m.values())


def _split_grads(mode, logp, old, adv, mask, splits, pass_global):
    total = 0.0
    grad = torch.zeros_like(logp)
    global_count = mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()
    for rows in splits:
        lp = logp[rows].clone().requires_grad_(True)
        from megatron_dapo.algorithms.policy_loss import ClipBounds
        from megatron_dapo.algorithms.policy_loss import clipped_token_loss

        tok = clipped_token_loss(lp, old[rows], adv[rows], ClipBounds.make(0.2, 0.28, None))[0]
        if pass_global:
            loss = agg_loss(tok, mask[rows], mode, num_tokens=global_count)
        else:  # naive gradient accumulation: average of per-micro-batch means
            loss = agg_loss(tok, mask[rows], mode) / len(splits)
        loss.backward()
        grad[rows] = lp.grad
        total += loss.item()
    return total, grad


def test_token_mean_is_invariant_to_micro_batching():
    torch.manual_seed(1)
    b, t = 8, 12
    logp = torch.randn(b, t) * 0.3 - 1
    old = logp + 0.2 * torch.randn(b, t)
    adv = torch.randn(b)
    lengths = torch.tensor([1, 12, 3, 9, 5, 2, 12, 7])  # very unequal
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    whole, grad_whole = _split_grads("token-mean", logp, old, adv, mask, [torch.arange(b)], True)
    for splits in (
        [torch.arange(0, 4), torch.arange(4, 8)],
        [torch.tensor([i]) for i in range(b)],
        [torch.tensor([0, 5, 6]), torch.tensor([1, 2, 3, 4, 7])],
    ):
        total, grad = _split_grads("token-mean", logp, old, adv, mask, splits, True)
        assert total == pytest.approx(whole, abs=1e-6)
        torch.testing.assert_close(grad, grad_whole, rtol=0, atol=1e-6)
    # Without the global count (each micro-batch normalised by its own tokens) the result changes.
    total, grad = _split_grads("token-mean", logp, old, adv, mask, [torch.arange(0, 1), torch.arange(1, 8)], False)
    assert (grad - grad_whole).abs().max() > 0.1 * grad_whole.abs().max()


def test_seq_mean_token_mean_differs_on_unequal_lengths():
    b, t = 4, 10
    logp = torch.randn(b, t) * 0.3 - 1
    old = logp.clone()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    equal = torch.ones(b, t)
    unequal = (torch.arange(t)[None, :] < torch.tensor([1, 10, 4, 7])[:, None]).float()
    for mask, should_match in ((equal, True), (unequal, False)):
        _, g_tok = _split_grads("token-mean", logp, old, adv, mask, [torch.arange(b)], True)
        _, g_seq = _split_grads("seq-mean-token-mean", logp, old, adv, mask, [torch.arange(b)], True)
        same = torch.allclose(g_tok, g_seq, atol=1e-7)
        assert same == should_match
    # The GRPO aggregation gives every sequence equal weight: each token of a 1-token response weighs 10x a token of
    # a 10-token response; token-mean weighs all tokens equally (1/22).
    _, g_seq = _split_grads("seq-mean-token-mean", logp, old, adv, unequal, [torch.arange(b)], True)
    assert g_seq[0, 0].abs().item() == pytest.approx(10 * g_seq[1, 0].abs().item(), rel=1e-5)
    _, g_tok = _split_grads("token-mean", logp, old, adv, unequal, [torch.arange(b)], True)
    assert g_tok[0, 0].abs().item() == pytest.approx(g_tok[1, 0].abs().item(), rel=1e-5)


def test_registry_and_agg_errors():
    assert get_policy_loss("dapo").config_cls.__name__ == "DAPOConfig"
    with pytest.raises(ValueError, match="algorithm.policy_loss"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="loss.loss_agg_mode"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "bogus")
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    tok, _ = dapo_policy_loss(logp, logp, adv, mask)
    seq, _ = dapo_policy_loss(logp, logp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert tok.item() == pytest.approx((-1 + 3) / 4) and seq.item() == pytest.approx((-1 + 1) / 2)


def test_dual_clip_tie_keeps_unclipped_gradient_and_padding_overflow_is_ignored():
    logp = torch.tensor([[math.log(3.0), 100.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.tensor([[1.0, 0.0]])  # the padded token's ratio overflows to inf
    loss, m = dapo_policy_loss(logp, old, torch.tensor([[-1.0, -1.0]]), mask, clip_ratio_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0, rel=1e-6) and torch.isfinite(loss)
    assert logp.grad[0, 0].item() == pytest.approx(3.0, rel=1e-6) and logp.grad[0, 1].item() == 0.0
    assert all(torch.isfinite(v) for v in m.values())
