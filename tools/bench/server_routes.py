"""A split launch's weight push into an SGLang server: actor rank 0's broadcast (full, then with deltas through the
server's delta loader) against the direct route's relay through the engine rank (full, then with deltas), side by
side in one run on this CPU.

Example:
    OMP_NUM_THREADS=1 python tools/bench/server_routes.py      # actor TP 2 + 1 engine rank + 1 stand-in server

One `torchrun --rdzv-backend c10d` launch split as the trainer splits it (placement.init_role): 2 actor ranks hold a
Megatron actor at TP 2 of a Qwen2-shaped checkpoint (dev/tiny.make_sync_bench_model, 43M parameters, exported in
bf16), 1 engine rank drives one stand-in SGLang server (megatron_dapo/dev/cpu_sglang_server.py: SGLang's
weight-update routes and pause over the embedded engine). Before every push each actor rank moves every weight by a
relative step of --step (seeded: replicated weights move alike on every rank). In turn, --repeats pushes each:
    rank0:        every actor rank walks export_hf_weights (TP gathers) and actor rank 0 broadcasts the full tensors
                  into the server's weight-update group under its pause (placement.ServerPush)
    relay:        every actor rank sends its shards to the engine rank (placement.DirectChannel), which streams the
                  tensors into the server under its pause as they are rebuilt (placement.relay_push: RelayReceiver's)
    relay+delta:  the same with rollout.weight_sync_delta: each actor rank sends its shards' changed elements, the
                  engine rank forwards them to the server's delta loader at the HF tensors' positions (it keeps no
                  base; after one full push, not timed)
    rank0+delta:  rank0 with rollout.weight_sync_delta: actor rank 0 posts the changed elements to the server's
                  /update_weights_from_tensor, where rollout/sglang_loader.py writes them in place (the server is
                  started with --custom-weight-loader; after one full push, not timed)
Seconds, median of the repeats: "actor" from the push's start (the actor ranks leave a barrier) until every actor rank
is free to train again; "server" until the server holds the version. After each route the server's weights are
compared with the actor's export (bit for bit, in the engine's fp32). Rows go to results/server_routes.csv, a table
to docs/benchmarks.md ("## Weight sync into SGLang servers: rank 0 vs relay").
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

from megatron_dapo.rollout.sglang_loader import LOADER

HEADING = "## Weight sync into SGLang servers: rank 0 vs relay"
ROUTES = ("rank0", "relay", "relay+delta", "rank0+delta")
BUCKET = 64 << 20


def _move(model, version: int, step: float) -> None:
    """Every weight times (1 + step x noise), the noise seeded by (version, parameter name): a replicated weight moves
    alike on every TP rank."""
    import zlib

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(version * 1_000_003 + zlib.crc32(name.encode()))
            p.mul_(1 + step * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _engine(placement, store, hf_config, tp: int, url: str, versions: list[int], out: Path) -> None:
    from megatron_dapo.net import free_port
    from megatron_dapo.placement import DirectChannel
    from megatron_dapo.placement import relay_push
    from megatron_dapo.rollout.sglang_engine import SGLangServerEngine

    channel = DirectChannel(placement, store, 600.0, hf_config=hf_config, actor_tp=tp, delta=True, forward=True)
    server = SGLangServerEngine([url], master_port=free_port(), backend="gloo", delta_loader=True)
    for version in versions:
        while channel.pending() != version:
            time.sleep(0.001)
        relay_push(channel, server, BUCKET)
        store.set(f"bench/done/{version}", repr(time.time()))
    server.shutdown()
    (out / "engine.json").write_text(json.dumps({"ok": True}))


def _worker(out: Path, tp: int, hf_dir: Path, url: str, repeats: int, step: float) -> None:
    import torch
    from transformers import AutoConfig

    from megatron_dapo.placement import DirectChannel
    from megatron_dapo.placement import ServerPush
    from megatron_dapo.placement import init_role

    placement, store = init_role(1, timeout_s=600.0)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    schedule = [("rank0", True)] * repeats + [("relay", True)] * repeats
    schedule += [("relay+delta", False)] + [("relay+delta", True)] * repeats  # the first delta-mode push is full
    schedule += [("rank0+delta", False)] + [("rank0+delta", True)] * repeats
    relayed = [v for v, (route, _) in enumerate(schedule, start=1) if route.startswith("relay")]
    if placement.is_engine:
        _engine(placement, store, hf_config, tp, url, relayed, out)
        os._exit(0)

    from megatron_dapo.actor import reshard
    from megatron_dapo.actor.distributed import init_distributed
    from megatron_dapo.actor.hf_weights import export_hf_weights
    from megatron_dapo.actor.hf_weights import load_hf_into_model
    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.config import ActorConfig
    from megatron_dapo.net import free_port
    from megatron_dapo.rollout.delta import DeltaEncoder
    from megatron_dapo.rollout.exchange import RolloutExchange
    from megatron_dapo.rollout.sglang_engine import SGLangServerEngine

    groups = init_distributed(tp, 1)
    model = build_gpt_model(hf_config, ActorConfig(model_path=str(hf_dir), tensor_parallel=tp, dtype="fp32"), groups)
    load_hf_into_model([model], hf_dir, hf_config, groups)
    exchange = RolloutExchange(groups.world_size, timeout_s=600.0)
    plan = reshard.transfer_plan(hf_config, reshard.Layout.gather(groups))
    direct = DirectChannel(placement, store, 600.0)
    pusher = None
    if groups.rank == 0:
        server = SGLangServerEngine([url], master_port=free_port(), backend="gloo", delta_loader=True)
        pusher = ServerPush(server, store)
    encoder, server_encoder, rows = DeltaEncoder(), DeltaEncoder(), []
    for version, (route, timed) in enumerate(schedule, start=1):
        _move(model, version, step)
        exchange.barrier()
        start = time.time()
        if route.startswith("rank0"):
            named = export_hf_weights([model], hf_config, groups)
            if pusher is not None:
                metrics = pusher.push(version, named, BUCKET, encoder=server_encoder if route != "rank0" else None)
            else:
                for _ in named:
                    pass
        else:
            pieces = reshard.owned_shards([model], hf_config, groups, plan)
            metrics = direct.push(version, pieces, BUCKET, encoder=encoder if route == "relay+delta" else None,
                                  gather=lambda x: exchange.all_gather([x], "bench"))  # fmt: skip
        exchange.barrier()
        free = time.time()
        last = schedule[version % len(schedule)][0] != route or version == len(schedule)
        export = {n: t for n, t in export_hf_weights([model], hf_config, groups)} if last else None
        if groups.rank == 0:
            held = free if route.startswith("rank0") else float(store.get(f"bench/done/{version}"))  # the relay's
            if timed:
                rows.append({"route": route, "actor_s": free - start, "server_s": held - start,
                             "mb": metrics["weight_sync/bytes"] / 1e6,
                             "changed": metrics.get("weight_sync/changed_fraction", float("nan"))})  # fmt: skip
            if export is not None:
                torch.save(export, out / f"export_{version}.pt")
    if groups.rank == 0:
        (out / "actor0.json").write_text(json.dumps(rows))
    exchange.barrier()
    os._exit(0)


def _server(model: Path, dumps: Path, log) -> tuple[subprocess.Popen, str]:
    port_file = dumps / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_dapo.dev.cpu_sglang_server", "--model", str(model), "--max-new-tokens", "8",
         "--port-file", str(port_file), "--dump-dir", str(dumps), "--custom-weight-loader", LOADER],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for _ in range(1200):
        if port_file.exists() and port_file.read_text():
            return proc, f"http://127.0.0.1:{port_file.read_text()}"
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise SystemExit(f"server_routes: the stand-in server did not start (see {log.name})")


def _same(dumped: Path, exported: Path) -> bool:
    import torch

    engine, export = torch.load(dumped, weights_only=True), torch.load(exported, weights_only=True)
    return bool(export) and all(torch.equal(engine[k], v.to(engine[k].dtype)) for k, v in export.items())


def _run(hf_dir: Path, repeats: int, step: float) -> tuple[dict, bool]:
    from megatron_dapo.net import free_port

    out = Path(tempfile.mkdtemp(prefix="server_routes_"))
    dumps = out / "dumps"
    dumps.mkdir()
    with open(out / "server.log", "w") as log:
        server, url = _server(hf_dir, dumps, log)
        try:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1", "--nproc-per-node=3", "--max-restarts=0",
                   __file__, "--worker", str(out), "2", str(hf_dir), url, str(repeats), str(step)]  # fmt: skip
            proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                  timeout=3600)  # fmt: skip
        finally:
            server.kill()
            server.wait()
    if proc.returncode != 0:
        raise SystemExit(f"server_routes: the launch failed:\n{proc.stderr[-3000:]}")
    rows = json.loads((out / "actor0.json").read_text())
    same = all(_same(dumps / f"v{p.stem.split('_')[1]}.pt", p) for p in out.glob("export_*.pt"))
    result = {}
    for route in ROUTES:
        mine = [r for r in rows if r["route"] == route]
        result[route] = {k: statistics.median(r[k] for r in mine) for k in ("actor_s", "server_s", "mb", "changed")}
    return result, same and len(list(out.glob("export_*.pt"))) == len(ROUTES)


def main() -> None:
    import torch

    from megatron_dapo.dev import REPO_ROOT
    from megatron_dapo.dev import replace_doc_section
    from megatron_dapo.dev.tiny import make_sync_bench_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step", type=float, default=1e-3, help="relative move of every weight between pushes")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out, tp, hf_dir, url, repeats, step = args.worker
        _worker(Path(out), int(tp), Path(hf_dir), url, int(repeats), float(step))
        return
    hf_dir = make_sync_bench_model(Path(tempfile.mkdtemp(prefix="server_routes_ckpt_")) / "qwen2", torch.bfloat16)
    result, same = _run(hf_dir, args.repeats, args.step)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    raw = REPO_ROOT / "results" / "server_routes.csv"
    raw.parent.mkdir(exist_ok=True)
    new = not raw.exists()
    table = []
    with open(raw, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["date", "route", "actor_s", "server_s", "sent_mb", "changed_fraction", "server_equal"])
        base = result["rank0"]["actor_s"]
        for route in ROUTES:
            r = result[route]
            writer.writerow([when, route, f"{r['actor_s']:.4f}", f"{r['server_s']:.4f}", f"{r['mb']:.1f}",
                             f"{r['changed']:.4f}", same])  # fmt: skip
            changed = "-" if r["changed"] != r["changed"] else f"{r['changed']:.3f}"  # NaN: not a delta push
            table.append(f"| {route} | {r['actor_s']:.3f} | {base / r['actor_s']:.2f}x | {r['server_s']:.3f} | "
                         f"{r['mb']:.0f} | {changed} |")  # fmt: skip
            print(table[-1], flush=True)
    section = (
        f"{HEADING}\n\nWritten by `tools/bench/server_routes.py` ({when}, this machine's 2 CPU cores, one run, every "
        "rank a process under `torchrun --rdzv-backend c10d` beside one stand-in SGLang server, "
        "`megatron_dapo/dev/cpu_sglang_server.py`): a Qwen2-shaped model of 43M parameters exported in bf16 "
        "from a Megatron actor at TP 2 into the server, every weight moved by a relative step of "
        f'{args.step:g} before each push, median of {args.repeats}. "actor s": until every actor rank is free to '
        'train again; "server s": until the server holds the version; sent MB: what the actor ranks sent (rank0: '
        "into the server, before base64; relay: to the engine rank, which streams them into the server)."
        "\n\n"
        "| route | actor s | rank0 actor s / this | server s | sent MB | changed fraction |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(table)
        + f"\n\nThe server's weights equal the actor's export after each route: {'yes' if same else 'NO'}. "
        "What the relay changes is who waits: on the rank-0 route actor rank 0 is busy until the server has loaded "
        "every tensor; on the relay the engine rank streams the tensors into the server as it rebuilds them, holding "
        "a bucket per sender and RECEIVE_AHEAD buckets of rebuilt tensors (placement.DirectChannel.stream), so the "
        "actor ranks are free once the server has taken all but that window: here, with 64 MiB buckets, that window "
        "is most of this small model; for a model many buckets large the actor ranks keep the server's pace. With "
        "deltas the actor ranks send only the changed elements and the server receives only those, from actor rank 0 "
        "or forwarded by the engine rank (base64 in the HTTP body, once per server: its TP rank 0 hands them on), "
        "and its delta loader writes them in place. On a GPU cluster the relay pays when the "
        "engine rank runs on its servers' node, "
        'the loader where the changed fraction is small against a full NCCL broadcast (docs/rollout.md, "Weight '
        'sync routes"; modelled in docs/planning.md, "Weight sync at scale"). Raw rows: `results/server_routes.csv`.\n'
    )
    replace_doc_section(REPO_ROOT / "docs" / "benchmarks.md", HEADING, section)


if __name__ == "__main__":
    main()
