"""TransformersEngine: grouping, finish reasons, seeds, log-probs against a teacher-forced forward."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import Rollout
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout.transformers_engine import filter_logits
from tests.rollout.conftest import EOS
from tests.rollout.conftest import tiny_model

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 4, 8, 20, 40, 33]]


@pytest.fixture(scope="module")
def engine():
    return TransformersEngine(tiny_model("qwen2"), max_running=8)


def _teacher_forced_logprobs(model, c: Rollout, temperature: float) -> torch.Tensor:
    ids = torch.cat([c.prompt_ids, c.response_ids]).long()[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    p = len(c.prompt_ids)
    targets = ids[0, p:]
    return logp[p - 1 : -1].gather(1, targets[:, None])[:, 0]


def test_groups_of_n_contiguous_by_prompt(engine):
    out = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=5, seed=0))
    assert len(out) == 9
    for j, c in enumerate(out):
        assert c.prompt_ids.tolist() == PROMPTS[j // 3]
        assert 1 <= len(c) <= 5
        assert c.engine_logp is not None and c.engine_logp.numel() == len(c)
        assert c.segments == ((0, 0),)
    # The n samples of one prompt differ (distinct generators).
    assert len({tuple(c.response_ids.tolist()) for c in out[:3]}) > 1


def test_length_finish_has_exactly_max_new_tokens():
    eng = TransformersEngine(tiny_model("qwen2"), eos_token_ids=(), max_running=4)
    out = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=3))
    assert all(c.finish is FinishReason.LENGTH and len(c) == 6 for c in out)


def test_stop_token_ends_response_and_is_included(engine):
    params = SamplingParams(n=2, max_new_tokens=12, seed=11)
    free = TransformersEngine(engine.model, eos_token_ids=(), max_running=8).generate(PROMPTS, params)
    stop_tok = int(free[0].response_ids[3])
    stopped = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=12, seed=11, stop_token_ids=(stop_tok,)))
    for f, s in zip(free, stopped):
        f_ids, s_ids = f.response_ids.tolist(), s.response_ids.tolist()
        ends = [i for i, t in enumerate(f_ids) if t in (stop_tok, EOS)]
        if ends:
            assert s.finish is FinishReason.STOP
            assert s_ids == f_ids[: ends[0] + 1]
            assert s_ids[-1] in (stop_tok, EOS)
        else:
            assert s.finish is FinishReason.LENGTH and s_ids == f_ids
    assert stopped[0].finish is FinishReason.STOP and len(stopped[0]) <= 4


def test_same_seed_same_completions_independent_of_batching(engine):
    params = SamplingParams(n=4, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    c = TransformersEngine(engine.model, max_running=1).generate(PROMPTS, params)
    ids = lambda out: [x.response_ids.tolist() for x in out]
    assert ids(a) == ids(b) == ids(c)
    d = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=1235))
    assert ids(a) != ids(d)


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5)])
def test_logprobs_equal_teacher_forced_tempered_forward(engine, temperature, top_p, top_k):
    params = SamplingParams(n=2, max_new_tokens=7, temperature=temperature, top_p=top_p, top_k=top_k, seed=5)
    for c in engine.generate(PROMPTS, params):
        ref = _teacher_forced_logprobs(engine.model, c, temperature)
        torch.testing.assert_close(c.engine_logp, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_other_architectures_report_the_logprobs_of_what_they_sample(kind):
    engine = TransformersEngine(tiny_model(kind), max_running=8)
    params = SamplingParams(n=2, max_new_tokens=7, temperature=0.9, seed=5)
    for c in engine.generate(PROMPTS, params):
        ref = _teacher_forced_logprobs(engine.model, c, 0.9)
        torch.testing.assert_close(c.engine_logp, ref, rtol=0, atol=1e-4)


def test_top_k_one_is_greedy(engine):
    out = engine.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=5, top_k=1, seed=0))
    ids = torch.tensor([PROMPTS[0]])
    greedy = []
    with torch.no_grad():
        for _ in range(len(out[0])):
            nxt = int(engine.model(input_ids=ids).logits[0, -1].argmax())
            greedy.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert out[0].response_ids.tolist() == greedy == out[1].response_ids.tolist()


def test_return_logprobs_false(engine):
    out = engine.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=3, seed=0, return_logprobs=False))
    assert out[0].engine_logp is None


def test_filter_logits_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, 0, 0.81))
    assert kept.tolist() == [[True, True, True, False]]
    kept = torch.isfinite(filter_logits(logits, 2, 1.0))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.01)).sum() == 1


def test_bad_params_one_line_errors():
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="SamplingParams.n"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="'done' is not a valid FinishReason"):
        Rollout([1], [2], None, "done")
    with pytest.raises(ValueError, match="engine_logp: 1 values for 2 tokens"):
        Rollout([1], [2, 3], [0.0], FinishReason.STOP)


def test_loads_from_checkpoint_dir(tiny_qwen2_dir):
    eng = TransformersEngine(tiny_qwen2_dir, max_running=2)
    assert eng.eos_token_ids == (EOS,) and eng.pad_token_id == 0
    out = eng.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert len(out) == 2


def test_make_engine_and_sampling_params_from_config(tiny_qwen2_dir):
    from megatron_dapo.config import RolloutConfig
    from megatron_dapo.rollout import RolloutEngine
    from megatron_dapo.rollout import make_engine
    from megatron_dapo.rollout import sampling_params

    cfg = RolloutConfig(
        engine="transformers", max_response_length=4, temperature=0.8, top_p=0.9, max_running_requests=6
    )
    eng = make_engine(cfg, str(tiny_qwen2_dir), max_context=64)
    assert (eng.max_running, eng.max_context) == (8, 64)  # rounded up to whole row blocks
    assert isinstance(eng, TransformersEngine) and isinstance(eng, RolloutEngine)
    params = sampling_params(cfg, n=2, seed=3)
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (4, 0.8, 0.9, 0)
    out = eng.generate([[1, 2]], params)
    assert len(out) == 2 and all(len(c) <= 4 for c in out)
