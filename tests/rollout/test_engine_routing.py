"""The embedded engine returns every token's routed experts on MoE models (SamplingParams.return_routed_experts)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout.base import request_result
from megatron_dapo.rollout.types import FinishReason
from megatron_dapo.rollout.types import GenerationRequest
from megatron_dapo.rollout.types import Rollout
from tests.actor._tiny_models import load_hf
from tests.actor._tiny_models import make_tiny_deepseek_v3
from tests.actor._tiny_models import make_tiny_glm4_moe
from tests.actor._tiny_models import make_tiny_mixtral
from tests.actor._tiny_models import make_tiny_qwen3_moe

PROMPTS = [[5, 17, 33, 3], [9, 100], [150, 151, 152, 153, 154]]


MAKE = {
    "qwen3_moe": make_tiny_qwen3_moe,
    "mixtral": make_tiny_mixtral,
    "glm4_moe": make_tiny_glm4_moe,
    "deepseek_v3": make_tiny_deepseek_v3,  # multi-latent attention: the slot cache holds its compressed kv
}
MOE_LAYERS = {"qwen3_moe": 4, "mixtral": 4, "glm4_moe": 3, "deepseek_v3": 3}  # a dense first layer has no router


@pytest.fixture(scope="module", params=sorted(MAKE))
def moe_dir(tmp_path_factory, request):
    make = MAKE[request.param]
    return make(tmp_path_factory.mktemp("moe") / request.param)


def _own_routing(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' routing of one sequence, teacher-forced: [len(ids), MoE layers, k]."""
    seen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1)


def test_engine_routing_is_the_models_own_for_prompt_and_response(moe_dir):
    engine = TransformersEngine(load_hf(moe_dir), max_running=4)
    out = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=7, seed=0, return_routed_experts=True))
    model = load_hf(moe_dir)
    for c in out:
        n = len(c.prompt_ids) + len(c) - 1  # the last sampled token is never fed back
        assert c.routed_experts.shape == (n, MOE_LAYERS[moe_dir.name], 2) and c.routed_experts.dtype == torch.uint8
        ids = torch.cat([c.prompt_ids, c.response_ids]).long()
        want = _own_routing(model, ids)[:n]
        assert torch.equal(c.routed_experts.long().sort(-1).values, want.sort(-1).values)
    plain = engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=3, seed=0))
    assert all(c.routed_experts is None for c in plain)  # only when asked


def test_continued_response_carries_the_latest_runs_routing_and_state_round_trips(moe_dir):
    engine = TransformersEngine(load_hf(moe_dir), max_running=4)
    params = SamplingParams(n=1, max_new_tokens=8, seed=0, return_routed_experts=True)
    first = engine.generate([PROMPTS[0]], SamplingParams(n=1, max_new_tokens=3, seed=0, return_routed_experts=True))[0]
    carried = Rollout(first.prompt_ids, first.response_ids, first.engine_logp, FinishReason.ABORT, first.segments,
                      first.routed_experts)  # fmt: skip
    engine.submit([GenerationRequest("k", first.prompt_ids, seed=1, prefix=carried)], params)
    done = []
    while engine.num_unfinished():
        done += engine.step()
    out = done[0][1]
    assert out.routed_experts.shape[0] == len(out.prompt_ids) + len(out) - 1
    assert torch.equal(Rollout.from_state(out.to_state()).routed_experts, out.routed_experts)
    # A run without routing keeps the prefix's.
    kept = request_result(GenerationRequest("k", first.prompt_ids, 1, prefix=carried), [7], [0.0],
                          FinishReason.STOP, 0)  # fmt: skip
    assert torch.equal(kept.routed_experts, carried.routed_experts)


def test_dense_model_refuses_routed_experts():
    from tests.rollout.conftest import tiny_model

    engine = TransformersEngine(tiny_model("qwen2"), max_running=4)
    with pytest.raises(ValueError, match="return_routed_experts needs a mixture-of-experts model"):
        engine.generate([[1, 2]], SamplingParams(return_routed_experts=True))


def test_routing_shape_from_the_checkpoint(moe_dir, tmp_path):
    from megatron_dapo.rollout.factory import routing_shape
    from tests.rollout.conftest import tiny_model

    # layers, top-k, experts, dense first layers: what SGLang's routed_experts hold
    assert routing_shape(str(moe_dir)) == (4, 2, 8, 4 - MOE_LAYERS[moe_dir.name])
    tiny_model("qwen2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json: not a mixture-of-experts config"):
        routing_shape(str(tmp_path))


def test_routing_layers_cuts_what_one_pipeline_stage_replays():
    routed = torch.arange(6 * 4 * 2, dtype=torch.int16).reshape(6, 4, 2)
    r = Rollout([1, 2, 3], [4, 5, 6, 7], [-0.1] * 4, FinishReason.STOP, ((0, 3),), routed)
    stage = r.routing_layers((1, 2))  # a stage holding MoE layers 1 and 2 of 4
    assert torch.equal(stage.routed_experts, routed[:, 1:3]) and stage.routed_experts.is_contiguous()
    assert torch.equal(stage.response_ids, r.response_ids) and stage.segments == r.segments
    assert torch.equal(stage.engine_logp, r.engine_logp) and stage.finish is r.finish
    assert r.routing_layers((0, 4)) is r and r.routing_layers(None) is r  # nothing to cut: the same object
    dense = Rollout([1], [2], None, FinishReason.STOP, ((0, 3),))
    assert dense.routing_layers((0, 2)) is dense
    with pytest.raises(ValueError, match="Rollout.routing_layers: layers 3..4 of 4"):
        r.routing_layers((3, 2))


def test_multi_turn_trajectories_carry_the_routing_of_every_position(moe_dir):
    """Routing replay r3 with a multi-turn environment: a trajectory's routed experts cover prompt, model turns and
    observation tokens (the last turn's run re-reads the whole trajectory), each position routed as transformers
    routes the whole sequence teacher-forced, so the actor's replay stays aligned per token."""
    from megatron_dapo.rollout.turns import run_trajectories
    from tests.envs.test_multi_turn import ThreeTurns

    engine = TransformersEngine(load_hf(moe_dir), max_running=4)
    params = SamplingParams(n=2, max_new_tokens=30, seed=0, stop_token_ids=tuple(range(3, 120)),
                            return_routed_experts=True)  # fmt: skip
    env = ThreeTurns()
    out = run_trajectories(engine, PROMPTS[:2], lambda i: env.episode("0"), params)
    model = load_hf(moe_dir)
    assert any(len(c.observations) == 2 for c in out)
    for c in out:
        n = len(c.prompt_ids) + len(c) - 1
        assert c.routed_experts.shape == (n, MOE_LAYERS[moe_dir.name], 2)
        ids = torch.cat([c.prompt_ids, c.response_ids]).long()
        want = _own_routing(model, ids)[:n]
        assert torch.equal(c.routed_experts.long().sort(-1).values, want.sort(-1).values)
