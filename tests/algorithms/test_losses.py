"""The policy-loss family (algorithms/losses/): each loss against a float64 implementation written here from its
paper (and, for GSPO, verl's token-level spelling of it), with its reference and fused (Triton interpreter) paths,
rollout-correction weights, split invariance and the config refusals."""

import dataclasses

import pytest
import torch

from megatron_dapo.algorithms import POLICY_LOSSES
from megatron_dapo.algorithms import LossInputs
from megatron_dapo.algorithms import get_policy_loss
from megatron_dapo.algorithms import group_normalized_advantages
from megatron_dapo.algorithms.losses.cispo import CISPOConfig
from megatron_dapo.algorithms.losses.dapo import DAPOConfig
from megatron_dapo.algorithms.losses.dr_grpo import DrGRPOConfig
from megatron_dapo.algorithms.losses.grpo import GRPOConfig
from megatron_dapo.algorithms.losses.gspo import GSPOConfig
from megatron_dapo.config import ConfigError
from megatron_dapo.config import RunConfig
from megatron_dapo.config import load_config

LOSSES = ("dapo", "grpo", "dr_grpo", "gspo", "cispo")
RTOL, ATOL = 1e-5, 1e-6


def _problem(seed: int, b: int = 6, t: int = 9, spread: float = 0.3, seq_spread: float = 0.0):
    """logp, old_logp [b, t] fp32 with both clipped and unclipped tokens, advantages [b] of both signs, a mask with
    padding (row lengths 1..t) and one empty row. seq_spread adds a per-row offset to logp (GSPO's sequence ratio
    then leaves its 3e-4 band for some rows and stays inside for others)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 3 - 0.05
    noise = (torch.rand(b, t, generator=gen) - 0.5) * 2 * spread
    offset = (torch.rand(b, 1, generator=gen) - 0.5) * 2 * seq_spread
    logp = (old + noise + offset).clamp(max=-1e-3)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[1] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    adv = torch.randn(b, generator=gen)
    return logp, old, adv, mask


def _fp64_oracle(name: str, cfg, logp, old, adv, mask, weights=None):
    """(loss, d loss / d logp) in float64, written from each paper's objective (not from policy_loss.py)."""
    lp = logp.detach().double().requires_grad_(True)
    o, a, m = old.double(), adv.double()[:, None], mask.double()
    w = torch.ones_like(m) if weights is None else weights.double()
    n_tok = m.sum(-1)
    has = (n_tok > 0).double()
    n_seq = has.sum().clamp_min(1)
    if name == "gspo" and weights is None:
        # The sequence-level objective itself: s_i = (pi / pi_old)^(1/|y_i|), loss = mean_i max(-A s, -A clip(s)).
        s = torch.exp(((lp - o) * m).sum(-1) / n_tok.clamp_min(1))[:, None]
        per_seq = torch.maximum(-a * s, -a * s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))[:, 0]
        loss = (per_seq * has).sum() / n_seq
    elif name == "gspo":
        # Per-token weights need GSPO-token (the paper's eq. 13): s_it = sg(s_i) pi_t / sg(pi_t), each token's term
        # weighted by its own w_t, token mean per response.
        seq = (((lp - o) * m).sum(-1) / n_tok.clamp_min(1)).detach()[:, None]
        s = torch.exp(lp - lp.detach() + seq)
        tok = torch.maximum(-a * s, -a * s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)) * w * m
        loss = ((tok.sum(-1) / n_tok.clamp_min(1)) * has).sum() / n_seq
    elif name == "cispo":
        r = torch.exp(lp - o).detach()
        lo = 0.0 if cfg.eps_low_is is None else 1 - cfg.eps_low_is
        tok = -r.clamp(lo, 1 + cfg.eps_high_is) * a * lp * w * m
        loss = tok.sum() / m.sum().clamp_min(1)
    else:
        eps_low, eps_high = (cfg.eps_low, cfg.effective_eps_high) if name == "dapo" else (cfg.eps, cfg.eps)
        r = torch.exp(lp - o)
        tok = torch.maximum(-a * r, -a * r.clamp(1 - eps_low, 1 + eps_high)) * w * m
        if name == "dapo":
            loss = tok.sum() / m.sum().clamp_min(1)
        elif name == "grpo":
            loss = ((tok.sum(-1) / n_tok.clamp_min(1)) * has).sum() / n_seq
        else:  # dr_grpo: token sums over a constant, averaged over responses
            loss = ((tok.sum(-1) / cfg.norm_length) * has).sum() / n_seq
    loss.backward()
    return loss.detach(), lp.grad


