"""The actor's whole new forward path against today's padded reference path, inside MegatronActor on CPU/gloo.

New path: packed rows (THD, cu_seqlens, the varlen attention submodule), token-budget micro-batches balanced over
DP by tokens, the fused LM-head op (actor.logprob_impl="fused_linear") and the fused clipped loss
(ops.clipped_pg_loss; Triton interpreter here, TRITON_INTERPRET=1 from tests/conftest.py). Reference path: rows
padded to the batch's width, fixed micro-batch rows, full logits, pure-torch log-probs and dapo_policy_loss.

One 2-process launch checks TP=2, PP=2 and DP=2 for the tied (llama: under PP=2 the output weight is the last
stage's copy of the embedding) and untied (qwen2) tiny models, on one mini-batch whose responses go from 1 token to
more than 10x the mean, under several token budgets. Compared, fp32: per-token log-probs and entropies, the loss and
entropy metrics, and every gradient after the DP all-reduce (<= 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.actor._dist import run_distributed
from tests.actor._tiny_models import VOCAB
from tests.actor._tiny_models import tiny_checkpoints
from tests.actor.test_actor import _config
from tests.actor.test_actor import _hf_named_grads

LAYOUTS = ((2, 1), (1, 2), (1, 1))  # on 2 ranks: TP=2, PP=2, DP=2
BUDGETS = (0, 24)  # 0: trainer.micro_batch_size (4) rows per micro-batch; 24 tokens: the 50-token row alone


def _budgets(layout: tuple[int, int]) -> tuple[int, ...]:
    """Every budget under DP=2 (where token balancing over ranks happens); the token budget alone under TP and PP,
    whose packed path does not depend on how rows are grouped (saves a quarter of this test's interpreter time)."""
    return BUDGETS if layout == (1, 1) else BUDGETS[1:]


def _skewed_batch(seed: int = 3) -> "ActorBatch":  # noqa: F821, UP037
    """16 rows: prompts of 2-4 tokens, responses of 1-3 tokens except one of 48 (> 10x the mean of 5.2); two hold
    observation tokens (a multi-turn trajectory's tool output: response_mask 0 between model tokens)."""
    from megatron_dapo.batch import ActorBatch

    gen = torch.Generator().manual_seed(seed)
    resp_lens = [1, 2, 3, 1, 2, 1, 3, 48, 2, 1, 3, 2, 1, 1, 2, 3]
    prompts = [2 + i % 3 for i in range(len(resp_lens))]
    s = max(p + r for p, r in zip(prompts, resp_lens, strict=True)) + 2
    tokens = torch.randint(1, VOCAB, (len(resp_lens), s), generator=gen)
    response = torch.zeros(len(resp_lens), s)
    for i, (p, r) in enumerate(zip(prompts, resp_lens, strict=True)):
        response[i, p : p + r] = 1.0
        tokens[i, p + r :] = 0
    # Multi-turn trajectories: observation tokens inside a response are not the model's (response_mask 0 there).
    response[7, prompts[7] + 10 : prompts[7] + 14] = 0.0
    response[6, prompts[6] + 1] = 0.0
    loss_mask = response.clone()
    loss_mask[5] = 0.0  # an overlong-filtered response: in the batch, out of the loss
    advantages = torch.randn(len(resp_lens), generator=gen)
    return ActorBatch(tokens=tokens, loss_mask=loss_mask, response_mask=response, advantages=advantages)


def _pass(actor, batch) -> dict:
    from megatron_dapo.ops import pg_loss

    calls = []
    apply = pg_loss.FusedSurrogateFunction.apply
    pg_loss.FusedSurrogateFunction.apply = lambda *args: calls.append(1) or apply(*args)
    try:
        logp, ent = actor.compute_logprobs(batch)
        stats = actor._forward_backward(batch)
    finally:
        pg_loss.FusedSurrogateFunction.apply = apply
    return {
        "fused_loss_calls": len(calls),
        "logp": logp,
        "ent": ent,
        "loss": stats["loss"],
        "entropy": stats["entropy"],
        "clipfrac": stats["clipfrac_high"] + stats["clipfrac_low"],
        "grads": _hf_named_grads(actor),
        "tokens": actor.pop_token_stats(),
    }


def _worker(ckpts: dict[str, str], batch, layouts=LAYOUTS) -> list[dict]:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.loss import get_logprob_impl

    out = []
    for tp, pp in layouts:
        groups = init_distributed(tp, pp)
        for name, hf_dir in ckpts.items():
            actor = MegatronActor(_config(hf_dir, tp, pp, packing=False), groups, hf_dir=hf_dir)
            actor.config.trainer.micro_batch_size = 4
            logp, _ = actor.compute_logprobs(batch, with_entropy=False)
            noise = 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
            batch.old_logp = (logp + noise) * batch.response_mask  # off-policy enough that some ratios clip
            actor.pop_token_stats()
            gpt = actor.unwrapped()
            res = {"layout": (tp, pp), "model": name, "tied": gpt.share_embeddings_and_output_weights}
            res["attention"] = type(gpt.decoder.layers[0].self_attention.core_attention).__name__
            res["reference"] = _pass(actor, batch)
            actor.config.actor.packing = True
            actor.logprob_impl = get_logprob_impl("fused_linear")
            for budget in _budgets((tp, pp)):
                actor.config.actor.max_tokens_per_microbatch = budget
                res[f"packed/{budget}"] = _pass(actor, batch)
            out.append(res)
    return out


def check_parity(ranks: list[list[dict]], batch, layouts, atol: float = 1e-5) -> None:
    """Every packed / token-budget / fused pass equals the padded reference pass of the same rank and layout."""
    seen = set()
    real = int(sum(int(r.nonzero().max()) + 1 for r in batch.response_mask))
    for rank, results in enumerate(ranks):
        for res in results:
            ref = res["reference"]
            assert ref["logp"].abs().sum() > 0 and ref["clipfrac"] > 0
            assert ref["fused_loss_calls"] == 0
            for budget in _budgets(res["layout"]):
                where = f"rank {rank} tp,pp={res['layout']} model={res['model']} budget={budget} {res['attention']}"
                new = res[f"packed/{budget}"]
                torch.testing.assert_close(new["logp"], ref["logp"], rtol=0, atol=atol, msg=where)
                torch.testing.assert_close(new["ent"], ref["ent"], rtol=0, atol=atol, msg=where)
                assert math.isclose(new["loss"], ref["loss"], rel_tol=atol, abs_tol=atol / 10), (where, new, ref)
                assert math.isclose(new["entropy"], ref["entropy"], rel_tol=atol, abs_tol=atol / 10), where
                assert set(new["grads"]) == set(ref["grads"]), where
                for key, g_ref in ref["grads"].items():
                    scale = g_ref.abs().max().clamp_min(1e-12)
                    err = float((new["grads"][key] - g_ref).abs().max() / scale)
                    assert err <= atol, f"{where} {key}: rel err {err:.2e}"
                # The loss ran through the fused kernel on every rank that computes it (the last stage).
                last_stage = res["layout"][1] == 1 or rank == len(ranks) - 1
                assert (new["fused_loss_calls"] > 0) == last_stage, (where, new["fused_loss_calls"])
                # Both passes hold each real token once (summed over DP); packed computes no padding.
                stats = new["tokens"]
                assert stats["real_tokens"] == 2 * real, (where, stats)
                assert stats["pad_fraction"] == 0.0, (where, stats)
            assert ref["tokens"]["pad_fraction"] > 0.5, ref["tokens"]  # the padded path's waste on this batch
            head = "model.embed_tokens.weight" if res["tied"] else "lm_head.weight"
            assert ref["grads"][head].abs().max() > 0
            seen.add((res["layout"], res["model"]))
    assert seen == {(layout, m) for layout in layouts for m in ("llama", "qwen2")}


def test_packed_token_budget_fused_path_matches_padded_reference() -> None:
    ckpts = {k: str(v) for k, v in tiny_checkpoints().items()}
    batch = _skewed_batch()
    check_parity(run_distributed(_worker, 2, ckpts, batch, timeout_s=900), batch, LAYOUTS)


@pytest.mark.gpu
def test_packed_te_and_fused_linear_match_padded_reference_on_gpu() -> None:
    """On a GPU (one rank, fp32): the packed path on Transformer Engine's attention (the local varlen submodule when
    TE is absent; the attention class is in the failure message) and the compiled fused kernels."""
    pytest.importorskip(
        "megatron.core", reason="megatron-core not installed (tools/gpu/device_check.sh: carry its wheel)"
    )
    ckpts = {k: str(v) for k, v in tiny_checkpoints().items()}
    batch = _skewed_batch()
    check_parity(run_distributed(_worker, 1, ckpts, batch, ((1, 1),), timeout_s=600), batch, ((1, 1),), atol=1e-4)
