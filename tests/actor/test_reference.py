"""The frozen reference model of GRPO's KL term (actor/reference.py), TP=2 on CPU/gloo, against HF transformers and
against the KL's own algebra: the reference's log-probs equal the actor's before any update, bit for bit, and HF's
(fp64-free oracle nobody here wrote); its weights never move; the k3 term is exactly 0 with zero gradient at the
reference (step 1 trains the same weights with or without it) and pulls the policy once it has moved (step 2 differs);
the reference has no gradients, no DDP gradient buffers, no optimizer and refuses to update; offloaded with the
actor's parameters (WithReference) it comes back bit for bit.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_dapo.algorithms.losses.grpo import GRPOConfig
from megatron_dapo.config import AlgorithmConfig
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import make_tiny_qwen2
from tests.actor.test_actor import _config
from tests.actor.test_actor import _make_batch
from tests.actor.test_actor import _oracle

KL_COEF = 0.5


def _grpo(hf_dir: str, kl_coef: float):
    base = _config(hf_dir, 2, 1)
    algorithm = AlgorithmConfig(group_size=2, overlong_buffer=4, policy_loss="grpo")
    return dataclasses.replace(base, algorithm=algorithm, loss=GRPOConfig(kl_coef=kl_coef))


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in model for p in chunk.parameters()]


def _worker(hf_dir: str) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.reference import WithReference
    from megatron_dapo.actor.reference import reference_model

    groups = init_distributed(2, 1)
    out: dict = {}
    runs = {}
    for kl in (0.0, KL_COEF):
        cfg = _grpo(hf_dir, kl)
        actor = MegatronActor(cfg, groups, hf_dir=hf_dir)
        reference = reference_model(cfg, groups)
        ref_before = _params(reference.model)
        metrics, weights = [], []
        for step in range(2):
            batch = _make_batch(seed=3)
            batch.old_logp, _ = actor.compute_logprobs(batch, with_entropy=False)
            batch.ref_logp, _ = reference.compute_logprobs(batch, with_entropy=False)
            if step == 0:
                out["first_equal"] = torch.equal(batch.old_logp, batch.ref_logp)
                out["ref_logp"] = batch.ref_logp
            metrics.append(actor.update(batch))
            weights.append(_params(actor.model))
        runs[kl] = (metrics, weights)
        out[f"ref_unchanged_{kl}"] = all(torch.equal(a, b) for a, b in zip(ref_before, _params(reference.model)))
        if kl:  # actor.offload moves the reference with the actor's parameters, and back bit for bit
            both = WithReference(actor, reference)
            moved = both.offload_state(("params",))
            out["offloaded_bytes"] = (moved, actor.offloader.offloaded, reference.offloader.offloaded)
            both.reload_state(None)
            out["reloaded"] = all(torch.equal(a, b) for a, b in zip(ref_before, _params(reference.model)))
            out["ref_logp_after_reload"] = reference.compute_logprobs(_make_batch(seed=3), with_entropy=False)[0]
        out["ref_grads"] = any(p.grad is not None for p in reference.model[0].parameters())
        out["ref_ddp"] = type(reference.model[0]).__name__ == "DistributedDataParallel"
        out["ref_optimizer"] = reference.optimizer
        out["ref_param_bytes"] = sum(p.numel() * p.element_size() for p in reference.model[0].parameters())
        out["actor_param_bytes"] = sum(p.numel() * p.element_size() for p in actor.model[0].module.parameters())
        try:
            reference.update(batch)
            out["ref_update"] = "ran"
        except RuntimeError as err:
            out["ref_update"] = str(err)
    (m0, w0), (m1, w1) = runs[0.0], runs[KL_COEF]
    out["kl_metrics"] = [m["actor/ref_kl"] for m in m1]
    out["no_kl_metric_without_kl"] = all("actor/ref_kl" not in m for m in m0)
    out["step1_same"] = all(torch.equal(a, b) for a, b in zip(w0[0], w1[0]))
    out["step2_differs"] = any(not torch.equal(a, b) for a, b in zip(w0[1], w1[1]))
    return out


@pytest.fixture(scope="module")
def tiny_qwen2() -> str:
    return str(make_tiny_qwen2(Path(tempfile.mkdtemp(prefix="tiny_hf_")) / "qwen2"))


def test_reference_model_and_grpo_kl_term_at_tp2(tiny_qwen2: str) -> None:
    ranks = run_distributed(_worker, 2, tiny_qwen2)
    expected, _ = _oracle(tiny_qwen2, _make_batch(seed=3))
    for r in ranks:
        assert r["first_equal"], "reference and actor log-probs differ before any update"
        torch.testing.assert_close(r["ref_logp"], expected, rtol=1e-4, atol=1e-4)
        assert r[f"ref_unchanged_{0.0}"] and r[f"ref_unchanged_{KL_COEF}"]
        assert not r["ref_grads"] and not r["ref_ddp"] and r["ref_optimizer"] is None
        assert r["ref_param_bytes"] == r["actor_param_bytes"] > 0
        assert "frozen" in r["ref_update"]
        first, second = r["kl_metrics"]
        assert first == 0.0 and second > 0.0, r["kl_metrics"]
        assert r["no_kl_metric_without_kl"]
        assert r["step1_same"], "k3 at the reference must add exactly zero gradient"
        assert r["step2_differs"], "the KL term did not change the second update"
        moved, actor_away, ref_away = r["offloaded_bytes"]
        assert moved == 2 * r["ref_param_bytes"] and "params" in actor_away and "params" in ref_away
        assert r["reloaded"] and torch.equal(r["ref_logp_after_reload"], r["ref_logp"])
