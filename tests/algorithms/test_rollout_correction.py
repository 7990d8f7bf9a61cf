"""Rollout correction (TIS / MIS): weights and masks against a float64 re-implementation of the definitions, the
loss path (reference and fused, rollout_correction=none unchanged), the denominator and the batch plumbing."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.actor.loss import dapo_loss_func
from megatron_dapo.actor.loss import local_loss_denominator
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.algorithms.policy_loss import agg_loss
from megatron_dapo.algorithms.policy_loss import clipped_token_loss
from megatron_dapo.algorithms.policy_loss import dapo_policy_loss
from megatron_dapo.algorithms.rollout_correction import mismatch_metrics
from megatron_dapo.algorithms.rollout_correction import rollout_correction
from megatron_dapo.batch import ActorBatch
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import ConfigError
from megatron_dapo.config import RolloutConfig
from megatron_dapo.config import RunConfig
from megatron_dapo.experience import apply_rollout_correction
from megatron_dapo.ops.pg_loss import clipped_pg_loss

C, LOW, HIGH = 1.5, 0.6, 1.7


def _inputs(b=6, s=11, scale=0.35, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g) * 3
    engine = old + torch.randn(b, s, generator=g) * scale
    mask = (torch.rand(b, s, generator=g) > 0.2).float()
    mask[:, 0] = 0.0  # position 0 is never a response token
    mask[1] = 0.0  # a response with no valid token (overlong-filtered)
    mask[2, 3:] = 0.0  # a short one
    return old, engine, mask


def _oracle(old, engine, mask, mode, level):
    """float64 weights, mask and fractions written from the definitions (docs/rollout_correction.md)."""
    valid = mask != 0
    delta = torch.where(valid, old.double() - engine.double(), torch.zeros((), dtype=torch.float64))
    ell = delta.sum(-1, keepdim=True).expand_as(delta) if level == "sequence" else delta
    ell = torch.where(valid, ell, torch.zeros_like(ell))
    rho = torch.exp(ell.clamp(-20, 20))
    if mode == "tis":
        w = torch.where(valid, torch.minimum(rho, torch.tensor(C, dtype=torch.float64)), torch.zeros_like(rho))
        frac = float((valid & (rho > C)).sum()) / float(valid.sum())
        return w, mask.double(), frac, ell
    keep = valid & (rho >= LOW) & (rho <= HIGH)
    frac = float((valid & ~keep).sum()) / float(valid.sum())
    return torch.where(keep, rho, torch.zeros_like(rho)), torch.where(keep, 1.0, 0.0).double(), frac, ell


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_weights_and_masks_equal_float64_definition(mode, level):
    old, engine, mask = _inputs(b=6 if level == "token" else 16, scale=0.35 if level == "token" else 0.2)
    out = rollout_correction(old, engine, mask, mode=mode, level=level, is_threshold=C, mis_low=LOW, mis_high=HIGH)
    w64, m64, frac, ell = _oracle(old, engine, mask, mode, level)
    # Decisions exactly on a bound are a matter of rounding: the data must keep clear of them.
    for bound in (math.log(C), math.log(LOW), math.log(HIGH)):
        assert ((ell - bound).abs() > 1e-5).all()
    torch.testing.assert_close(out.weights.double(), w64, rtol=2e-6, atol=1e-7)
    assert torch.equal(out.mask.double(), m64)
    key = "rollout_corr/truncated_fraction" if mode == "tis" else "rollout_corr/masked_fraction"
    assert 0.0 < frac < 1.0, "the data must exercise both sides of the threshold"
    assert float(out.metrics[key]) == pytest.approx(frac, abs=1e-7)
    kept = m64 != 0
    assert float(out.metrics["rollout_corr/is_weight_mean"]) == pytest.approx(float(w64[kept].mean()), rel=1e-5)
    assert float(out.metrics["rollout_corr/is_weight_max"]) == pytest.approx(float(w64[kept].max()), rel=1e-5)
    if level == "sequence":  # one weight and one decision per response
        for row in range(mask.shape[0]):
            v = out.weights[row][mask[row] != 0]
            assert v.numel() == 0 or (v == v[0]).all()
    if mode == "mis" and level == "sequence":
        seq_dropped = ((mask != 0) & (m64 == 0)).any(-1).sum() / (mask != 0).any(-1).sum()
        assert float(out.metrics["rollout_corr/masked_seq_fraction"]) == pytest.approx(float(seq_dropped))


def test_mismatch_metrics_equal_float64_definition():
    old, engine, mask = _inputs()
    got = mismatch_metrics(old, engine, mask)
    valid = mask != 0
    d = (old.double() - engine.double())[valid]
    assert float(got["rollout_corr/kl_k3"]) == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-5)
    assert float(got["rollout_corr/kl_k1"]) == pytest.approx(float((-d).mean()), rel=1e-5)
    diffs = [
        float(engine[r][valid[r]].double().mean() - old[r][valid[r]].double().mean())
        for r in range(mask.shape[0])
        if valid[r].any()
    ]
    assert float(got["rollout_corr/log_ppl_diff"]) == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert float(got["rollout_corr/log_ppl_abs_diff"]) == pytest.approx(
        sum(abs(x) for x in diffs) / len(diffs), rel=1e-5
    )
    same = mismatch_metrics(old, old.clone(), mask)
    assert all(float(v) == 0.0 for v in same.values())


def _loss_inputs(b=6, s=11, seed=1):
    old, engine, mask = _inputs(b, s, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    logp = (old + torch.randn(b, s, generator=g) * 0.15).requires_grad_()
    adv = torch.randn(b, generator=g)
    return logp, old, engine, mask, adv


def _loss_and_grad(fn, logp, *args, **kw):
    loss, metrics = fn(logp, *args, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("fn", [dapo_policy_loss, clipped_pg_loss], ids=["reference", "fused"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_equal_logprobs_give_weight_one_and_the_same_loss(fn, mode, level):
    logp, old, _, mask, adv = _loss_inputs()
    out = rollout_correction(old, old.clone(), mask, mode=mode, level=level, is_threshold=C, mis_low=LOW, mis_high=HIGH)
    assert torch.equal(out.mask, mask)
    assert torch.equal(out.weights, mask)  # exactly 1 on every valid token, 0 elsewhere
    d = local_loss_denominator(out.mask)
    base = _loss_and_grad(fn, logp, old, adv, mask, num_tokens=d)
    corrected = _loss_and_grad(fn, logp, old, adv, out.mask, num_tokens=d, weights=out.weights)
    assert torch.equal(base[0], corrected[0]) and torch.equal(base[1], corrected[1])


def test_none_is_bit_identical_to_the_uncorrected_loss_path():
    """rollout_correction="none" leaves the batch as it was and the actor's loss_func calls the policy loss without
    weights: loss and gradient equal, bit for bit, the pre-correction composition clipped_token_loss -> agg_loss."""
    logp, old, engine, mask, adv = _loss_inputs()
    batch = ActorBatch(
        tokens=torch.zeros(mask.shape, dtype=torch.int64),
        loss_mask=mask,
        response_mask=mask.clone(),
        advantages=adv,
        old_logp=old,
        engine_logp=engine,
    )
    metrics = apply_rollout_correction(batch, AlgorithmConfig(rollout_correction="none"))
    assert batch.loss_mask is mask and batch.is_weight is None
    assert "rollout_corr/kl_k3" in metrics  # still measured
    d = local_loss_denominator(batch.loss_mask)
    loss_func = dapo_loss_func(batch.tokens, batch.loss_mask, old, adv, num_tokens=d, is_weight=batch.is_weight)
    loss, _ = loss_func(logp)
    (grad,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    tok, *_ = clipped_token_loss(logp2, old, adv, ClipBounds.make(0.2, 0.28, None), mask)
    want = agg_loss(tok, mask, "token-mean", d)
    (want_grad,) = torch.autograd.grad(want, logp2)
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_reference_and_fused_agree_with_weights(mode, agg):
    logp, old, engine, mask, adv = _loss_inputs(b=5, s=13, seed=3)
    out = rollout_correction(old, engine, mask, mode=mode, level="token", is_threshold=C, mis_low=LOW, mis_high=HIGH)
    assert not torch.equal(out.weights, out.mask)  # the weights do something
    kw = dict(num_tokens=None, loss_agg_mode=agg, weights=out.weights)
    ref = _loss_and_grad(dapo_policy_loss, logp, old, adv, out.mask, **kw)
    fused = _loss_and_grad(clipped_pg_loss, logp, old, adv, out.mask, **kw)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=2e-6)
    for key in ("clipfrac_high", "clipfrac_low", "approx_kl", "ratio_max"):
        torch.testing.assert_close(fused[2][key], ref[2][key], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_corrected_loss_is_the_weighted_token_mean_over_kept_tokens_for_any_split(mode, level):
    """loss = sum over kept tokens of w * l / (number of kept tokens), in float64, and the sum of the micro-batch
    losses with the global D (actor: local_loss_denominator summed) equals it: MIS-rejected tokens leave D."""
    logp, old, engine, mask, adv = _loss_inputs(b=8, s=9, seed=5)
    out = rollout_correction(old, engine, mask, mode=mode, level=level, is_threshold=C, mis_low=LOW, mis_high=HIGH)
    tok, *_ = clipped_token_loss(logp.detach(), old, adv, ClipBounds.make(0.2, 0.28, None), mask)
    kept = out.mask != 0
    want = float((tok.double() * out.weights.double())[kept].sum() / kept.sum())
    d = local_loss_denominator(out.mask[:3]) + local_loss_denominator(out.mask[3:])
    if mode == "mis":
        assert d < local_loss_denominator(mask)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        loss_func = dapo_loss_func(
            torch.zeros(mask[rows].shape, dtype=torch.int64),
            out.mask[rows],
            old[rows],
            adv[rows],
            num_tokens=d,
            is_weight=out.weights[rows],
        )
        total += float(loss_func(logp.detach()[rows])[0])
    assert total == pytest.approx(want, rel=1e-5)


def test_apply_rollout_correction_sets_mask_and_weights():
    _, old, engine, mask, adv = _loss_inputs()
    batch = ActorBatch(
        tokens=torch.zeros(mask.shape, dtype=torch.int64),
        loss_mask=mask.clone(),
        response_mask=mask.clone(),
        advantages=adv,
        old_logp=old,
        engine_logp=engine,
    )
    alg = AlgorithmConfig(rollout_correction="mis", rollout_mis_low=LOW, rollout_mis_high=HIGH)
    metrics = apply_rollout_correction(batch, alg)
    want = rollout_correction(old, engine, mask, mode="mis", mis_low=LOW, mis_high=HIGH)
    assert torch.equal(batch.loss_mask, want.mask) and torch.equal(batch.is_weight, want.weights)
    assert metrics["rollout_corr/masked_fraction"] > 0
    assert torch.equal(batch.response_mask, mask)  # entropy / length metrics keep every response token
    sub = batch.select(torch.tensor([0, 2]))
    assert torch.equal(sub.is_weight, want.weights[[0, 2]])
    batch.engine_logp = None
    with pytest.raises(ValueError, match="algorithm.rollout_correction='mis'"):
        apply_rollout_correction(batch, alg)


def test_actor_micro_batches_carry_engine_logp_and_weights():
    pytest.importorskip("megatron.core")
    from megatron_dapo.actor.micro_batches import _cut_columns

    _, old, engine, mask, adv = _loss_inputs()
    batch = ActorBatch(
        tokens=torch.ones(mask.shape, dtype=torch.int64),
        loss_mask=mask,
        response_mask=mask,
        advantages=adv,
        old_logp=old,
        engine_logp=engine,
        is_weight=mask * 0.5,
    )
    for width in (4, 15):
        cut = _cut_columns(batch.select(torch.tensor([3, 0])), width)
        n = min(width, mask.shape[1])
        assert torch.equal(cut.engine_logp[:, :n], engine[[3, 0], :n])
        assert torch.equal(cut.is_weight[:, :n], (mask * 0.5)[[3, 0], :n])
        assert cut.is_weight.shape == (2, width) and (cut.is_weight[:, n:] == 0).all()


def test_config_rules():
    with pytest.raises(ConfigError, match="algorithm.rollout_correction"):
        AlgorithmConfig(rollout_correction="is")
    with pytest.raises(ConfigError, match="algorithm.rollout_correction_level"):
        AlgorithmConfig(rollout_correction_level="geometric")
    with pytest.raises(ConfigError, match="algorithm.rollout_mis_low"):
        AlgorithmConfig(rollout_mis_low=1.5)
    with pytest.raises(ConfigError, match="rollout.compare_logprobs"):
        RunConfig(
            algorithm=AlgorithmConfig(rollout_correction="tis", overlong_penalty=False),
            rollout=RolloutConfig(compare_logprobs=False),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_reference_and_fused_agree_with_weights_on_gpu(mode, backend):
    """The compiled kernels (Triton, and the CUDA twin when csrc was built) with IS weights folded into the mask."""
    if backend == "cuda":
        from megatron_dapo.ops import _cuda_twins

        if not _cuda_twins.available():
            pytest.skip("the CUDA twins are not built (csrc/build.py)")
    logp, old, engine, mask, adv = _loss_inputs(b=7, s=300, seed=4)
    out = rollout_correction(old, engine, mask, mode=mode, level="token", is_threshold=C, mis_low=LOW, mis_high=HIGH)
    dev = [t.cuda() for t in (old, adv, out.mask, out.weights)]
    lp = logp.detach().cuda().requires_grad_()
    ref = _loss_and_grad(dapo_policy_loss, lp, dev[0], dev[1], dev[2], weights=dev[3])
    fused = _loss_and_grad(clipped_pg_loss, lp, dev[0], dev[1], dev[2], weights=dev[3], backend=backend)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=2e-6)
