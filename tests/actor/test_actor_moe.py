"""The MoE actor (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5) inside MegatronActor on CPU/gloo, against transformers and
itself.

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
from megatron_dapo.batch import RoutedExperts
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


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3"])
def test_moe_actor_matches_transformers_and_is_the_same_under_ep_and_pp(name):
    batch, ref_logp, ref_ent, ref_loss, ref_grads = _oracle(name)
    got = run_distributed(_worker, 2, str(every_tiny_checkpoint()[name]), batch, timeout_s=600)
    ranks = [results for results, _ in got]
    for _, refusal in got:
        assert refusal.startswith("actor.tensor_parallel: a mixture-of-experts actor at tensor_parallel > 1 needs")
        assert "\n" not in refusal
    first = ranks[0][0]["updated"]
    # fp32 against fp64: DeepSeek-V3's low-rank norm weights sit behind two chained projections (up to 1.1e-4 seen)
    tol = 3e-4 if name == "deepseek_v3" else 1e-4
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
                    assert err < tol, f"{where} micro_batch_size={size} {key}: rel err {err:.2e}"
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


# ---------------------------------------------------------------------------------------------------------------
# routing replay (actor.routing_replay r2)
# ---------------------------------------------------------------------------------------------------------------
REPLAY_LAYOUTS = (  # (tp, pp, ep, actor overrides) on 2 ranks
    (1, 1, 1, {}),  # DP=2, packed
    (1, 1, 2, {"packing": False}),  # EP=2, padded micro-batches (s-major token order)
    (1, 2, 1, {"recompute_activations": True}),  # PP=2: each stage its layers; the backward recompute replays too
)


def _replay_worker(hf_dir: str, moved_dir: str, batch, engine_routing: list) -> list[dict]:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    out = []
    for tp, pp, ep, extra in REPLAY_LAYOUTS:
        groups = init_distributed(tp, pp, expert_parallel=ep)
        cfg = _config(hf_dir, tp, pp, expert_parallel=ep, routing_replay="r2", **extra)
        old = MegatronActor(cfg, groups, hf_dir=hf_dir)
        plan = old.row_plan(batch)
        rows = plan.rows_of(groups.dp_rank)
        local = batch.select(torch.tensor(rows))
        free, _ = old.compute_logprobs(local, plan=plan)
        recorded, _ = old.compute_logprobs(local, plan=plan, record_routing=True)
        replayed, _ = old.compute_logprobs(local, plan=plan)  # local.routed_experts is set: replayed
        same = old.pop_routing_agreement("check")  # the unchanged policy's own routing: agreement 1
        # A policy whose routers moved (moved_dir): with the old routing replayed, its log-probs and gradients.
        new = MegatronActor(cfg, groups, hf_dir=moved_dir)
        moved_logp, _ = new.compute_logprobs(local, plan=plan)
        moved_agreement = new.pop_routing_agreement("check")
        new._forward_backward(local, local=True)
        grads = _hf_named_grads(new)
        routed = [local.routed_experts.row(i) for i in range(len(local))]
        # r3: an engine's routing (every layer, all positions but the last) replayed as given.
        local.routed_experts = RoutedExperts.from_rows([engine_routing[i] for i in rows], 8)
        r3_logp, _ = new.compute_logprobs(local, plan=plan)
        # As the trainer sends it under PP: only this stage's MoE layers (Rollout.routing_layers' cut).
        first, count = new.routing.first_layer, new.routing.num_layers
        cut = [engine_routing[i][:, first : first + count] for i in rows]
        local.routed_experts = RoutedExperts.from_rows(cut, 8)
        r3_cut_logp, _ = new.compute_logprobs(local, plan=plan)
        out.append({"layout": (tp, pp, ep, tuple(extra)), "rows": rows, "first_layer": first,
                    "routed": routed, "free": free,
                    "recorded": recorded, "replayed": replayed, "moved_logp": moved_logp,
                    "moved_grads": grads, "same": same, "moved_agreement": moved_agreement,
                    "r3_logp": r3_logp, "r3_cut_logp": r3_cut_logp})  # fmt: skip
    return out


def _forced(model, routing: torch.Tensor | None):
    """Force transformers' MoE routers to `routing` [B, S, MoE layers, k] (None: leave them free); returns (handles,
    recorded: per MoE layer the routers' own top-k [B * S, k] on the inputs they saw). The forced weights are the
    router's own scores at those experts: softmax, or GLM-4.5's sigmoid renormalised and scaled."""
    recorded, handles = [], []
    sigmoid = model.config.model_type in ("glm4_moe", "deepseek_v3")
    for j, layer in enumerate(x for x in model.model.layers if hasattr(x.mlp, "gate")):

        def hook(module, args, output, j=j):
            logits, weights, idx = output
            recorded.append(idx.detach().clone())
            if routing is None:
                return output
            idx = routing[:, :, j].reshape(-1, idx.shape[-1]).to(idx.device)  # rows b * S + s, as the block flattens
            scores = torch.sigmoid(logits.float()) if sigmoid else torch.softmax(logits.float(), dim=-1)
            probs = scores.gather(1, idx)
            if model.config.norm_topk_prob:
                probs = probs / probs.sum(-1, keepdim=True)
            if sigmoid:
                probs = probs * model.config.routed_scaling_factor
            return logits, probs.to(weights.dtype), idx

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    return handles, recorded


def _hf_pass(hf_dir, batch, routing=None, backward=False):
    """fp64 transformers: (log-probs [B, S], own routing [B, S, layers, k], per-expert-named grads)."""
    from transformers.core_model_loading import revert_weight_conversion

    model = load_hf(hf_dir).double()
    handles, recorded = _forced(model, routing)
    logp_all = torch.log_softmax(model(batch.tokens).logits / TEMPERATURE, dim=-1)
    for h in handles:
        h.remove()
    logp = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    logp[:, 1:] = logp_all[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    logp = logp * batch.response_mask
    own = torch.stack([r.view(*batch.tokens.shape, -1) for r in recorded], dim=2) if recorded else None
    grads = None
    if backward:
        loss, _ = dapo_policy_loss(logp, batch.old_logp.double(), batch.advantages.double(), batch.loss_mask,
                                   eps_low=EPS_LOW, eps_high=EPS_HIGH)  # fmt: skip
        loss.backward()
        named = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
        grads = revert_weight_conversion(model, named)
    return logp.float(), own, grads


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe"])
def test_r2_records_transformers_routing_and_replays_it_in_every_layout(tmp_path, name):
    """actor.routing_replay r2 on Qwen3-MoE and GLM-4.5: the recorded experts are transformers' own top-k for every
    token and layer; recording and replaying the unchanged policy's routing change no log-prob; a policy whose
    routers moved, replaying the old routing, has the log-probs and DAPO gradients of transformers' moved model
    forced to the old experts (and not those of its free routing), and so has r3's replay of an engine's routing
    (every layer, the last token unreported; each stage takes its layers). DP=2 packed, EP=2 padded, PP=2 with full
    recompute. GLM-4.5 too: routing indexed by MoE layer (its dense first layer has none; under PP the second
    stage's first MoE layer is the model's second), its sigmoid router replayed with the bias-free scores
    renormalised and scaled."""
    from safetensors.torch import save_file

    src = every_tiny_checkpoint()[name]
    batch, *_ = _oracle(name)
    # The moved policy: every router perturbed (enough to change some top-k choices).
    moved = tmp_path / "moved"
    weights = _initial(name)
    gen = torch.Generator().manual_seed(7)
    for key in [k for k in weights if k.endswith("mlp.gate.weight")]:
        weights[key] = weights[key] + 0.05 * torch.randn(weights[key].shape, generator=gen)
    moved.mkdir()
    save_file(weights, str(moved / "model.safetensors"))
    load_hf(src).config.save_pretrained(moved)
    _, natural, _ = _hf_pass(src, batch)
    moved_free, moved_own, _ = _hf_pass(moved, batch)
    assert not torch.equal(moved_own, natural)  # the perturbation changed routing: replay has something to do
    moved_forced, moved_own_forced, forced_grads = _hf_pass(moved, batch, routing=natural, backward=True)
    assert (moved_forced - moved_free).abs().max() > 1e-3

    lengths = (batch.response_mask.cumsum(1).argmax(1) + 1).tolist()  # prompt + response tokens per row
    engine = [natural[i, : n - 1] for i, n in enumerate(lengths)]  # an engine never feeds the last token
    ranks = run_distributed(_replay_worker, 2, str(src), str(moved), batch, engine, timeout_s=600)
    for rank, results in enumerate(ranks):
        for res in results:
            where = f"rank {rank} {res['layout']}"
            # Recording changes nothing; replaying the same routing changes nothing but float order (pad tokens go
            # to experts 0..k-1 instead of their own choice, so an expert's matmul can hold other rows).
            assert torch.equal(res["recorded"], res["free"]), where
            torch.testing.assert_close(res["replayed"], res["free"], rtol=0, atol=1e-6, msg=where)
            for row, routed in zip(res["rows"], res["routed"], strict=True):
                want = natural[row, : lengths[row], res["first_layer"] : res["first_layer"] + routed.shape[1]]
                assert routed.shape[0] == lengths[row], where
                assert torch.equal(routed.sort(-1).values, want.sort(-1).values), (where, row)
            # Agreement: 1 for the policy that recorded the routing; for the moved one, the fraction of real tokens
            # (every DP rank's, per layer) whose old experts are the top-k the moved routers pick on the replayed
            # forward's inputs, as transformers forced to the old routing picks them.
            assert res["same"]["check/routing_agreement"] == 1.0 and res["same"]["check/routing_agreement_min"] == 1.0
            real = torch.arange(batch.tokens.shape[1])[None, :] < torch.tensor(lengths)[:, None]
            agree = (moved_own_forced.sort(-1).values == natural.sort(-1).values).all(-1)[real]  # [tokens, layers]
            want_layers = agree.double().mean(0).tolist()
            got_layers = [res["moved_agreement"][f"check/routing_agreement_layer_{i}"] for i in range(len(want_layers))]
            assert got_layers == pytest.approx(want_layers, abs=1e-9), where
            assert res["moved_agreement"]["check/routing_agreement"] == pytest.approx(float(agree.double().mean()))
            assert 0.0 < min(want_layers) < 1.0
            got = res["moved_logp"]
            want = moved_forced[res["rows"]]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=where)
            torch.testing.assert_close(res["r3_logp"], want, rtol=0, atol=1e-4, msg=f"{where} r3")
            assert torch.equal(res["r3_cut_logp"], res["r3_logp"]), f"{where} r3 with this stage's layers only"
            for key, ref in forced_grads.items():
                err = float((res["moved_grads"][key] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
                assert err < 1e-4, f"{where} {key}: rel err {err:.2e}"


# ---------------------------------------------------------------------------------------------------------------
# on a GPU: grouped-GEMM experts (tools/gpu/device_check.sh phase 4b; skipped on CPU)
# ---------------------------------------------------------------------------------------------------------------
def _gpu_worker(hf_dir: str, batch) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity against transformers' fp64
    groups = init_distributed(1, 1)
    actor = MegatronActor(_config(hf_dir, 1, 1), groups, hf_dir=hf_dir)
    gpt = actor.unwrapped()
    experts = type(next(x.mlp for x in gpt.decoder.layers if hasattr(x.mlp, "experts")).experts).__name__
    logp, ent = actor.compute_logprobs(batch)
    actor.config.trainer.micro_batch_size = 4
    stats = actor._forward_backward(batch)
    exported = {name: t.detach().cpu().clone() for name, t in actor.export_hf_weights()}
    return {"experts": experts, "grouped_gemm": actor.tf_config.moe_grouped_gemm, "logp": logp.cpu(),
            "ent": ent.cpu(), "loss": stats["loss"], "grads": {k: g.cpu() for k, g in _hf_named_grads(actor).items()},
            "exported": exported}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_moe_actor_on_gpu_with_grouped_gemm_experts_matches_transformers(name):
    """One GPU rank, fp32: with Transformer Engine the experts are TEGroupedMLP (grouped GEMM, weights named
    linear_fc{1,2}.weight{k}), without it megatron's local spec; either way log-probs, entropies and the DAPO
    gradient equal transformers' fp64, and the HF export is the checkpoint bit for bit."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (tools/gpu/device_check.sh: carry it)")
    batch, ref_logp, ref_ent, ref_loss, ref_grads = _oracle(name)
    (res,) = run_distributed(_gpu_worker, 1, str(every_tiny_checkpoint()[name]), batch, timeout_s=600)
    try:
        import transformer_engine  # noqa: F401

        assert res["grouped_gemm"] and res["experts"] == "TEGroupedMLP", res["experts"]
    except ImportError:
        assert res["experts"] == "SequentialMLP", res["experts"]
    where = f"{name} experts={res['experts']}"
    torch.testing.assert_close(res["logp"], ref_logp, rtol=0, atol=1e-4, msg=where)
    torch.testing.assert_close(res["ent"], ref_ent, rtol=0, atol=1e-4, msg=where)
    assert abs(res["loss"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), where
    assert set(res["grads"]) == set(ref_grads), where
    for key, ref in ref_grads.items():
        err = float((res["grads"][key] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert err < 1e-4, f"{where} {key}: rel err {err:.2e}"
    initial = _initial(name)
    assert set(res["exported"]) == set(initial), where
    for key, value in initial.items():
        assert torch.equal(res["exported"][key], value), f"{where} {key}"
