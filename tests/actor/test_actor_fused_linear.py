"""actor.logprob_impl="fused_linear" (last stage returns hidden states, LM head fused into the log-prob op) against
today's padded full-logits path ("reference") inside MegatronActor, on CPU/gloo with the tiny HF checkpoints.

One 2-process launch checks TP=2 (the vocab-parallel fused op) for both models, llama (tied embeddings) and qwen2
(untied output layer), with micro-batches of trainer.micro_batch_size rows. PP=2 (the tied output weight is megatron's
copy of the embedding on the last stage, its gradient all-reduced with the first stage) and DP=2 with the fused
op are checked by tests/actor/test_actor_packing.py, whose fused packed path is compared with the padded full-logits
reference at all three layouts (so this test no longer repeats them). Per model it compares, fp32, <= 1e-5:
per-token log-probs and entropies (compute_logprobs), the mini-batch loss and entropy metric, and every gradient in
the DDP buffers (param.main_grad after the DP all-reduce and finalize_model_grads), exported as full HF-named
tensors so that the tied embedding's gradient is the all-reduced one. The fused op runs in the Triton interpreter
here (TRITON_INTERPRET=1 from tests/conftest.py is inherited by the ranks), so shapes stay tiny.
"""

from __future__ import annotations

import math

import torch

from tests.actor._dist import run_distributed
from tests.actor._tiny_models import tiny_checkpoints
from tests.actor.test_actor import _config
from tests.actor.test_actor import _hf_named_grads
from tests.actor.test_actor import _make_batch

LAYOUTS = ((2, 1),)  # on 2 ranks: TP=2 (PP=2 and DP=2: test_actor_packing.py)


def _run_impl(actor, batch) -> dict:
    logp, ent = actor.compute_logprobs(batch)
    stats = actor._forward_backward(batch)
    return {
        "logp": logp,
        "ent": ent,
        "loss": stats["loss"],
        "entropy": stats["entropy"],
        "grads": _hf_named_grads(actor),
        "uses_hidden": actor.schedule.output_weight(actor.logprob_impl.takes_hidden) is not None,
    }


def _parity_worker(ckpts: dict[str, str], batch) -> list[dict]:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.loss import get_logprob_impl

    out = []
    for tp, pp in LAYOUTS:
        groups = init_distributed(tp, pp)
        for name, hf_dir in ckpts.items():
            actor = MegatronActor(_config(hf_dir, tp, pp), groups, hf_dir=hf_dir)
            # Behaviour log-probs off the current policy, so that some ratios get clipped.
            logp, _ = actor.compute_logprobs(batch, with_entropy=False)
            noise = 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
            batch.old_logp = (logp + noise) * batch.response_mask
            res = {"layout": (tp, pp), "model": name, "is_last_stage": groups.is_last_stage}
            res["reference"] = _run_impl(actor, batch)
            actor.logprob_impl = get_logprob_impl("fused_linear")
            res["fused_linear"] = _run_impl(actor, batch)
            res["tied"] = actor.unwrapped().share_embeddings_and_output_weights
            out.append(res)
    return out


def test_fused_linear_matches_full_logits_path_tp2() -> None:
    ckpts = {k: str(v) for k, v in tiny_checkpoints().items()}
    ranks = run_distributed(_parity_worker, 2, ckpts, _make_batch(seed=2), timeout_s=600)
    seen = set()
    for rank, results in enumerate(ranks):
        for res in results:
            where = f"rank {rank} layout tp,pp={res['layout']} model={res['model']}"
            ref, lin = res["reference"], res["fused_linear"]
            assert not ref["uses_hidden"], where
            assert lin["uses_hidden"] == res["is_last_stage"], where
            torch.testing.assert_close(lin["logp"], ref["logp"], rtol=0, atol=1e-5, msg=where)
            torch.testing.assert_close(lin["ent"], ref["ent"], rtol=0, atol=1e-5, msg=where)
            assert ref["logp"].abs().sum() > 0 and ref["ent"].abs().sum() > 0, where
            assert math.isclose(lin["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-6), (where, lin["loss"], ref["loss"])
            assert math.isclose(lin["entropy"], ref["entropy"], rel_tol=1e-5, abs_tol=1e-6), where
            assert set(lin["grads"]) == set(ref["grads"]), where
            for name, g_ref in ref["grads"].items():
                scale = g_ref.abs().max().clamp_min(1e-12)
                err = float((lin["grads"][name] - g_ref).abs().max() / scale)
                assert err <= 1e-5, f"{where} {name}: rel err {err:.2e}"
            head = "model.embed_tokens.weight" if res["tied"] else "lm_head.weight"
            assert ref["grads"][head].abs().max() > 0, f"{where}: {head} has no gradient"
            seen.add((res["layout"], res["model"]))
    assert seen == {(layout, m) for layout in LAYOUTS for m in ("llama", "qwen2")}
