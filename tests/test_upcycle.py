"""megatron_dapo/dev/upcycle.py: a dense Llama upcycled into a Qwen2-MoE (the routing-replay experiment's model).

At zero noise the MoE is the dense model (transformers' own Llama in fp64 is the oracle); with noise the experts
differ and the router's choice matters; the actor (PP=2) reads the upcycled checkpoint (tied embeddings, no qkv bias,
renormalised top-k: a Qwen2-MoE combination no other tiny model has) with transformers' log-probs and exports it back
bit-exact.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.dev.upcycle import upcycle_llama_to_moe
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import load_hf
from tests.actor._tiny_models import make_tiny_llama
from tests.actor._tiny_models import make_tiny_qwen2
from tests.actor.test_actor import TEMPERATURE
from tests.actor.test_actor import _config
from tests.actor.test_actor import _make_batch


def _logits(path, tokens: torch.Tensor) -> torch.Tensor:
    model = load_hf(path).double()
    with torch.no_grad():
        return model(tokens).logits


def test_upcycled_model_is_the_dense_model_at_zero_noise_and_not_with_noise(tmp_path):
    dense = make_tiny_llama(tmp_path / "llama", num_layers=3)
    tokens = _make_batch(0).tokens
    ref = _logits(dense, tokens)
    exact = upcycle_llama_to_moe(dense, tmp_path / "moe0", num_experts=4, top_k=2, noise=0.0)
    moe = load_hf(exact)
    assert type(moe).__name__ == "Qwen2MoeForCausalLM" and moe.config.tie_word_embeddings
    assert not moe.config.qkv_bias and moe.config.norm_topk_prob and moe.config.num_experts == 4
    # The top-2 weights are renormalised in fp32 inside transformers' router: 1 up to float32 rounding.
    torch.testing.assert_close(_logits(exact, tokens), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    # The fresh router does route: tokens go to every expert, in more than one top-2 set.
    picked = []
    handle = moe.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: picked.append(out[2]))
    with torch.no_grad():
        moe(tokens)
    handle.remove()
    sets = {tuple(sorted(row)) for row in picked[0].tolist()}
    assert len(sets) > 1 and set(picked[0].unique().tolist()) == {0, 1, 2, 3}
    noisy = upcycle_llama_to_moe(dense, tmp_path / "moe1", num_experts=4, top_k=2, noise=0.1, seed=3)
    diff = (_logits(noisy, tokens) - ref).abs().max()
    assert 1e-3 * float(ref.abs().max()) < diff  # the experts differ, so the output does
    w = load_file(str(noisy / "model.safetensors"))
    names = [n for n in w if n.startswith("model.layers.0.mlp.experts.")]
    assert names, sorted(w)[:10]
    again = load_file(str(upcycle_llama_to_moe(dense, tmp_path / "moe2", noise=0.1, seed=3) / "model.safetensors"))
    assert all(torch.equal(w[n], again[n]) for n in w)  # seeded


def test_upcycle_refuses_what_it_cannot_carry(tmp_path):
    with pytest.raises(ValueError, match=r"config.json: model_type 'qwen2'"):
        upcycle_llama_to_moe(make_tiny_qwen2(tmp_path / "qwen2"), tmp_path / "out")
    with pytest.raises(ValueError, match="top_k 1 with 4 experts"):
        upcycle_llama_to_moe(make_tiny_llama(tmp_path / "llama"), tmp_path / "out", top_k=1)


def _actor_worker(hf_dir: str, batch) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    groups = init_distributed(1, 2)
    actor = MegatronActor(_config(hf_dir, 1, 2), groups, hf_dir=hf_dir)
    logp, _ = actor.compute_logprobs(batch)
    return {"logp": logp, "exported": {name: t.clone() for name, t in actor.export_hf_weights()}}


def test_actor_reads_the_upcycled_checkpoint(tmp_path):
    path = upcycle_llama_to_moe(make_tiny_llama(tmp_path / "llama", num_layers=2), tmp_path / "moe", noise=0.1)
    batch = _make_batch(0)
    model = load_hf(path).double()
    with torch.no_grad():
        logp_all = torch.log_softmax(model(batch.tokens).logits / TEMPERATURE, dim=-1)
    ref = torch.zeros(batch.tokens.shape, dtype=torch.float64)
    ref[:, 1:] = logp_all[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
    ref = (ref * batch.response_mask).float()
    saved = load_file(str(path / "model.safetensors"))
    for res in run_distributed(_actor_worker, 2, str(path), batch, timeout_s=300):
        torch.testing.assert_close(res["logp"], ref, rtol=0, atol=1e-4)
        assert set(res["exported"]) == set(saved)
        for name, value in res["exported"].items():
            assert torch.equal(value, saved[name]), name
