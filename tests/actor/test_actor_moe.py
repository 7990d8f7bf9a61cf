"""The MoE actor (Qwen3-MoE, Qwen2-MoE) inside MegatronActor on CPU/gloo, against transformers and against itself.

One 2-process launch per model runs three layouts: DP=2 with every expert on each rank (EP=1), EP=2 (each rank holds
4 of the 8 experts; the alltoall dispatcher sends tokens between them) and PP=2. In each: the log-probs and
entropies equal transformers' (fp64), the DAPO gradient of one mini-batch (2 micro-batch sizes) equals the gradient
of transformers' model under the same loss (fp64), and one optimizer step (distributed optimizer: the experts' state
is sharded over the expert data-parallel group, the rest over DP) gives the same weights in every layout. At TP=2 the
actor refuses MoE with one line (no sequence parallel on CPU: megatron's MoE layer refuses it in training).
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_dapo.algorithms import dapo_policy_loss
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import every_tiny_checkpoint
from tests.actor._tiny_models import load_hf
from tests.actor.test_actor import EPS_HIGH
from tests.actor.test_actor import EPS_LOW
from tests.actor.test_actor import TEMPERATURE
from tests.actor.test_actor import _config
from tests.actor.test_actor import _hf_named_grads
from tests.actor.test_actor import _make_batch

LAYOUTS = ((1, 1, 1), (1, 1, 2), (1, 2, 1))
LR = _config("", 1, 1).actor.lr  # (tp, pp, ep) on 2 ranks: DP=2, EP=2 (within DP=2), PP=2


def _worker(hf_dir: str, batch, layouts=LAYOUTS) -> list[dict]:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    out = []
    for tp, pp, ep in layouts:
        groups = init_distributed(tp, pp, expert_parallel=ep)
        # The gradients are read whole from the DDP buffers: no distributed optimizer (its reduce-scatter leaves each
        # rank only its shard reduced).
        actor = MegatronActor(_config(hf_dir, tp, pp, expert_parallel=ep), groups, hf_dir=hf_dir)
        logp, ent = actor.compute_logprobs(batch)
        grads, losses = {}, {}
        for size in (4, 1):
            actor.config.trainer.micro_batch_size = size
            stats = actor._forward_backward(batch)
            grads[size], losses[size] = _hf_named_grads(actor), stats["loss"]
        # One optimizer step with the distributed optimizer (expert state sharded over the expert-DP group).
        cfg = _config(hf_dir, tp, pp, expert_parallel=ep, use_distributed_optimizer=True, grad_clip=1.0)
        actor = MegatronActor(cfg, groups, hf_dir=hf_dir)
        actor.update(batch)
        updated = {name: t.clone() for name, t in actor.export_hf_weights()}
        out.append({"layout": (tp, pp, ep), "logp": logp, "ent": ent, "grads": grads, "losses": losses,
                    "updated": updated})  # fmt: skip
    # TP=2: refused with one line (megatron's MoE layer refuses TP without sequence parallel in training).
    groups = init_distributed(2, 1)
    try:
        MegatronActor(_config(hf_dir, 2, 1), groups, hf_dir=hf_dir)
        refusal = "built"
    except ValueError as err:
        refusal = str(err)
    return out, refusal


@functools.cache
def _oracle(name: str, batch_seed: int = 0):
    """transformers in fp64 (eager experts): log-probs, entropies and the DAPO loss gradient, per-expert HF names."""
    from transformers.core_model_loading import revert_weight_conversion

    batch = _make_batch(batch_seed)
    model = load_hf(every_tiny_checkpoint()[name]).double()
    logp_all = torch.log_softmax(model(batch.tokens).logits / TEMPERATURE, dim=-1)
    logp = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    ent = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    logp[:, 1:] = logp_all[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    ent[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    logp, ent = logp * batch.response_mask, ent * batch.response_mask
    # Behaviour log-probs off the current policy, so that some ratios leave [1 - eps_low, 1 + eps_high].
    batch.old_logp = ((logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))) *
                      batch.response_mask).float()  # fmt: skip
    loss, _ = dapo_policy_loss(
        logp, batch.old_logp.double(), batch.advantages.double(), batch.loss_mask, eps_low=EPS_LOW, eps_high=EPS_HIGH
    )
    loss.backward()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return batch, logp.float(), ent.float(), float(loss), revert_weight_conversion(model, grads)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_moe_actor_matches_transformers_and_is_the_same_under_ep_and_pp(name):
    batch, ref_logp, ref_ent, ref_loss, ref_grads = _oracle(name)
    got = run_distributed(_worker, 2, str(every_tiny_checkpoint()[name]), batch, timeout_s=600)
    ranks = [results for results, _ in got]
    for _, refusal in got:
        assert refusal.startswith("actor.tensor_parallel: a mixture-of-experts actor at tensor_parallel > 1 needs")
        assert "\n" not in refusal
    first = ranks[0][0]["updated"]
    for rank, results in enumerate(ranks):
        for res in results:
            where = f"rank {rank} tp,pp,ep={res['layout']}"
            torch.testing.assert_close(res["logp"], ref_logp, rtol=0, atol=1e-4, msg=where)
            torch.testing.assert_close(res["ent"], ref_ent, rtol=0, atol=1e-4, msg=where)
            for size, grads in res["grads"].items():
                assert abs(res["losses"][size] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (where, size)
                assert set(grads) == set(ref_grads), where
                for key, ref in ref_grads.items():
                    err = float((grads[key] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
                    assert err < 1e-4, f"{where} micro_batch_size={size} {key}: rel err {err:.2e}"
            # One optimizer step: the same weights whatever the layout (and on every rank). Adam's first step is
            # lr * g / (|g| + eps) per element: where |g| is near eps, float noise in g moves it by up to ~1% of lr.
            assert set(res["updated"]) == set(first), where
            for key, value in res["updated"].items():
                torch.testing.assert_close(value, first[key], rtol=0, atol=0.02 * LR, msg=f"{where} {key}")
    moved = [float((first[k] - v).abs().max()) for k, v in _initial(name).items()]
    assert sum(m > 0.5 * LR for m in moved) > len(moved) // 2  # the step moved most tensors (not every expert is hit)


def _initial(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(every_tiny_checkpoint()[name] / "model.safetensors"))
