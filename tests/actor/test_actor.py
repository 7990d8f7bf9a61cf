"""MegatronActor on CPU/gloo with tiny random HF checkpoints, against a plain transformers + torch oracle.

Two 2-process launches (each ~15-25 s, mostly imports):
- layouts: TP=2, PP=2 (tied embeddings across stages) and DP=2 -> compute_logprobs equals the HF log-softmax; the
  DAPO gradient (gathered as full HF-named tensors) equals the oracle's for every layout and for 1 vs 4 micro-batches.
- training: DP=2 with the distributed optimizer and grad clipping -> updates lower the loss; a NaN step is skipped,
  reported and leaves the weights bit-identical; a checkpoint restores weights, optimizer and step count, also into
  another layout (TP=2).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_dapo.algorithms import dapo_policy_loss
from megatron_dapo.algorithms.losses.dapo import DAPOConfig
from megatron_dapo.batch import ActorBatch
from megatron_dapo.config import ActorConfig
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import RolloutConfig
from megatron_dapo.config import RunConfig
from megatron_dapo.config import TrainerConfig
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import VOCAB
from tests.actor._tiny_models import load_hf
from tests.actor._tiny_models import make_tiny_llama
from tests.actor._tiny_models import make_tiny_qwen2

TEMPERATURE = 0.7
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _config(hf_dir: str, tp: int, pp: int, **actor: object) -> RunConfig:
    actor_kw = dict(model_path=hf_dir, tensor_parallel=tp, pipeline_parallel=pp, dtype="fp32", lr=1e-3)
    actor_kw.update(logprob_impl="reference", lr_warmup_steps=0, grad_clip=0.0, use_distributed_optimizer=False)
    # A GPU without Transformer Engine runs these tiny models on the local spec (full attention scores are a few KB
    # here; the trainer refuses it by default for real lengths). With TE the flag changes nothing; on CPU neither.
    actor_kw.update(allow_local_spec_on_gpu=True)
    actor_kw.update(actor)
    return RunConfig(
        actor=ActorConfig(**actor_kw),
        trainer=TrainerConfig(prompts_per_step=4, gen_prompts_per_batch=4, mini_batch_prompts=4, micro_batch_size=2),
        algorithm=AlgorithmConfig(group_size=2, overlong_buffer=4),
        loss=DAPOConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH),
        rollout=RolloutConfig(engine="transformers", max_response_length=8, temperature=TEMPERATURE),
    )


def _make_batch(seed: int = 0, b: int = 8, s: int = 11) -> ActorBatch:
    """Right-padded prompt+response rows of different lengths; one response is overlong-filtered (loss_mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (b, s), generator=gen)
    response = torch.zeros(b, s)
    for i in range(b):
        start = 2 + i % 3
        end = s - (i % 4)
        response[i, start:end] = 1.0
        tokens[i, end:] = 0
    loss_mask = response.clone()
    loss_mask[3] = 0.0
    advantages = torch.randn(b, generator=gen)
    return ActorBatch(tokens=tokens, loss_mask=loss_mask, response_mask=response, advantages=advantages)


