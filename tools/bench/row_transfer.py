"""A split launch's step data, engine rank 0 -> actor ranks: through the store (before issue 39 item 3) against the
row channel (megatron_dapo/row_channel.py), side by side in one run on this machine's CPUs.

Example:
    OMP_NUM_THREADS=1 python tools/bench/row_transfer.py   # steps of 256 x 2048 and 512 x 4096 (rows x tokens)

Each case runs A actor processes and one engine process over a TCPStore hosted by actor rank 0 (as a launch's):
    store:    engine rank 0 posts the step's StepGeneration with every row (wire.py) on the store; every actor rank
              reads and decodes all of it (what placement.Mailbox carried before)
    channel:  engine rank 0 holds the rows (RowServer); every actor rank posts its request for its 1/A of them
              (the trainer's RowPlan gives each DP rank a share) and receives those only (RowClient)
Seconds: from the engine's post / hold until the last actor rank has its rows decoded, median of --repeats; a step
over the store's value limit (placement.STORE_VALUE_LIMIT, torch's 8 MiB) cannot go through the store at all. Rows go to
results/row_transfer.csv and a table to docs/benchmarks.md ("## Split launch: step data"), with the paper estimate
at the issue's scale (8192 rows x 20k tokens) from the constants below.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from datetime import datetime
from datetime import timedelta
from datetime import timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dapo import wire
from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.dev import replace_doc_section
from megatron_dapo.net import free_port
from megatron_dapo.placement import STORE_VALUE_LIMIT
from megatron_dapo.placement import Mailbox
from megatron_dapo.placement import StepGeneration
from megatron_dapo.rollout import FinishReason
from megatron_dapo.rollout.types import Rollout
from megatron_dapo.rollout.types import RolloutGroup
from megatron_dapo.row_channel import RowClient
from megatron_dapo.row_channel import RowServer

# ---- paper estimate (issue 39 item 3's scale); the per-token bytes are what wire.py sends for a Rollout ----
PAPER_ROWS, PAPER_TOKENS = 8192, 20480
BYTES_PER_TOKEN = 4 + 4  # int32 response id + float32 engine log-prob (prompt ids once per row, routing excluded)
STORE_GBPS = 1.0  # assumption: one TCP connection into the store's host (c10d TCPStore: one server thread)
LINK_GBPS = 10.0  # assumption: gloo over a 100 Gb/s NIC's TCP, engine rank 0's outgoing link
PAPER_ACTOR_RANKS = 64  # DP ranks of a 16-node actor at TP 2 (128 GPUs)


def _step(rows: int, tokens: int) -> dict[str, RolloutGroup]:
    g = torch.Generator().manual_seed(0)
    groups = {}
    for k in range(0, rows, 16):
        size = min(16, rows - k)
        rollouts = [
            Rollout(torch.randint(0, 50000, (256,), generator=g), torch.randint(0, 50000, (tokens,), generator=g),
                    -torch.rand(tokens, generator=g), FinishReason.STOP, ((0, 1),))
            for _ in range(size)
        ]  # fmt: skip
        acc = torch.arange(size) % 2 == 0
        groups[f"g{k}"] = RolloutGroup(k, k, "1", rollouts, acc, acc.float() * 2 - 1, torch.zeros(size))
    return groups


def _worker(rank: int, actors: int, port: int, rows: int, tokens: int, repeats: int, out: dict) -> None:
    store = dist.TCPStore("127.0.0.1", port, actors + 1, is_master=rank == 0, timeout=timedelta(seconds=600))
    engine = rank == actors
    server = client = None
    if engine:
        server = RowServer(actors, store, 600.0)
    else:
        client = RowClient(rank, actors, store, 600.0)
    box, groups = Mailbox(store), _step(rows, tokens) if engine else None
    keys = [(k, i) for k in sorted(_step(rows, 1)) for i in range(min(16, rows - int(k[1:])))]
    mine = keys[rank::actors] if not engine else []
    times: dict[str, list[float]] = {}
    fits = len(wire.dumps(StepGeneration(0, groups=_step(rows, tokens)))) <= STORE_VALUE_LIMIT
    for mode in ("store", "channel") if fits else ("channel",):
        for r in range(repeats):
            store.set(f"go/{mode}/{r}/{rank}", "1")
            store.wait([f"go/{mode}/{r}/{x}" for x in range(actors + 1)])
            if engine:
                start = time.perf_counter()
                if mode == "store":
                    box.post(f"gen/{r}", StepGeneration(r, groups=groups))
                else:
                    server.hold(r, groups)
                store.wait([f"done/{mode}/{r}/{x}" for x in range(actors)])
                times.setdefault(mode, []).append(time.perf_counter() - start)
            else:
                if mode == "store":
                    got = box.take(f"gen/{r}", 600, "the step", "bench")
                    assert len(got.groups) == len(_step(rows, 1))
                else:
                    got = client.take(r, mine, None, lambda: True)
                    assert len(got) == len(mine)
                store.set(f"done/{mode}/{r}/{rank}", "1")
    if engine:
        out.update(times)
        out["bytes_store"] = len(wire.dumps(StepGeneration(0, groups=groups))) if fits else None
        out["bytes_channel"] = server.bytes_sent / repeats
        store.wait(["closed"])
        server.close()
    elif rank == 0:
        store.wait([f"done/channel/{repeats - 1}/{x}" for x in range(actors)])
        time.sleep(0.5)
        store.set("closed", "1")
        time.sleep(1.0)


def _run(actors: int, rows: int, tokens: int, repeats: int) -> dict:
    out = mp.Manager().dict()
    port = free_port()
    procs = [mp.Process(target=_worker, args=(r, actors, port, rows, tokens, repeats, out)) for r in range(actors + 1)]
    [p.start() for p in procs]
    [p.join(1800) for p in procs]
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"row_transfer: a process failed ({[p.exitcode for p in procs]})")
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["256x2048", "512x4096"], help="steps as ROWSxTOKENS")
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    results = []
    for size in a.sizes:
        rows, tokens = (int(x) for x in size.split("x"))
        for actors in a.actors:
            r = _run(actors, rows, tokens, a.repeats)
            fits = r["bytes_store"] is not None
            row = {"date": stamp, "rows": rows, "tokens": tokens, "actor_ranks": actors,
                   "store_s": statistics.median(r["store"]) if fits else None,
                   "channel_s": statistics.median(r["channel"]),
                   "store_mb_read": r["bytes_store"] * actors / 1e6 if fits else None,
                   "channel_mb_sent": r["bytes_channel"] / 1e6}  # fmt: skip
            results.append(row)
            print(row, flush=True)
    path = REPO_ROOT / "results" / "row_transfer.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        if new:
            w.writeheader()
        w.writerows(results)
    if not a.no_docs:
        replace_doc_section(REPO_ROOT / "docs" / "benchmarks.md", "## Split launch: step data", _doc(results, stamp))


def _doc(rows: list[dict], stamp: str) -> str:
    step_gb = PAPER_ROWS * PAPER_TOKENS * BYTES_PER_TOKEN / 1e9
    store_s = PAPER_ACTOR_RANKS * step_gb / STORE_GBPS
    channel_s = step_gb / LINK_GBPS
    lines = [
        "## Split launch: step data",
        "",
        f"Written by `tools/bench/row_transfer.py` ({stamp}, this machine's CPUs, one run): a step's rows (prompts "
        "of 256 tokens) moved from engine rank 0 to the actor ranks, through the store as before (every actor rank "
        "reads every row) and over the row channel (`megatron_dapo/row_channel.py`: each actor rank receives its "
        "share). Seconds until the last actor rank holds its rows decoded, median of the repeats. A step over the "
        f"store's {STORE_VALUE_LIMIT / 2**20:g} MiB per value (torch's TCPStore) cannot go through it at all: the "
        'split launch died with "Connection reset by peer" there.',
        "",
        "| rows x tokens | actor ranks | store s | channel s | store / channel | MB read from the store | MB sent |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["store_s"] is None:
            store = f"over the limit | {r['channel_s']:.3f} | | over the limit"
        else:
            ratio = r["store_s"] / r["channel_s"]
            store = f"{r['store_s']:.3f} | {r['channel_s']:.3f} | {ratio:.1f}x | {r['store_mb_read']:.0f}"
        lines.append(f"| {r['rows']} x {r['tokens']} | {r['actor_ranks']} | {store} | {r['channel_mb_sent']:.0f} |")
    limit_mib = STORE_VALUE_LIMIT / 2**20
    lines += [
        "",
        f"On paper at the issue's scale ({PAPER_ROWS} rows x {PAPER_TOKENS} tokens, {BYTES_PER_TOKEN} bytes per "
        f"token: {step_gb:.1f} GB per step, MoE routing excluded) with {PAPER_ACTOR_RANKS} actor DP ranks: through "
        f"the store the step could not go at all ({step_gb:.1f} GB against {limit_mib:g} MiB per value); were the "
        f"limit lifted, every rank would read the whole step over the store host's connection, {PAPER_ACTOR_RANKS} "
        f"x {step_gb:.1f} GB at ~{STORE_GBPS:g} GB/s = {store_s:,.0f} s per step; over the row channel engine rank 0 "
        f"sends each byte once, {step_gb:.1f} GB at ~{LINK_GBPS:g} GB/s (gloo over a 100 Gb/s NIC) = "
        f"{channel_s:.1f} s, and each actor rank receives 1/{PAPER_ACTOR_RANKS} of it. Both rates are assumptions, "
        "not measured here. Raw rows: `results/row_transfer.csv`.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
