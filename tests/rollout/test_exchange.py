"""RolloutExchange: rollouts gathered over a gloo group, with a generation timeout (2 CPU ranks)."""

from __future__ import annotations

import time

import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo.net import free_port
from megatron_dapo.rollout.exchange import ExchangeTimeout
from megatron_dapo.rollout.exchange import RolloutExchange

TIMEOUT_S = 2.0


def _worker(rank: int, port: int, out: dict, round2_done) -> None:
    # The default group's own timeout is long: only the exchange's timeout can end the wait below in time.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ex = RolloutExchange(2, timeout_s=TIMEOUT_S)
    evaluation = RolloutExchange(2, timeout_s=TIMEOUT_S, setting="trainer.eval_timeout_minutes")  # the trainer's
    out[f"backend{rank}"] = dist.get_backend(ex.group)
    # Round 1: only rank 0 has an engine; rank 1 contributes nothing and waits while rank 0 "generates".
    if rank == 0:
        time.sleep(0.5 * TIMEOUT_S)
        got = ex.all_gather([{"index": 3, "ids": [1, 2]}, {"index": 5, "ids": [7]}])
    else:
        got = ex.all_gather([])
    out[f"round1_{rank}"] = got
    # Round 2: rank 1 never arrives (a generation that outlives the timeout); rank 0 must stop with one line.
    if rank == 0:
        start = time.perf_counter()
        try:
            ex.all_gather(["x"])
            out["round2"] = "no error"
        except ExchangeTimeout as err:
            out["round2"] = str(err)
        out["round2_s"] = time.perf_counter() - start
        try:  # evaluation's own group names its own field
            evaluation.all_gather(["y"], "eval")
            out["eval"] = "no error"
        except ExchangeTimeout as err:
            out["eval"] = str(err)
        round2_done.set()
    else:
        round2_done.wait(timeout=60)  # stay alive (but absent) until rank 0 has timed out
    out[f"done{rank}"] = True


def test_gather_over_gloo_and_timeout():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out, round2_done = manager.dict(), manager.Event()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, out, round2_done)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        for p in procs:
            if p.is_alive():
                p.kill()
        out = dict(out)
    expected = [{"index": 3, "ids": [1, 2]}, {"index": 5, "ids": [7]}]
    assert out["backend0"] == out["backend1"] == "gloo"
    assert out["round1_0"] == out["round1_1"] == expected
    assert out["round2"].startswith("rollout exchange (rollouts): not every rank arrived within ")
    assert "rollout.generation_timeout_minutes=" in out["round2"] and "\n" not in out["round2"]
    assert out["round2_s"] < 30  # the exchange's timeout ended it, not the default group's (30 min)
    assert out["eval"].startswith("rollout exchange (eval): not every rank arrived within trainer.eval_timeout_minut")
    assert out.get("done0") and out.get("done1")


def test_single_rank_is_a_copy():
    ex = RolloutExchange(1, timeout_s=1.0)
    items = [1, 2]
    assert ex.all_gather(items) == [1, 2] and ex.all_gather(items) is not items and ex.group is None