def _config(name: str):
    cfg = get_policy_loss(name).make_config()
    return dataclasses.replace(cfg, norm_length=64) if name == "dr_grpo" else cfg


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_and_gradient_equal_the_fp64_objective(name, seed, fused):
    spread, seq_spread = (2e-4, 1e-3) if name == "gspo" else (0.3, 0.0)
    logp, old, adv, mask = _problem(seed, spread=spread, seq_spread=seq_spread)
    cfg = _config(name)
    x = logp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss(name)(LossInputs(x, old, adv, mask), cfg, fused)
    loss.backward()
    want, want_grad = _fp64_oracle(name, cfg, logp, old, adv, mask)
    torch.testing.assert_close(loss.double(), want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    assert set(metrics) == {"clipfrac_high", "clipfrac_low", "approx_kl", "ratio_max"}
    valid = mask != 0
    kl = float(((old - logp) * valid).sum() / valid.sum())
    assert float(metrics["approx_kl"]) == pytest.approx(kl, rel=1e-4, abs=1e-7)


def test_the_problems_exercise_both_branches():
    """The oracle test means something: each loss has clipped and unclipped tokens on these inputs."""
    for name in LOSSES:
        spread, seq_spread = (2e-4, 1e-3) if name == "gspo" else (0.3, 0.0)
        logp, old, adv, mask = _problem(0, spread=spread, seq_spread=seq_spread)
        _, metrics = get_policy_loss(name)(LossInputs(logp, old, adv, mask), _config(name), False)
        clipped = float(metrics["clipfrac_high"] + metrics["clipfrac_low"])
        assert 0.0 < clipped < 1.0, (name, clipped)


def test_gspo_equals_verls_token_level_spelling():
    """verl's compute_policy_loss_gspo (read, not copied): log s_it = logp - sg(logp) + sg(seq mean), ratio clipped
    per token then seq-mean-token-mean. Same loss and gradient as ours within its log-ratio clamp."""
    logp, old, adv, mask = _problem(3, spread=2e-4, seq_spread=1e-3)
    cfg = GSPOConfig()
    x = logp.double().requires_grad_(True)
    o, a, m = old.double(), adv.double()[:, None], mask.double()
    seq = ((x - o) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    s = torch.exp((x - x.detach() + seq.detach()).clamp(max=10.0))
    tok = torch.maximum(-a * s, -a * s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
    has = m.sum(-1) > 0
    want = ((tok * m).sum(-1)[has] / m.sum(-1)[has]).mean()
    want.backward()
    y = logp.clone().requires_grad_(True)
    loss, _ = get_policy_loss("gspo")(LossInputs(y, old, adv, mask), cfg, False)
    loss.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad.double(), x.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", LOSSES)
def test_rollout_correction_weights_multiply_each_tokens_loss(name):
    spread, seq_spread = (2e-4, 1e-3) if name == "gspo" else (0.3, 0.0)
    logp, old, adv, mask = _problem(4, spread=spread, seq_spread=seq_spread)
    weights = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(9))
    cfg = _config(name)
    want, want_grad = _fp64_oracle(name, cfg, logp, old, adv, mask, weights)
    for fused in (False, True):
        x = logp.clone().requires_grad_(True)
        loss, _ = get_policy_loss(name)(LossInputs(x, old, adv, mask, weights=weights), cfg, fused)
        loss.backward()
        torch.testing.assert_close(loss.double(), want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(x.grad.double(), want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_micro_batch_split_with_the_global_denominator_is_the_whole_batch(name):
    """Each micro-batch's loss with D of the whole batch (tokens or sequences, by the loss's aggregation) sums to
    the whole batch's loss; the same for the gradient."""
    from megatron_dapo.actor.loss import local_loss_denominator

    spread, seq_spread = (2e-4, 1e-3) if name == "gspo" else (0.3, 0.0)
    logp, old, adv, mask = _problem(5, b=8, spread=spread, seq_spread=seq_spread)
    cfg = _config(name)
    fn = get_policy_loss(name)
    x = logp.clone().requires_grad_(True)
    whole, _ = fn(LossInputs(x, old, adv, mask), cfg, False)
    whole.backward()
    d = local_loss_denominator(mask, cfg.loss_agg_mode)
    y = logp.clone().requires_grad_(True)
    total = sum(
        fn(LossInputs(y[rows], old[rows], adv[rows], mask[rows], num_tokens=d), cfg, False)[0]
        for rows in (slice(0, 3), slice(3, 5), slice(5, 8))
    )
    total.backward()
    torch.testing.assert_close(total, whole, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad, x.grad, rtol=RTOL, atol=1e-7)


def test_dr_grpo_advantages_are_not_std_normalised():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    adv = group_normalized_advantages(rewards, 4, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, -1.5, 0.5]))
    assert RunConfig(algorithm=RunConfig().algorithm).loss.std_normalize
    assert not load_config(None, ["--algorithm.policy_loss=dr_grpo"]).loss.std_normalize


def test_config_section_is_the_selected_losses_own():
    c = load_config(
        None, ["--algorithm.policy_loss=dr_grpo", "--rollout.max_response_length=96", "--algorithm.overlong_buffer=32"]
    )
    assert c.loss == DrGRPOConfig(norm_length=96)  # 0 resolves to the generation cap
    c = load_config(None, ["--algorithm.policy_loss=gspo"])
    assert (c.loss.eps_low, c.loss.eps_high, c.loss.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert load_config(None, ["--algorithm.policy_loss=grpo"]).loss == GRPOConfig()
    assert load_config(None, ["--algorithm.policy_loss=cispo", "--loss.eps_high_is=2"]).loss.eps_high_is == 2.0
    assert RunConfig().loss == DAPOConfig()
    with pytest.raises(ConfigError, match=r"loss: is a DAPOConfig, but algorithm.policy_loss 'cispo' takes"):
        RunConfig(algorithm=load_config(None, ["--algorithm.policy_loss=cispo"]).algorithm, loss=DAPOConfig())
    assert sorted(POLICY_LOSSES) == sorted(LOSSES)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--algorithm.policy_loss=gspo", "--loss.loss_agg_mode=token-mean"], "unknown key 'loss_agg_mode'"),
        (["--algorithm.policy_loss=gspo", "--loss.clip_ratio_c=3"], "unknown key 'clip_ratio_c'"),
        (["--algorithm.policy_loss=cispo", "--loss.clip_ratio_c=3"], "unknown key 'clip_ratio_c'"),
        (["--algorithm.policy_loss=cispo", "--loss.loss_agg_mode=seq-mean-token-sum-norm"], "loss.loss_agg_mode"),
        (["--algorithm.policy_loss=dr_grpo", "--loss.loss_agg_mode=token-mean"], "unknown key 'loss_agg_mode'"),
        (["--algorithm.policy_loss=grpo", "--loss.kl_coef=11"], "loss.kl_coef: must be in [0, 10]"),
        (["--algorithm.policy_loss=grpo", "--loss.kl_coef=-0.1"], "loss.kl_coef: must be in [0, 10]"),
        (["--algorithm.policy_loss=dapo", "--loss.kl_coef=0.1"], "unknown key 'kl_coef'"),
        (["--algorithm.policy_loss=grpo", "--loss.eps=1.5"], "loss.eps: must be in (0, 1)"),
        (["--algorithm.policy_loss=gspo", "--loss.eps_high=nan"], "loss.eps_high: must be a finite number"),
        (["--algorithm.policy_loss=cispo", "--loss.eps_low_is=1"], "loss.eps_low_is: must be in (0, 1) or null"),
        (["--algorithm.policy_loss=ppo"], "algorithm.policy_loss"),
    ],
)
def test_unsupported_combinations_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cispo_keeps_the_gradient_of_tokens_the_clip_would_drop():
    """A token far above 1 + eps with A > 0: DAPO's gradient is 0 there, CISPO's is -(1 + eps_high_is) A / N."""
    logp = torch.tensor([[-0.1, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.0]])  # ratio e ~ 2.72 on the first token, 1 on the second
    adv, mask = torch.tensor([2.0]), torch.ones(1, 2)
    for name, first in (("dapo", 0.0), ("cispo", -(1 + CISPOConfig().eps_high_is) * 2.0 / 2)):
        x = logp.detach().clone().requires_grad_(True)
        loss, metrics = get_policy_loss(name)(LossInputs(x, old, adv, mask), _config(name), False)
        loss.backward()
        assert float(x.grad[0, 0]) == pytest.approx(first, abs=1e-6), name
        assert float(metrics["clipfrac_high"]) == 0.5


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_kl_term_equals_the_fp64_objective(seed, fused):
    """GRPO with kl_coef: the clipped surrogate plus beta * the k3 estimate of KL(pi || pi_ref), each response's token
    mean averaged over responses (DeepSeekMath eq. 3-4), in float64 with its gradient."""
    logp, old, adv, mask = _problem(seed)
    ref = old + 0.4 * (torch.rand(old.shape, generator=torch.Generator().manual_seed(seed + 50)) - 0.5)
    cfg = dataclasses.replace(_config("grpo"), kl_coef=0.3)
    x = logp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("grpo")(LossInputs(x, old, adv, mask, ref_logp=ref), cfg, fused)
    loss.backward()
    pg, pg_grad = _fp64_oracle("grpo", cfg, logp, old, adv, mask)
    lp = logp.detach().double().requires_grad_(True)
    m = mask.double()
    n_tok, has = m.sum(-1), (m.sum(-1) > 0).double()
    k3 = (ref.double() - lp).exp() - (ref.double() - lp) - 1  # pi_ref / pi - log(pi_ref / pi) - 1
    kl = (((k3 * m).sum(-1) / n_tok.clamp_min(1)) * has).sum() / has.sum()
    kl.backward()
    torch.testing.assert_close(loss.double(), pg + 0.3 * kl.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad.double(), pg_grad + 0.3 * lp.grad, rtol=1e-4, atol=1e-6)
    token_mean = float((k3.detach() * m).sum() / m.sum())
    assert float(metrics["ref_kl"]) == pytest.approx(token_mean, rel=1e-5)


def test_k3_matches_trl_and_verl_spellings():
    """TRL's GRPOTrainer (per_token_kl = exp(ref - logp) - (ref - logp) - 1) and verl's "low_var_kl" (kl = ref - logp,
    exp(kl) - kl - 1, clamped to [-10, 10]) read from their sources and written here: equal to kl_k3 where verl's
    clamp is inactive; >= 0 everywhere, 0 exactly at the reference."""
    from megatron_dapo.algorithms.policy_loss import kl_k3

    gen = torch.Generator().manual_seed(7)
    logp, ref = -torch.rand(4, 33, generator=gen) * 4, -torch.rand(4, 33, generator=gen) * 4
    trl = torch.exp(ref - logp) - (ref - logp) - 1
    d = ref - logp
    verl = (torch.exp(d) - d - 1).clamp(-10, 10)
    ours = kl_k3(logp, ref)
    torch.testing.assert_close(ours, trl, rtol=0, atol=0)
    inside = trl < 10
    torch.testing.assert_close(ours[inside], verl[inside], rtol=0, atol=0)
    assert bool((ours >= 0).all()) and bool((kl_k3(logp, logp) == 0).all())


def test_a_kl_loss_without_reference_logprobs_is_refused():
    logp, old, adv, mask = _problem(0)
    cfg = dataclasses.replace(_config("grpo"), kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logp"):
        get_policy_loss("grpo")(LossInputs(logp, old, adv, mask), cfg, False)
