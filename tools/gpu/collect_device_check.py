"""File what tools/gpu/device_check.sh brought back from a GPU into results/.

    python tools/gpu/collect_device_check.py /work/.device/<files_at>     (or the device_check output folder)

- bench_kernels.csv rows are appended to results/bench_kernels.csv (rows already there, same timestamp, op,
  provider, mode and config, are skipped; a header that differs from the bench's columns is an error);
- actor_step_gpu.json / .md, summary.txt and bench.log are copied to results/gpu/<tag>_<name>, tag =
  <gpu>_<date> from the benchmark's rows (e.g. h200_2026-12-05);
- the issue's target lines (summary.txt) are printed.
Then fill docs/benchmarks.md "Kernels / GPU" from the printed lines and the copied tables.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import sys
from pathlib import Path

from megatron_dapo.dev import REPO_ROOT

COPIED = ("actor_step_gpu.json", "actor_step_gpu.md", "summary.txt", "bench.log")
KEY = ("timestamp", "op", "provider", "mode", "config")


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def tag_of(rows: list[dict]) -> str:
    """<gpu>_<date> from the first row with a GPU name, e.g. ('NVIDIA H200', 2026-12-05T...) -> h200_2026-12-05."""
    for row in rows:
        if row.get("gpu_name") and not row["gpu_name"].startswith("cpu"):
            gpu = row["gpu_name"].split()[-1].lower()
            return f"{re.sub(r'[^a-z0-9]+', '', gpu)}_{row['timestamp'][:10]}"
    raise ValueError("bench_kernels.csv: no row with a GPU name (was it a GPU run?)")


def collect(src: Path, results: Path) -> list[str]:
    """Append the benchmark rows and copy the reports; returns what was done, one line each."""
    done = []
    bench = src / "bench_kernels.csv"
    if not bench.exists():
        raise FileNotFoundError(f"{bench}: missing (the kernel benchmark did not run?)")
    head, new = _rows(bench)
    target = results / "bench_kernels.csv"
    old_head, old = _rows(target) if target.exists() else (head, [])
    if head != old_head:
        raise ValueError(f"{bench}: columns {head} differ from {target}'s {old_head}")
    seen = {tuple(r[k] for k in KEY) for r in old}
    fresh = [r for r in new if tuple(r[k] for k in KEY) not in seen]
    with target.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=head)
        if not old and not target.stat().st_size:
            writer.writeheader()
        writer.writerows(fresh)
    done.append(f"{target}: +{len(fresh)} rows ({len(new) - len(fresh)} already there)")
    tag = tag_of(new)
    (results / "gpu").mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (src / name).exists():
            dst = results / "gpu" / f"{tag}_{name}"
            shutil.copyfile(src / name, dst)
            done.append(f"{dst}")
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="the folder device_check.sh wrote ($OUT)")
    p.add_argument("--results", type=Path, default=REPO_ROOT / "results")
    args = p.parse_args(argv)
    try:
        for line in collect(args.src, args.results):
            print(line)
    except (OSError, ValueError) as exc:
        print(f"collect_device_check: {exc}", file=sys.stderr)
        return 2
    summary = args.src / "summary.txt"
    if summary.exists():
        print(summary.read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
