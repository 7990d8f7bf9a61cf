"""megatron_dapo.actor.loss: the logprob_impl registry, the hidden-state (fused LM head) loss path, and that the module
stays pure torch. The loss itself against dapo_policy_loss is in test_integration.py (same functions, re-exported)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import megatron_dapo.integration as integration
from megatron_dapo.actor import loss as actor_loss
from megatron_dapo.actor.loss import LOGPROB_IMPLS
from megatron_dapo.actor.loss import dapo_loss_func
from megatron_dapo.actor.loss import get_logprob_fn
from megatron_dapo.actor.loss import get_logprob_impl
from megatron_dapo.actor.loss import local_loss_denominator
from megatron_dapo.actor.loss import register_logprob_impl
from megatron_dapo.actor.loss import sequence_logprobs_and_entropy
from megatron_dapo.actor.loss import sequence_logprobs_from_hidden
from megatron_dapo.algorithms.losses.dapo import DAPOConfig
from megatron_dapo.config import ActorConfig
from megatron_dapo.config import ConfigError


def test_one_registry_behind_the_config_field() -> None:
    assert set(LOGPROB_IMPLS) == {"reference", "fused", "fused_cuda", "fused_linear"}
    assert [n for n, impl in LOGPROB_IMPLS.items() if impl.takes_hidden] == ["fused_linear"]
    for name in LOGPROB_IMPLS:
        assert ActorConfig(logprob_impl=name).logprob_impl == name
    with pytest.raises(ConfigError, match=r"actor.logprob_impl: must be one of \[.fused., .fused_cuda., .fused_lin"):
        ActorConfig(logprob_impl="liger")
    with pytest.raises(ValueError, match="actor.logprob_impl: unknown 'liger'"):
        get_logprob_impl("liger")
    with pytest.raises(ValueError, match="already registered"):
        register_logprob_impl("fused")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="takes hidden states"):
        get_logprob_fn("fused_linear")
    assert get_logprob_fn("reference") is LOGPROB_IMPLS["reference"].fn


def test_the_loss_kernel_follows_the_log_probs_unless_chosen() -> None:
    """actor.loss_kernel "auto" takes actor.logprob_impl's backend; the other values choose the loss's own."""
    auto = {name: actor_loss.loss_kernel(name) for name in LOGPROB_IMPLS}
    assert auto == {"reference": None, "fused": "triton", "fused_cuda": "cuda", "fused_linear": "triton"}
    assert actor_loss.loss_kernel("fused_linear", "reference") is None
    assert actor_loss.loss_kernel("reference", "triton") == "triton"
    assert actor_loss.loss_kernel("fused", "cuda") == "cuda"
    with pytest.raises(ValueError, match="actor.loss_kernel: unknown 'liger'"):
        actor_loss.loss_kernel("fused", "liger")
    assert ActorConfig(loss_kernel="reference").loss_kernel == "reference"
    with pytest.raises(
        ConfigError, match=r"actor.loss_kernel: must be one of \[.auto., .cuda., .reference., .triton.\]"
    ):
        ActorConfig(loss_kernel="liger")


def test_the_keyword_form_is_make_loss_func() -> None:
    """dapo_loss_func(...) and make_loss_func(LossBatch, LossContext) give the same loss, gradient and metrics."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (3, 7), generator=gen)
    mask = (torch.rand(3, 7, generator=gen) > 0.3).float()
    old = -torch.rand(3, 7, generator=gen) * mask
    adv, d = torch.randn(3, generator=gen), local_loss_denominator(mask)
    logits = torch.randn(3, 7, 40, generator=gen)
    outs = []
    for build in (
        lambda: dapo_loss_func(tokens, mask, old, adv, num_tokens=d, temperature=0.7, num_microbatches=2),
        lambda: actor_loss.make_loss_func(
            actor_loss.LossBatch(tokens, mask, old, adv, d), actor_loss.LossContext(temperature=0.7, num_microbatches=2)
        ),
    ):
        x = logits.clone().requires_grad_()
        loss, metrics = build()(x)
        loss.backward()
        outs.append((loss.detach(), x.grad, {k: v.detach() for k, v in metrics.items()}))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2].keys() == outs[1][2].keys() and all(torch.equal(outs[0][2][k], outs[1][2][k]) for k in outs[0][2])


def test_integration_is_a_thin_re_export() -> None:
    for name in (
        "dapo_loss_func",
        "local_loss_denominator",
        "sequence_logprobs_and_entropy",
        "sequence_logprobs_from_hidden",
        "get_logprob_fn",
        "get_logprob_impl",
        "LOSS_DENOMINATOR_UNIT",
        "LossBatch",
        "LossContext",
        "make_loss_func",
    ):
        assert getattr(integration, name) is getattr(actor_loss, name), name
        assert name in integration.__all__


def test_actor_loss_does_not_import_megatron() -> None:
    code = "import sys, megatron_dapo.actor.loss; print(any(m.split('.')[0] == 'megatron' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _problem(b: int = 3, s: int = 7, h: int = 16, v: int = 13, pad: int = 3):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, s, h, generator=gen)
    weight = 0.5 * torch.randn(v + pad, h, generator=gen)
    tokens = torch.randint(0, v, (b, s), generator=gen)
    mask = (torch.rand(b, s, generator=gen) < 0.7).float()
    mask[:, 0] = 0.0
    old = (torch.randn(b, s, generator=gen) * 0.5 - 2.0) * mask
    adv = torch.randn(b, generator=gen)
    return hidden, weight, tokens, mask, old, adv, v


def test_hidden_path_equals_full_logits_path() -> None:
    """fused_linear from hidden + weight == reference on logits = hidden @ weight.T: log-probs, entropies, the
    loss, its metrics and the gradients w.r.t. hidden and weight (padded rows get none), fp32 <= 1e-5."""
    hidden, weight, tokens, mask, old, adv, v = _problem()
    loss_cfg = DAPOConfig(eps_low=0.2, eps_high=0.28)
    denom = local_loss_denominator(mask)
    common = dict(num_tokens=denom, loss=loss_cfg, temperature=0.7, vocab_size=v, num_microbatches=2, dp_size=2)

    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_fn = get_logprob_impl("reference").fn
    ref_loss, ref_metrics = dapo_loss_func(tokens, mask, old, adv, logprob_fn=ref_fn, **common)(h_ref @ w_ref.T)
    ref_loss.backward()

    h_lin, w_lin = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lin_fn = get_logprob_impl("fused_linear").fn
    loss_func = dapo_loss_func(tokens, mask, old, adv, logprob_fn=lin_fn, output_weight=w_lin, **common)
    lin_loss, lin_metrics = loss_func(h_lin)
    lin_loss.backward()

    torch.testing.assert_close(lin_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(lin_metrics) == set(ref_metrics) and "entropy" in lin_metrics
    for key, value in ref_metrics.items():
        torch.testing.assert_close(lin_metrics[key], value, rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(h_lin.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_lin.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    assert h_ref.grad.abs().max() > 0 and torch.all(w_lin.grad[v:] == 0)

    with torch.no_grad():
        logp, ent = sequence_logprobs_from_hidden(hidden, weight, tokens, temperature=0.7, vocab_size=v)
        ref_logp, ref_ent = sequence_logprobs_and_entropy(
            hidden @ weight.T, tokens, temperature=0.7, vocab_size=v, logprob_fn=ref_fn
        )
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    assert torch.all(logp[:, 0] == 0) and logp.dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[B, S, H\]"):
        sequence_logprobs_from_hidden(hidden[..., :-1], weight, tokens)
