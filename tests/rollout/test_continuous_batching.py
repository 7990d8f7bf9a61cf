"""TransformersEngine continuous batching: batch invariance (bit for bit), abort, and continuing carried responses."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout import GenerationRequest
from megatron_dapo.rollout import SamplingParams
from megatron_dapo.rollout import TransformersEngine
from megatron_dapo.rollout.base import completion_seed
from tests.rollout.conftest import tiny_config
from tests.rollout.conftest import tiny_model

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 4, 8, 20, 40, 33], [1, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95)


def wider_llama() -> torch.nn.Module:
    """Hidden 192, 3 layers, GQA 6/2 heads of 32: matmuls wide enough for MKL's blocked kernels."""
    torch.manual_seed(3)
    wide = dict(vocab_size=300, hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **wide), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model.eval()


def requests(keys: list[tuple[int, int]]) -> list[GenerationRequest]:
    return [GenerationRequest((i, k), PROMPTS[i], completion_seed(7, i, k)) for i, k in keys]


def run(engine: TransformersEngine, waves: list[list[tuple[int, int]]], steps_between: int = 3) -> dict:
    """Submit each wave after `steps_between` steps of the previous ones; run to the end; {key: Rollout}."""
    done = {}
    for wave in waves:
        engine.submit(requests(wave), PARAMS)
        for _ in range(steps_between):
            done.update(engine.step())
    while engine.num_unfinished():
        done.update(engine.step())
    return done


ALL = [(i, k) for i in range(len(PROMPTS)) for k in range(4)]


