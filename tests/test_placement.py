"""Disaggregated placement (megatron_dapo/placement.py, issue 24 items 1 and 4): one torchrun --rdzv-backend c10d
launch of 3 ranks split into a TP=2 Megatron actor and an engine rank that generates while the actor pushes its
updated weights (tests/_placement_worker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.net import free_port
from megatron_dapo.placement import Placement

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "world, engines, error",
    [(2, 0, "need 1 <= engine_ranks < the launch's ranks"), (2, 2, "leaves 0 for the actor"), (1, 1, "leaves 0")],
)
def test_a_split_without_actor_or_engine_ranks_is_one_line(world, engines, error):
    with pytest.raises(ValueError, match=error):
        Placement(0, world, engines)


def test_actor_ranks_come_first_and_actor_rank_0_leads_the_weight_channel():
    roles = [Placement(r, 5, 2) for r in range(5)]
    assert [p.role for p in roles] == ["actor"] * 3 + ["engine"] * 2
    assert [(p.role_rank, p.role_size) for p in roles] == [(0, 3), (1, 3), (2, 3), (0, 2), (1, 2)]
    assert [p.channel_rank for p in roles] == [0, None, None, 1, 2]
    assert roles[0].engine_ranks == (3, 4) and roles[0].actor_ranks == (0, 1, 2)


@pytest.mark.slow
def test_actor_and_engine_ranks_of_one_launch_push_weights_while_the_engine_generates(tmp_path):
    from tests.actor._tiny_models import make_tiny_qwen2

    hf_dir = make_tiny_qwen2(tmp_path / "qwen2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
           "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "tests._placement_worker", str(tmp_path), str(hf_dir)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the placement launch timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-4000:]
    actor0, actor1, engine = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3))

    # The split: each role's default group holds only its ranks; megatron sized DP from the actor group (2 / TP 2).
    assert [(x["role"], x["role_rank"], x["role_world"]) for x in (actor0, actor1, engine)] == [
        ("actor", 0, 2), ("actor", 1, 2), ("engine", 0, 1)
    ]  # fmt: skip
    assert (actor0["dp_size"], actor0["tp_size"]) == (1, 2)
    assert actor0["push"]["weight_sync/num_tensors"] > 0 and actor0["push"]["weight_sync/num_buckets"] > 1

    # The update landed between engine steps while every request was in flight: each continued under the new weights,
    # its later tokens stamped version 1.
    assert engine["version"] == 1 and engine["loaded_at_step"] > 0
    for rollout in engine["in_flight"]:
        assert len(rollout) == 40
        (_, v0), (start, v1) = rollout.segments
        assert (v0, v1) == (0, 1) and 0 < start < 40, rollout.segments
    # What arrived is the actor's updated model: the engine's log-probs of what it sampled after the push equal the
    # actor's recomputation (fp32), which they would not with the checkpoint's weights (the update moved them).
    for engine_logp, actor_logp in zip(actor0["engine_logp"], actor0["actor_logp"], strict=True):
        torch.testing.assert_close(engine_logp, actor_logp, rtol=0, atol=1e-4)