def _oracle(hf_dir: str, batch: ActorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """HF log-probs and entropies aligned with the tokens (0 at position 0 and outside the response)."""
    model = load_hf(hf_dir)
    with torch.no_grad():
        logp_all = torch.log_softmax(model(batch.tokens).logits.float() / TEMPERATURE, dim=-1)
    logp = torch.zeros(batch.tokens.shape)
    ent = torch.zeros(batch.tokens.shape)
    logp[:, 1:] = logp_all[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    ent[:, 1:] = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    return logp * batch.response_mask, ent * batch.response_mask


def _oracle_grads(hf_dir: str, batch: ActorBatch) -> dict[str, torch.Tensor]:
    """d(DAPO loss over the whole batch) / d(HF parameters), fp32."""
    model = load_hf(hf_dir)
    logp_all = torch.log_softmax(model(batch.tokens).logits.float() / TEMPERATURE, dim=-1)
    logp = torch.zeros(batch.tokens.shape)
    logp[:, 1:] = logp_all[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    loss, _ = dapo_policy_loss(
        logp, batch.old_logp, batch.advantages, batch.loss_mask, eps_low=EPS_LOW, eps_high=EPS_HIGH
    )
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_named_grads(actor) -> dict[str, torch.Tensor]:
    """The DP-reduced gradients in the DDP buffers, exported as full HF-named tensors (weights restored after)."""
    params = [p for chunk in actor.model for p in chunk.parameters()]
    saved = [p.data.clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.data.copy_(p.main_grad)
        # GLM-4.5's router bias is a buffer (its value is exported, it has no gradient)
        exported = actor.export_hf_weights()
        grads = {n: t.float().clone() for n, t in exported if not n.endswith("e_score_correction_bias")}
        for p, s in zip(params, saved):
            p.data.copy_(s)
    return grads


def _layouts_worker(hf_dir: str, batch: ActorBatch) -> list[dict]:
    """Per layout: compute_logprobs and the DAPO gradient for several micro-batch sizes."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.loss import get_logprob_impl

    out = []
    # (tp, pp, micro-batch sizes); B=8: TP=2 and PP=2 get 8 rows (1 or 4 micro-batches), DP=2 gets 4 per rank.
    for tp, pp, sizes in ((2, 1, (8, 2)), (1, 2, (2,)), (1, 1, (4, 1))):
        groups = init_distributed(tp, pp)
        actor = MegatronActor(_config(hf_dir, tp, pp), groups, hf_dir=hf_dir)
        logp, ent = actor.compute_logprobs(batch)
        no_ent = actor.compute_logprobs(batch, with_entropy=False)
        grads, losses = {}, {}
        for size in sizes:
            actor.config.trainer.micro_batch_size = size
            stats = actor._forward_backward(batch)
            grads[size], losses[size] = _hf_named_grads(actor), stats["loss"]
        res = dict(layout=(tp, pp), logp=logp, ent=ent, no_ent=no_ent, grads=grads, losses=losses)
        if tp == 2:  # the default op (Triton interpreter here: slow, so two rows only) under vocab-parallel TP
            actor.logprob_impl = get_logprob_impl("fused")
            res["fused"] = actor.compute_logprobs(batch.select(slice(0, 2)))
        out.append(res)
    return out


@pytest.fixture(scope="module")
def tiny_dirs() -> dict[str, str]:
    root = Path(tempfile.mkdtemp(prefix="tiny_hf_"))
    return {"llama": str(make_tiny_llama(root / "llama")), "qwen2": str(make_tiny_qwen2(root / "qwen2"))}


def test_logprobs_and_gradients_match_hf_across_layouts(tiny_dirs: dict[str, str]) -> None:
    hf_dir = tiny_dirs["llama"]  # tied embeddings: PP=2 exercises the embedding-group gradient all-reduce
    batch = _make_batch()
    ref_logp, ref_ent = _oracle(hf_dir, batch)
    # Behaviour log-probs off the current policy, so that some ratios leave [1 - eps_low, 1 + eps_high].
    batch.old_logp = (ref_logp + 0.3 * torch.randn(ref_logp.shape)) * batch.response_mask
    ref_grads = _oracle_grads(hf_dir, batch)
    ref_loss, _ = dapo_policy_loss(
        ref_logp, batch.old_logp, batch.advantages, batch.loss_mask, eps_low=EPS_LOW, eps_high=EPS_HIGH
    )
    ranks = run_distributed(_layouts_worker, 2, hf_dir, batch)
    for rank_results in ranks:
        for res in rank_results:
            where = f"layout tp,pp={res['layout']}"
            torch.testing.assert_close(res["logp"], ref_logp, rtol=0, atol=1e-4, msg=where)
            torch.testing.assert_close(res["ent"], ref_ent, rtol=0, atol=1e-4, msg=where)
            assert res["no_ent"][1] is None and torch.equal(res["no_ent"][0], res["logp"])
            for size, grads in res["grads"].items():
                assert math.isclose(res["losses"][size], float(ref_loss), rel_tol=1e-5, abs_tol=1e-6), (where, size)
                assert set(grads) == set(ref_grads), where
                for name, ref in ref_grads.items():
                    err = (grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
                    assert err < 2e-5, f"{where} micro_batch_size={size} {name}: rel err {err:.2e}"
    # Every rank returns the same values; the fused op agrees with the reference path.
    assert torch.equal(ranks[0][0]["logp"], ranks[1][0]["logp"])
    fused_logp, fused_ent = ranks[0][0]["fused"]
    torch.testing.assert_close(fused_logp, ref_logp[:2], rtol=0, atol=1e-4)
    torch.testing.assert_close(fused_ent, ref_ent[:2], rtol=0, atol=1e-4)


def _snapshot(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in actor.model for p in chunk.parameters()]


def _training_worker(hf_dir: str, batch: ActorBatch, ckpt_dir: str) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    groups = init_distributed(1, 1)  # DP=2
    cfg = _config(hf_dir, 1, 1, use_distributed_optimizer=True, grad_clip=1.0, lr_warmup_steps=2, lr=2e-3)
    actor = MegatronActor(cfg, groups, hf_dir=hf_dir)
    batch.old_logp, _ = actor.compute_logprobs(batch, with_entropy=False)
    res: dict = {"lr": [], "loss": []}
    # The trainer's path: only this DP rank's rows of the plan go in, the same log-probs come out.
    plan = actor.row_plan(batch)
    mine = torch.tensor(plan.rows_of(groups.dp_rank))
    local_logp, _ = actor.compute_logprobs(batch.select(mine), plan=plan, with_entropy=False)
    res["local_rows"] = plan.rows_of(groups.dp_rank)
    res["local_logp_equal"] = torch.equal(local_logp, batch.old_logp[mine])
    for _ in range(4):
        metrics = actor.update(batch)
        res["lr"].append(metrics["actor/lr"])
        res["loss"].append(metrics["actor/loss"])
    res["metrics"] = metrics
    # A NaN old log-prob on one valid token: the step is skipped, reported, and changes nothing.
    bad = ActorBatch(**{k: (v.clone() if v is not None else None) for k, v in vars(batch).items()})
    bad.old_logp[5, 6] = float("nan")
    before, steps = _snapshot(actor), actor.steps.num_steps
    res["nan_metrics"] = actor.update(bad)
    res["nan_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(actor)))
    res["nan_steps"] = actor.steps.num_steps - steps
    # Checkpoint: save, update, load, update again -> the same weights (optimizer state and step count restored).
    logp_at_save, _ = actor.compute_logprobs(batch)
    actor.save_checkpoint(ckpt_dir)
    actor.update(batch)
    after_first = _snapshot(actor)
    actor.load_checkpoint(ckpt_dir)
    res["steps_after_load"] = actor.steps.num_steps
    actor.update(batch.select(mine), plan=plan)  # this DP rank's rows only: the same step as the full batch
    res["resume_identical"] = all(torch.equal(a, b) for a, b in zip(after_first, _snapshot(actor)))
    # The same checkpoint's weights into another layout (TP=2, DP=1), without HF weights: same log-probs.
    groups = init_distributed(2, 1)
    other = MegatronActor(_config(hf_dir, 2, 1, use_distributed_optimizer=True, grad_clip=1.0), groups)
    other.load_checkpoint(ckpt_dir, load_optimizer=False)
    res["reshard_logp_err"] = float((other.compute_logprobs(batch)[0] - logp_at_save).abs().max())
    res["reshard_steps"] = other.steps.num_steps
    return res


def test_update_lowers_loss_skips_nan_and_checkpoints(tiny_dirs: dict[str, str], tmp_path: Path) -> None:
    batch = _make_batch(seed=1)
    ranks = run_distributed(_training_worker, 2, tiny_dirs["qwen2"], batch, str(tmp_path / "ckpt"))
    r0 = ranks[0]
    assert r0["loss"] == ranks[1]["loss"], "metrics must be identical on every rank"
    assert r0["lr"] == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3]), "linear warm-up over 2 steps, then constant"
    assert r0["loss"][-1] < r0["loss"][0] - 1e-3, r0["loss"]
    m = r0["metrics"]
    for key in ("actor/grad_norm", "actor/clipfrac_high", "actor/clipfrac_low", "actor/approx_kl", "actor/entropy"):
        assert math.isfinite(m[key]), key
    assert m["actor/ratio_max"] > 1.0 and m["actor/skipped_steps"] == 0.0 and m["actor/num_updates"] == 1.0
    assert r0["nan_metrics"]["actor/skipped_steps"] == 1.0 and r0["nan_steps"] == 0
    assert r0["nan_unchanged"] and ranks[1]["nan_unchanged"]
    assert r0["steps_after_load"] == 4 and r0["reshard_steps"] == 4
    assert r0["resume_identical"] and ranks[1]["resume_identical"]
    assert r0["local_logp_equal"] and ranks[1]["local_logp_equal"]
    assert sorted(r0["local_rows"] + ranks[1]["local_rows"]) == list(range(len(batch)))
    assert r0["reshard_logp_err"] < 1e-5