@pytest.mark.parametrize("make_model", [lambda: tiny_model("qwen2"), wider_llama], ids=["qwen2-tiny", "llama-192"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_request_is_bit_identical_whatever_shares_its_batch(make_model, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = make_model()
        engine = TransformersEngine(model, max_running=8, max_context=64)
        alone = {}
        for key in ALL:
            alone.update(run(engine, [[key]]))
        together = run(engine, [ALL])  # 20 requests through 8 slots: rows join as others finish
        staggered = run(engine, [ALL[::3], ALL[1::3], ALL[2::3]], steps_between=2)
        wide = run(TransformersEngine(model, max_running=24, max_context=64), [list(reversed(ALL))])
    finally:
        torch.set_num_threads(before)
    for key in ALL:
        ref = alone[key]
        assert ref.finish.finished and len(ref) >= 1
        for other in (together, staggered, wide):
            got = other[key]
            assert torch.equal(got.response_ids, ref.response_ids), key
            assert torch.equal(got.engine_logp, ref.engine_logp), key  # bit for bit, not within a tolerance
            assert got.finish is ref.finish


def test_rows_never_exceed_the_slots_and_finish_out_of_order():
    engine = TransformersEngine(tiny_model("llama"), max_running=8, max_context=64)
    engine.submit(requests(ALL), PARAMS)
    order, peak = [], 0
    while engine.num_unfinished():
        peak = max(peak, len(engine._live))
        order.extend(key for key, _ in engine.step())
    assert peak == 8 and sorted(order) == sorted(ALL)
    assert order != sorted(order, key=ALL.index)  # a short response leaves before a long one submitted earlier


def test_abort_returns_everything_unfinished_and_leaves_nothing_in_flight():
    engine = TransformersEngine(tiny_model("qwen2"), eos_token_ids=(), max_running=8, max_context=64)
    engine.submit(requests(ALL), PARAMS)
    finished = {}
    for _ in range(4):
        finished.update(engine.step())
    aborted = dict(engine.abort())
    assert engine.num_unfinished() == 0 and engine.free_slots() == engine.max_running
    assert set(aborted) | set(finished) == set(ALL) and not set(aborted) & set(finished)
    running = [r for r in aborted.values() if len(r)]
    assert len(running) == 8 and all(len(r) == 5 for r in running)  # 4 steps: a token at admission + 1 per step
    assert all(r.finish is FinishReason.ABORT and r.segments in ((), ((0, 0),)) for r in aborted.values())
    assert engine.step() == [] and engine.abort() == []
    # The engine is reusable and the aborted rows' tokens are a prefix of an uninterrupted run (same seed).
    full = run(engine, [list(aborted)])
    for key, part in aborted.items():
        assert torch.equal(full[key].response_ids[: len(part)], part.response_ids)
        assert torch.equal(full[key].engine_logp[: len(part)], part.engine_logp)


def test_a_carried_response_keeps_its_tokens_and_continues_under_the_new_weights():
    model = tiny_model("qwen2")
    engine = TransformersEngine(model, eos_token_ids=(), max_running=8, max_context=64)
    engine.weight_version = 3
    engine.submit(requests([(0, 0), (2, 1)]), PARAMS)
    for _ in range(5):
        engine.step()
    carried = dict(engine.abort())
    with torch.no_grad():  # the "update": new weights, new version
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.weight_version = 4
    cont = [GenerationRequest(key, PROMPTS[key[0]], completion_seed(8, *key), prefix=carried[key]) for key in carried]
    engine.submit(cont, PARAMS)
    done = {}
    while engine.num_unfinished():
        done.update(engine.step())
    for key, part in carried.items():
        out = done[key]
        n = len(part)
        assert n == 6 and len(out) == PARAMS.max_new_tokens and out.finish is FinishReason.LENGTH
        assert torch.equal(out.response_ids[:n], part.response_ids)
        assert torch.equal(out.engine_logp[:n], part.engine_logp)  # the old segment keeps its engine log-probs
        assert out.segments == ((0, 3), (n, 4))
        ids = torch.cat([out.prompt_ids, out.response_ids]).long()[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = out.prompt_ids.numel()
        new = logp[p - 1 : -1].gather(1, ids[0, p:, None])[:, 0][n:]
        torch.testing.assert_close(out.engine_logp[n:], new, rtol=0, atol=1e-5)  # the new segment: new weights


def test_weights_loaded_while_requests_run_start_a_new_segment_over_the_old_kv():
    """An update between engine steps (asynchronous training, issue 24 item 4): requests in flight go on; the tokens
    sampled after it are stamped with the new version and their engine log-probs are the new weights' over the KV the
    old weights wrote (oracle: transformers, the old model's cache continued by the new model)."""
    import copy

    old = tiny_model("qwen2")
    engine = TransformersEngine(copy.deepcopy(old), eos_token_ids=(), max_running=8, max_context=64)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.weight_version = 3
    engine.submit(requests([(0, 0), (2, 1)]), PARAMS)
    for _ in range(5):
        assert not engine.step()
    engine.load_weights(list(new.state_dict().items()))
    engine.weight_version = 4
    done = {}
    while engine.num_unfinished():
        done.update(engine.step())
    for out in done.values():
        assert len(out) == PARAMS.max_new_tokens and out.finish is FinishReason.LENGTH
        (_, v0), (n, v1) = out.segments
        assert (v0, v1) == (3, 4) and 0 < n < len(out), out.segments
        ids = torch.cat([out.prompt_ids, out.response_ids]).long()[None]
        p = out.prompt_ids.numel()
        with torch.no_grad():  # tokens < n sampled under the old weights; token n from the new ones, fed t_{n-1}
            first = old(input_ids=ids[:, : p + n - 1], use_cache=True)
            rest = new(input_ids=ids[:, p + n - 1 : -1], past_key_values=first.past_key_values).logits[0]
            before = torch.log_softmax(first.logits[0, p - 1 :].float(), -1)
        target = ids[0, p:]
        torch.testing.assert_close(out.engine_logp[:n], before.gather(1, target[:n, None])[:, 0], rtol=0, atol=1e-5)
        after = torch.log_softmax(rest.float(), -1).gather(1, target[n:, None])[:, 0]
        torch.testing.assert_close(out.engine_logp[n:], after, rtol=0, atol=1e-5)
    alone = run(TransformersEngine(new, eos_token_ids=(), max_running=8, max_context=64), [[(1, 0)]])
    engine.submit(requests([(1, 0)]), PARAMS)  # a request that starts after the update is the new model's alone
    again = {}
    while engine.num_unfinished():
        again.update(engine.step())
    assert torch.equal(again[(1, 0)].response_ids, alone[(1, 0)].response_ids)
    assert again[(1, 0)].segments == ((0, 4),)


def test_context_over_max_context_is_one_line():
    engine = TransformersEngine(tiny_model("qwen2"), max_running=8, max_context=16)
    with pytest.raises(ValueError, match=r"request \(4, 0\) needs 23 positions .* KV slots hold 16"):
        engine.submit(requests([(4, 0)]), PARAMS)


def test_release_kv_cache_needs_an_idle_engine():
    engine = TransformersEngine(tiny_model("qwen2"), max_running=8, max_context=64)
    engine.submit(requests([(0, 0)]), PARAMS)
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.release_memory(["kv_cache"])
    engine.abort()
    engine.release_memory(["kv_cache"])
    assert engine._cache is None
    assert run(engine, [[(1, 0)]])[(1, 0)].finish.finished
