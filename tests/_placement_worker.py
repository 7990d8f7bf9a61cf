"""Worker of tests/test_placement.py, launched by torchrun --rdzv-backend c10d with 3 ranks: actor ranks 0-1
(MegatronActor at TP=2 over the actor group only) and engine rank 2 (TransformersEngine, generating throughout).

    actor:  one DAPO update -> push version 1 over the weight channel (rank 0 sends, rank 1 walks the export) ->
            log-probs of the engine's post-update completions (read from the store)
    engine: requests of 40 tokens in flight (it waits after 5 steps for the push to be announced); between steps,
            pending() -> receive(): the update lands mid-request ->
            a fresh request after it; its completions go to the store
Each rank saves what it saw to OUT/rank<r>.pt.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.placement import Placement
from megatron_dapo.placement import WeightChannel
from megatron_dapo.placement import init_role_group
from megatron_dapo.placement import launch_store

TIMEOUT_S = 120.0


def main(out_dir: str, hf_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    placement = Placement(rank, world, num_engine_ranks=1)
    store = launch_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, TIMEOUT_S)
    init_role_group(placement, store, "gloo", TIMEOUT_S)
    report: dict = {"role": placement.role, "role_world": dist.get_world_size(), "role_rank": dist.get_rank()}
    channel = WeightChannel(placement, store, TIMEOUT_S) if placement.channel_rank is not None else None
    report.update(_engine(channel, store, hf_dir) if placement.is_engine else _actor(channel, store, hf_dir))
    torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _actor(channel: WeightChannel | None, store: dist.Store, hf_dir: str) -> dict:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed
    from tests.rollout.test_actor_sync import _as_batch
    from tests.rollout.test_actor_sync import _config
    from tests.rollout.test_actor_sync import _train_batch

    groups = init_distributed(2, 1)  # over the actor group: DP = 2 actor ranks / TP 2 = 1
    actor = MegatronActor(_config(hf_dir, tp=2), groups, hf_dir=hf_dir)
    batch = _train_batch()
    batch.old_logp, _ = actor.compute_logprobs(batch, with_entropy=False)
    actor.update(batch)
    metrics = {}
    if channel is not None:
        metrics = channel.push(1, actor.export_hf_weights(), bucket_bytes=64 * 1024)
    else:  # the export is collective over TP: every actor rank walks it
        for _ in actor.export_hf_weights():
            pass
    store.wait(["engine/completions"])
    completions = pickle.loads(store.get("engine/completions"))
    logp, _ = actor.compute_logprobs(_as_batch(completions), with_entropy=False)
    rows = [logp[i, len(c.prompt_ids) : len(c.prompt_ids) + len(c.response_ids)] for i, c in enumerate(completions)]
    return {"dp_size": groups.dp_size, "tp_size": groups.tp_size, "push": metrics, "actor_logp": rows,
            "engine_logp": [c.engine_logp for c in completions]}  # fmt: skip


def _engine(channel: WeightChannel, store: dist.Store, hf_dir: str) -> dict:
    from megatron_dapo.rollout import GenerationRequest
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout import TransformersEngine
    from megatron_dapo.rollout.base import completion_seed
    from megatron_dapo.rollout.base import generate_blocking
    from tests.actor._tiny_models import load_hf
    from tests.rollout.test_actor_sync import PROMPTS
    from tests.rollout.test_actor_sync import TEMPERATURE

    engine = TransformersEngine(load_hf(hf_dir), eos_token_ids=(), max_running=8)
    long = SamplingParams(max_new_tokens=40, temperature=TEMPERATURE)
    engine.submit([GenerationRequest(i, p, completion_seed(0, i, 0)) for i, p in enumerate(PROMPTS)], long)
    done: dict = {}
    steps = loaded_at = 0
    while engine.num_unfinished():
        if steps == 5:  # requests in flight: hold here until the actor announces its push (a slow actor)
            while channel.pending() is None:
                time.sleep(0.01)
        if channel.pending() is not None:  # the check the stream makes between two engine steps
            channel.receive(engine)
            loaded_at = steps
        done.update(engine.step())
        steps += 1
    # After the update: the engine samples from the actor's updated weights.
    params = SamplingParams(n=2, max_new_tokens=6, temperature=TEMPERATURE, seed=0)
    completions = generate_blocking(engine, PROMPTS, params)
    store.set("engine/completions", pickle.dumps(completions))
    in_flight = [done[i] for i in range(len(PROMPTS))]
    return {"in_flight": in_flight, "loaded_at_step": loaded_at, "version": channel.version}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
