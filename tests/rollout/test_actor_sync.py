"""End to end on CPU: MegatronActor (TP=2, or Qwen3-MoE at EP=2; gloo) update -> export -> WeightSync ->
TransformersEngine.

One 2-process launch (~20-30 s, mostly imports). After one DAPO update the actor's weights differ from the
checkpoint; after the sync the engine's sampling log-probs of its own completions equal the actor's
compute_logprobs of the same sequences (fp32, 1e-4); synced as FP8 (rollout.weight_dtype) they differ by a
measured amount. The same export, packed as SGLang flattened-bucket payloads
and rebuilt with SGLang's own tensor_bucket.py, loads into a second transformers model with identical logits.
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_dapo.batch import ActorBatch
from megatron_dapo.config import ActorConfig
from megatron_dapo.config import AlgorithmConfig
from megatron_dapo.config import RolloutConfig
from megatron_dapo.config import RunConfig
from megatron_dapo.config import TrainerConfig
from tests.actor._dist import run_distributed
from tests.actor._tiny_models import VOCAB
from tests.actor._tiny_models import make_tiny_deepseek_v3
from tests.actor._tiny_models import make_tiny_glm4_moe
from tests.actor._tiny_models import make_tiny_mixtral
from tests.actor._tiny_models import make_tiny_qwen2
from tests.actor._tiny_models import make_tiny_qwen3_moe

TEMPERATURE = 0.7
PROMPTS = [[5, 17, 33, 3], [9, 100], [150, 151, 152, 153, 154]]


def _config(hf_dir: str, tp: int = 2, ep: int = 1) -> RunConfig:
    return RunConfig(
        actor=ActorConfig(
            model_path=hf_dir,
            tensor_parallel=tp,
            expert_parallel=ep,
            dtype="fp32",
            lr=1e-2,
            lr_warmup_steps=0,
            logprob_impl="reference",
            use_distributed_optimizer=False,
        ),
        trainer=TrainerConfig(prompts_per_step=4, gen_prompts_per_batch=4, mini_batch_prompts=4, micro_batch_size=4),
        algorithm=AlgorithmConfig(group_size=2, overlong_buffer=4),
        rollout=RolloutConfig(engine="transformers", max_response_length=8, temperature=TEMPERATURE),
    )


def _train_batch() -> ActorBatch:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (8, 10), generator=gen)
    response = torch.zeros(8, 10)
    response[:, 4:] = 1.0
    advantages = torch.randn(8, generator=gen)
    return ActorBatch(tokens=tokens, loss_mask=response.clone(), response_mask=response, advantages=advantages)


def _as_batch(completions) -> ActorBatch:
    """Prompt+response rows, right-padded with 0; response_mask on the response tokens."""
    width = max(len(c.prompt_ids) + len(c.response_ids) for c in completions)
    tokens = torch.zeros(len(completions), width, dtype=torch.long)
    mask = torch.zeros(len(completions), width)
    for i, c in enumerate(completions):
        seq = torch.cat([c.prompt_ids, c.response_ids])
        tokens[i, : len(seq)] = seq
        mask[i, len(c.prompt_ids) : len(seq)] = 1.0
    return ActorBatch(tokens=tokens, loss_mask=mask, response_mask=mask, advantages=torch.zeros(len(completions)))


def _load_tensor_bucket_module():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "srt/weight_sync/tensor_bucket.py"
    mod_spec = importlib.util.spec_from_file_location("_sglang_tensor_bucket", path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules["_sglang_tensor_bucket"] = mod
    mod_spec.loader.exec_module(mod)
    return mod


def _sync_worker(hf_dir: str, tp: int = 2, ep: int = 1) -> dict:
    import torch.distributed as dist

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout import TransformersEngine
    from megatron_dapo.rollout import WeightSync
    from megatron_dapo.rollout import bucket_named_tensors
    from megatron_dapo.rollout.sglang_engine import flattened_bucket_payloads
    from tests.actor._tiny_models import load_hf

    groups = init_distributed(tp, 1, expert_parallel=ep)
    actor = MegatronActor(_config(hf_dir, tp, ep), groups, hf_dir=hf_dir)
    batch = _train_batch()
    batch.old_logp, _ = actor.compute_logprobs(batch, with_entropy=False)
    actor.update(batch)
    rank = dist.get_rank()
    engine = TransformersEngine(load_hf(hf_dir), max_running=8) if rank == 0 else None
    out: dict = {}
    probe = torch.tensor([[3, 40, 80, 120, 160, 199]])
    if engine is not None:
        with torch.no_grad():
            out["logits_before"] = engine.model(input_ids=probe).logits
    # Every rank walks the collective export; only rank 0 holds an engine.
    out["metrics"] = WeightSync(engine, bucket_bytes=64 * 1024).sync(actor.export_hf_weights())
    completions = None
    if engine is not None:
        params = SamplingParams(n=2, max_new_tokens=6, temperature=TEMPERATURE, seed=0)
        completions = engine.generate(PROMPTS, params)
        with torch.no_grad():
            out["logits_after"] = engine.model(input_ids=probe).logits
    shared = [completions]
    dist.broadcast_object_list(shared, src=0)
    completions = shared[0]
    seqs = _as_batch(completions)
    actor_logp, _ = actor.compute_logprobs(seqs, with_entropy=False)
    exported = [(n, t.clone()) for n, t in actor.export_hf_weights()]
    if engine is not None:
        out["engine_logp"] = [c.engine_logp for c in completions]
        out["actor_logp"] = [
            actor_logp[i, len(c.prompt_ids) : len(c.prompt_ids) + len(c.response_ids)]
            for i, c in enumerate(completions)
        ]
        tb = _load_tensor_bucket_module()
        if tb is not None:
            second = TransformersEngine(load_hf(hf_dir))
            second.begin_weight_update()
            for bucket in bucket_named_tensors(exported, 64 * 1024):
                for payload in flattened_bucket_payloads(bucket, 2, tb.FlattenedTensorMetadata, pickle.dumps):
                    data = pickle.loads(payload)
                    rebuilt = tb.FlattenedTensorBucket(
                        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
                    )
                    second.update_weights(rebuilt.reconstruct_tensors())
            second.end_weight_update(full=True)
            with torch.no_grad():
                out["sglang_payload_logits"] = second.model(input_ids=probe).logits
    # The same weights as FP8 (rollout.weight_dtype "fp8"): the engine now samples from a slightly different policy.
    fp8_engine = TransformersEngine(load_hf(hf_dir), max_running=8) if rank == 0 else None
    WeightSync(fp8_engine, bucket_bytes=64 * 1024, weight_dtype="fp8").sync(exported)
    shared = [fp8_engine.generate(PROMPTS, params) if fp8_engine is not None else None]
    dist.broadcast_object_list(shared, src=0)
    fp8_logp, _ = actor.compute_logprobs(_as_batch(shared[0]), with_entropy=False)
    if fp8_engine is not None:
        out["fp8_diff"] = torch.cat(
            [
                c.engine_logp - fp8_logp[i, len(c.prompt_ids) : len(c.prompt_ids) + len(c.response_ids)]
                for i, c in enumerate(shared[0])
            ]
        )
    return out


def _sync_workers(cases: list[tuple[str, int, int]]) -> list[dict]:
    """Every (hf_dir, tp, ep) case in one launch (the process group is rebuilt per layout)."""
    from megatron_dapo.actor.distributed import destroy_distributed

    out = [_sync_worker(*case) for case in cases]
    destroy_distributed()
    return out


CASES = {
    "qwen2-tp2": (make_tiny_qwen2, 2, 1),
    "qwen3_moe-ep2": (make_tiny_qwen3_moe, 1, 2),
    "mixtral-ep2": (make_tiny_mixtral, 1, 2),  # block_sparse_moe.experts.e.w1/w3/w2 names into fused experts
    "glm4_moe-ep2": (make_tiny_glm4_moe, 1, 2),  # a dense first layer, the router's fp32 bias (a buffer) synced
    "deepseek_v3-ep2": (make_tiny_deepseek_v3, 1, 2),  # multi-latent attention; the engine caches its latent kv
}


@functools.cache
def _synced() -> dict[str, dict]:
    """Rank 0's results of every case, from one 2-process launch."""
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(str(make(Path(tmp) / name)), tp, ep) for name, (make, tp, ep) in CASES.items()]
        return dict(zip(CASES, run_distributed(_sync_workers, 2, cases)[0], strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_actor_update_sync_then_engine_logprobs_equal_actor_logprobs(case):
    """Qwen3-MoE and Mixtral at EP=2: each rank exports the experts of the other through the EP group, and the engine
    (fused transformers experts) takes the per-expert names (Mixtral's checkpoint names, router included)."""
    res = _synced()[case]
    # The update moved the weights and the sync carried them into the engine.
    assert (res["logits_before"] - res["logits_after"]).abs().max() > 1e-3
    assert res["metrics"]["weight_sync/num_buckets"] > 1
    for engine_lp, actor_lp in zip(res["engine_logp"], res["actor_logp"]):
        torch.testing.assert_close(engine_lp, actor_lp, rtol=0, atol=1e-4)
    # FP8 weights: a measured, reported gap (docs/rollout_correction.md), far above the fp32 path's 1e-4.
    fp8 = res["fp8_diff"].abs()
    print(f"fp8 engine vs actor |d logp|: mean {float(fp8.mean()):.4f} max {float(fp8.max()):.4f} (n={fp8.numel()})")
    assert 1e-3 < float(fp8.mean()) < 0.5
    if "sglang_payload_logits" in res:
        torch.testing.assert_close(res["sglang_payload_logits"], res["logits_after"], rtol=0, atol=0)
