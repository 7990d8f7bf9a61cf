"""Worker for test_launch_torchrun.py: runs under `torchrun --rdzv-backend c10d`, writes a JSON report to argv[1].

Checks, in one launch (torch imports dominate the cost):
  control_engine   a scheduler-like child spawned straight from this worker (no scrub): its tcp:// rendezvous must
                   fail (the bug this file exists for; if it passed, the test would prove nothing)
  engine           SGLangEngine with a stub sglang.Engine that spawns the same child: must succeed
  control_group    dist.rendezvous("tcp://...", rank 0) from this worker (the old weight-group code): must fail
  server_group     SGLangServerEngine.begin_weight_update + update_weights, the servers played by a spawned process
                   that joins the group as SGLang's receiver does and checks the broadcast tensor: must succeed
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.net import free_port

CHILD_TIMEOUT_S = 4.0


def scheduler_child(port: int, timeout_s: float, queue) -> None:
    """What an SGLang scheduler does first (sglang/srt/distributed/parallel_state.py init_distributed_environment,
    single node: init_method tcp://127.0.0.1:<nccl_port> from srt/distributed/bootstrap.py)."""
    seen = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "RANK", "MASTER_PORT")}
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=1,
            rank=0,
            timeout=timedelta(seconds=timeout_s),
        )
        dist.destroy_process_group()
        queue.put({"ok": True, "env": seen})
    except Exception as err:  # reported to the parent
        queue.put({"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}", "env": seen})


def run_scheduler_child(ctx) -> dict:
    """Spawn scheduler_child as SGLang does (multiprocessing "spawn", parent's environment) and wait for it."""
    queue = ctx.Queue()
    proc = ctx.Process(target=scheduler_child, args=(free_port(), CHILD_TIMEOUT_S, queue))
    proc.start()
    result = queue.get(timeout=CHILD_TIMEOUT_S + 60)
    proc.join(timeout=30)
    return result


class StubEngine:
    """Stands in for sglang.Engine: launching its scheduler process is the only thing it does."""

    last_child: dict | None = None

    def __init__(self, **server_args) -> None:
        StubEngine.last_child = run_scheduler_child(mp.get_context("spawn"))
        if not StubEngine.last_child["ok"]:
            raise RuntimeError(f"scheduler died: {StubEngine.last_child['error']}")
        self.server_args = server_args
        self.tokenizer_manager = types.SimpleNamespace(signal_handler_class=object)  # the adapter replaces it

    def shutdown(self) -> None:
        pass


def install_stub_sglang() -> None:
    """sys.modules entries for the names SGLangEngine.__init__ imports (sglang has no CPU build)."""
    names = ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.utils.patch_torch")
    names += ("sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket")
    mods = {n: types.ModuleType(n) for n in names}
    mods["sglang"].Engine = StubEngine
    mods["sglang.srt.utils.common"].MultiprocessingSerializer = types.SimpleNamespace(serialize=lambda obj: b"")
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: None
    mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = dict
    sys.modules.update(mods)


def receiver(body: dict, expected: list, queue) -> None:
    """An SGLang server's side of the weight-update group (sglang/srt/utils/common.py init_custom_process_group):
    dist.rendezvous on tcp://master_address:master_port at rank_offset, PrefixStore(group_name), gloo here."""
    from torch.distributed import distributed_c10d as c10d

    try:
        url = f"tcp://{body['master_address']}:{body['master_port']}"
        timeout = timedelta(seconds=30)
        store, rank, world = next(dist.rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout))
        store = dist.PrefixStore(body["group_name"], store)
        pg, _ = c10d._new_process_group_helper(
            world, rank, [], dist.Backend("gloo"), store, group_name=body["group_name"], timeout=timeout
        )
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
        queue.put({"joined": True})
        t = torch.zeros(len(expected))
        dist.broadcast(t, group_src=0, group=pg)
        queue.put({"ok": t.tolist() == expected, "got": t.tolist()})
    except Exception as err:
        queue.put({"joined": False, "ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"})


def server_group_check() -> dict:
    from megatron_dapo.rollout.sglang_engine import SGLangServerEngine

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    expected = [1.5, -2.0, 3.25]
    procs = []

    def fake_post(url: str, route: str, body: dict | None = None, data: bytes | None = None):
        if route == "/init_weights_update_group":
            # Not scrubbed: this runs on an HTTP thread beside the main thread's rendezvous, and os.environ is
            # process-wide. The receiver is a store client (rank >= 1) whatever its environment says.
            proc = ctx.Process(target=receiver, args=(body, expected, queue))
            proc.start()
            procs.append(proc)
            msg = queue.get(timeout=60)
            return {"success": bool(msg.get("joined")), "message": msg.get("error", "")}
        return {"success": True, "message": ""}

    eng = SGLangServerEngine(
        ["http://127.0.0.1:1"],
        master_address="127.0.0.1",
        master_port=free_port(),
        group_timeout_s=30.0,  # the receiver process needs a few seconds to import torch
        backend="gloo",
    )
    eng._post = fake_post
    try:
        eng.begin_weight_update()
        eng.update_weights([("w", torch.tensor(expected))])
        eng.end_weight_update()
        result = queue.get(timeout=60)
    except Exception as err:
        result = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    finally:
        eng.shutdown()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return result


def main(out_path: str) -> None:
    report: dict = {"agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}
    start = time.perf_counter()
    report["control_engine"] = run_scheduler_child(mp.get_context("spawn"))

    install_stub_sglang()
    from megatron_dapo.rollout.base import EngineLaunch
    from megatron_dapo.rollout.sglang_engine import SGLangEngine

    try:
        SGLangEngine(EngineLaunch("/nonexistent-model", seed=3))
        report["engine"] = StubEngine.last_child
    except Exception as err:
        report["engine"] = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    report["agent_store_after"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")

    try:
        url = f"tcp://127.0.0.1:{free_port()}"
        store, _, _ = next(dist.rendezvous(url, 0, 1, timeout=timedelta(seconds=CHILD_TIMEOUT_S)))
        report["control_group"] = {"ok": True}
    except Exception as err:
        report["control_group"] = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}

    report["server_group"] = server_group_check()
    report["seconds"] = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
