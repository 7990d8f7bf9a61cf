"""Start-up time and memory of the training data at DAPO-Math-17k's published size (1.79 M rows), before and after the
prompt cache (megatron_dapo/data/cache.py).

The file is synthetic and built like the published one: 17,917 distinct problems in DAPO's prompt format, each row
repeated ~100 times (1,791,700 rows), as parquet. Each arm loads it as one trainer rank does (PromptDataset with the
SmolLM2 tokenizer, data.max_prompt_length 2048) in a fresh process, which reports its wall time and peak RSS:

    legacy       no de-duplication, no cache: what every rank did at every start before the cache
    dedup        duplicates dropped, no cache: every rank still parses every row
    cache_cold   the first start: one process builds the cache entry (parse, de-duplicate, tokenise, write)
    cache_warm   every later start: the entry is mapped, nothing is parsed or tokenised
    cache_warm_x2  two processes at once on the warm entry (two ranks of a node): the slower one's time, the sum of
                 their peak RSS (mapped pages they share count in both)
Peak RSS (the process's VmHWM: ru_maxrss would start from the parent's RSS at fork) includes the interpreter, torch
and transformers (~0.36 GiB); "data" is the peak minus the RSS just before the dataset loads.

    python tools/data/startup_at_scale.py run [--rows-per-problem 100] [--arms ...]   # rows to results/data_startup.csv
    python tools/data/startup_at_scale.py report                                      # the markdown table

`run` takes ~15 min on the 2-core CPU machine (legacy tokenises 1.79 M prompts); the file needs ~0.1 GB of disk.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from datetime import timezone
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT

CSV = REPO_ROOT / "results" / "data_startup.csv"
PROBLEMS = 17_917
ARMS = ("legacy", "dedup", "cache_cold", "cache_warm", "cache_warm_x2")
FIELDS = ["date", "arm", "rows", "problems", "kept", "seconds", "peak_rss_mib", "data_rss_mib", "processes"]

_CHILD = r"""
import json, sys, time
start = time.monotonic()
from transformers import AutoTokenizer
from megatron_dapo.data import PromptDataset
path, tok_dir, cache_dir, dedup = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4] == "1"
tok = AutoTokenizer.from_pretrained(tok_dir)
before = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS:")) / 1024
t0 = time.monotonic()
data = PromptDataset([path], tokenizer=tok, max_prompt_length=2048, drop_duplicates=dedup, cache_dir=cache_dir,
                     log=lambda line: print(line, file=sys.stderr))
n = len(data); first = data.examples[0].index; last = data.examples[n - 1].index  # touch both ends
peak = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")) / 1024
print(json.dumps({"seconds": time.monotonic() - t0, "kept": n, "peak_rss_mib": peak, "data_rss_mib": peak - before}))
"""


def make_file(path: Path, rows_per_problem: int, seed: int = 0) -> int:
    """The synthetic DAPO-Math-17k-sized parquet file; returns its row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_dapo.data.templates import DAPO_TEMPLATE

    rng = random.Random(seed)
    words = "let find the number of positive integers such that sum product prime divisor triangle area".split()
    problems = []
    for i in range(PROBLEMS):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 120)))
        question = f"Problem {i}: {text}. Compute {rng.randint(2, 999)} modulo {rng.randint(2, 99)}."
        problems.append(
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(question=question)}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(rng.randint(0, 999)), "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"{i:08d}"},
            }
        )
    order = [i for i in range(PROBLEMS) for _ in range(rows_per_problem)]
    rng.shuffle(order)
    writer = None
    for start in range(0, len(order), 100_000):
        table = pa.Table.from_pylist([problems[i] for i in order[start : start + 100_000]])
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return len(order)


def _child(path: Path, tok_dir: str, cache_dir: str, dedup: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path), tok_dir, cache_dir, "1" if dedup else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"error: an arm failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
    return json.loads(out.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> None:
    from megatron_dapo.dev import hub

    tok_dir = str(hub.default_cache_dir())
    if not hub.is_prepared(tok_dir):
        hub.prepare_smollm2(tok_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path, cache = Path(tmp) / "dapo_math_17k_like.parquet", Path(tmp) / "cache"
        rows = make_file(path, args.rows_per_problem)
        print(f"{path.name}: {rows} rows, {path.stat().st_size / 2**20:.0f} MiB", flush=True)
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        new = CSV.exists()
        CSV.parent.mkdir(parents=True, exist_ok=True)
        with CSV.open("a", newline="") as f:
            out = csv.DictWriter(f, FIELDS)
            if not new:
                out.writeheader()
            for arm in args.arms:
                cached = arm.startswith("cache")
                procs = [_child(path, tok_dir, str(cache) if cached else "", arm != "legacy")]
                if arm == "cache_warm_x2":
                    procs.append(_child(path, tok_dir, str(cache), True))
                results = [_result(p) for p in procs]
                total = {key: round(sum(r[key] for r in results)) for key in ("peak_rss_mib", "data_rss_mib")}
                seconds = round(max(r["seconds"] for r in results), 2)
                row = {"date": date, "arm": arm, "rows": rows, "problems": PROBLEMS, "kept": results[0]["kept"],
                       "seconds": seconds, **total, "processes": len(procs)}  # fmt: skip
                out.writerow(row)
                f.flush()
                print(row, flush=True)


def report(_: argparse.Namespace) -> None:
    rows = list(csv.DictReader(CSV.open()))
    latest = {r["arm"]: r for r in rows}
    print("| arm | rows | prompts kept | seconds | peak RSS (MiB) | of which the data (MiB) | processes |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for arm in ARMS:
        if arm in latest:
            r = latest[arm]
            print(f"| {arm} | {int(r['rows']):,} | {int(r['kept']):,} | {float(r['seconds']):.1f} | "
                  f"{int(r['peak_rss_mib']):,} | {int(r['data_rss_mib']):,} | {r['processes']} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("--rows-per-problem", type=int, default=100)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.set_defaults(fn=run)
    sub.add_parser("report").set_defaults(fn=report)
    args = parser.parse_args()
    started = time.monotonic()
    args.fn(args)
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
