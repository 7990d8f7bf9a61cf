"""A split launch's weight push, rank-0 broadcast against direct resharding, side by side in one run on this CPU.

Example:
    OMP_NUM_THREADS=1 python tools/bench/reshard.py            # 2-4 ranks: actor TP 1 / 2 / DP 3 -> 1-2 engine ranks

Each case is one `torchrun --rdzv-backend c10d` launch split as the trainer splits it (placement.init_role): A actor
ranks hold a Megatron model (a Qwen2-shaped checkpoint of ~40M parameters, fp32) and E engine ranks receive, and
the two routes alternate, --repeats each:
    rank0:   every actor rank walks export_hf_weights (TP gathers, PP broadcasts) and actor rank 0 broadcasts the full
             tensors to the engine ranks (placement.WeightChannel)
    direct:  every actor rank sends the shards the transfer plan gives it (MegatronActor.owned_shards) to the engine
             ranks, which rebuild the HF tensors (placement.DirectChannel)
Seconds: from the push's start (every actor rank leaves a barrier) until the last engine rank holds the full tensors,
median of the repeats; "busiest link MB": what the most loaded actor rank sent. The engines' tensors are checked equal
between the routes. Rows go to results/reshard.csv, a table to docs/benchmarks.md ("## Weight sync: direct vs rank 0").
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from datetime import timezone
from pathlib import Path

CASES = [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 3, 1)]
"""(actor TP, actor DP, engine ranks): a launch of TP x DP + engine ranks processes (2-4)."""
HEADING = "## Weight sync: direct vs rank 0"


def _worker(out: Path, engines: int, tp: int, hf_dir: Path, repeats: int) -> None:
    import torch
    from transformers import AutoConfig

    from megatron_dapo.placement import DirectChannel
    from megatron_dapo.placement import WeightChannel
    from megatron_dapo.placement import init_role

    placement, store = init_role(engines, timeout_s=600.0)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    routes = ["rank0", "direct"] * repeats
    bucket = 64 << 20
    if placement.is_engine:
        rank0 = WeightChannel(placement, store, 600.0)
        direct = DirectChannel(placement, store, 600.0, hf_config=hf_config, actor_tp=tp)
        got = {}
        for version, route in enumerate(routes, start=1):
            channel = rank0 if route == "rank0" else direct
            while channel.pending() != version:
                time.sleep(0.001)
            _, buckets = channel.receive_buckets()
            store.set(f"bench/done/{version}/{placement.role_rank}", repr(time.time()))
            tensors = {n: t for b in buckets for n, t in b}
            if route not in got:
                got[route] = tensors
        same = list(got["rank0"]) == list(got["direct"]) and all(
            torch.equal(got["rank0"][n], got["direct"][n]) for n in got["rank0"]
        )
        (out / f"engine{placement.role_rank}.json").write_text(json.dumps({"same": same}))
    else:
        from megatron_dapo.actor import reshard
        from megatron_dapo.actor.distributed import init_distributed
        from megatron_dapo.actor.hf_weights import export_hf_weights
        from megatron_dapo.actor.hf_weights import load_hf_into_model
        from megatron_dapo.actor.model import build_gpt_model
        from megatron_dapo.config import ActorConfig
        from megatron_dapo.rollout.exchange import RolloutExchange

        groups = init_distributed(tp, 1)
        model = build_gpt_model(
            hf_config, ActorConfig(model_path=str(hf_dir), tensor_parallel=tp, dtype="fp32"), groups
        )
        load_hf_into_model([model], hf_dir, hf_config, groups)
        exchange = RolloutExchange(groups.world_size, timeout_s=600.0)
        plan = reshard.transfer_plan(hf_config, reshard.Layout.gather(groups))
        rank0 = WeightChannel(placement, store, 600.0) if groups.rank == 0 else None
        direct = DirectChannel(placement, store, 600.0)
        rows = []
        for version, route in enumerate(routes, start=1):
            exchange.barrier()
            start = time.time()
            if route == "rank0":
                named = export_hf_weights([model], hf_config, groups)
                if rank0 is not None:
                    metrics = rank0.push(version, named, bucket)
                    busiest = metrics["weight_sync/bytes"]
                else:
                    for _ in named:
                        pass
            else:
                pieces = reshard.owned_shards([model], hf_config, groups, plan)
                metrics = direct.push(version, pieces, bucket, gather=lambda x: exchange.all_gather([x], "bench"))
                busiest = metrics["weight_sync/max_sender_bytes"]
            if groups.rank == 0:
                done = [float(store.get(f"bench/done/{version}/{e}")) for e in range(engines)]  # waits for each
                rows.append({"route": route, "seconds": max(done) - start, "busiest_mb": busiest / 1e6})
        if groups.rank == 0:
            (out / "actor0.json").write_text(json.dumps(rows))
        exchange.barrier()
    os._exit(0)


def _launch(world: int, tp: int, engines: int, hf_dir: Path, repeats: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="reshard_bench_"))
    from megatron_dapo.net import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", f"--nproc-per-node={world}", "--max-restarts=0",
           __file__, "--worker", str(out), str(engines), str(tp), str(hf_dir), str(repeats)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"reshard bench: the launch of {world} ranks failed:\n{proc.stderr[-3000:]}")
    rows = json.loads((out / "actor0.json").read_text())
    same = all(json.loads((out / f"engine{e}.json").read_text())["same"] for e in range(engines))
    result = {"same": same}
    for route in ("rank0", "direct"):
        mine = [r for r in rows if r["route"] == route]
        result[route] = statistics.median(r["seconds"] for r in mine)
        result[f"{route}_mb"] = mine[0]["busiest_mb"]
    return result


def main() -> None:
    from megatron_dapo.dev import REPO_ROOT
    from megatron_dapo.dev import replace_doc_section
    from megatron_dapo.dev.tiny import make_sync_bench_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out, engines, tp, hf_dir, repeats = args.worker
        _worker(Path(out), int(engines), int(tp), Path(hf_dir), int(repeats))
        return
    hf_dir = make_sync_bench_model(Path(tempfile.mkdtemp(prefix="reshard_ckpt_")) / "qwen2")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    table, raw = [], REPO_ROOT / "results" / "reshard.csv"
    raw.parent.mkdir(exist_ok=True)
    new = not raw.exists()
    with open(raw, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["date", "world", "actor_tp", "actor_dp", "engines", "rank0_s", "direct_s",
                             "rank0_busiest_mb", "direct_busiest_mb", "same"])  # fmt: skip
        for tp, dp, engines in CASES:
            world = tp * dp + engines
            r = _launch(world, tp, engines, hf_dir, args.repeats)
            writer.writerow([when, world, tp, dp, engines, f"{r['rank0']:.4f}", f"{r['direct']:.4f}",
                             f"{r['rank0_mb']:.1f}", f"{r['direct_mb']:.1f}", r["same"]])  # fmt: skip
            table.append(f"| {tp} x DP {dp} | {engines} | {r['rank0']:.3f} | {r['direct']:.3f} | "
                         f"{r['rank0'] / r['direct']:.2f}x | {r['rank0_mb']:.0f} | {r['direct_mb']:.0f} | "
                         f"{'yes' if r['same'] else 'NO'} |")  # fmt: skip
            print(table[-1], flush=True)
    section = (
        f"{HEADING}\n\nWritten by `tools/bench/reshard.py` ({when}, this machine's 2 CPU cores, one run, every rank a "
        "process under `torchrun --rdzv-backend c10d`): a Qwen2-shaped model of 43M parameters in fp32 (172 MB) pushed "
        "from a Megatron actor to the engine ranks of a split launch, by the rank-0 route (every actor rank walks the "
        "export's gathers, rank 0 broadcasts every tensor) and by direct resharding (each actor rank sends its own "
        "shards, the engine ranks rebuild the tensors), alternating, median of "
        f"{args.repeats}. Seconds from the push's start to the last engine rank holding the full tensors.\n\n"
        "| actor TP x DP | engine ranks | rank-0 s | direct s | rank-0 / direct | rank-0 busiest link MB | "
        "direct busiest link MB | engines equal |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(table) + "\n\n"
        "What this CPU can show is the busiest link: the rank-0 route sends the whole model from one rank whatever "
        "the layout, direct resharding splits it over the actor ranks (each sends what it holds; data-parallel "
        "replicas share the pieces, largest first). With one actor rank both routes send the same bytes and direct "
        "adds the engine rank's rebuild of the tensors from pieces; with TP 2 the rank-0 route also pays the actor's "
        "all-gathers before its one sender starts. The seconds are 2 cores shared by up to 4 processes and a loopback "
        "link, so they measure contention more than bandwidth; at scale the per-link bytes are what the planner "
        'prices (docs/planning.md, "Weight sync at scale"). Raw rows: `results/reshard.csv`.\n'
    )
    replace_doc_section(REPO_ROOT / "docs" / "benchmarks.md", HEADING, section)


if __name__ == "__main__":
    main()
