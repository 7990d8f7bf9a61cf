"""tools/gpu/device_check.sh's harness (with a stub python: phase order, the deadline, at most 8 files back) and
tools/gpu/collect_device_check.py (rows and reports into results/), on CPU. What the phases measure is tested by
the tests and benchmarks they run."""

import csv
import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "gpu" / "device_check.sh"
COLLECT = REPO / "tools" / "gpu" / "collect_device_check.py"

STUB = """#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
case "$*" in
  *"pytest -m gpu tests/ops"*) sleep "${STUB_SLEEP:-0}"; echo "3 passed";;
  *logprob_kernels.py*) echo "L qwen2.5-7b: fwd+bwd 27.0 ms (target <= 30.0): met";;
esac
exit 0
"""


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.log"
    full = dict(os.environ, PYTHON=str(stub), OUT=str(out), WORK=str(tmp_path / "work"), STUB_LOG=str(log), **env)
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, out, calls


def test_every_phase_runs_in_order_and_at_most_8_files_come_back(tmp_path):
    proc, out, calls = _run(tmp_path)
    summary = (out / "summary.txt").read_text()
    order = ["build_cuda_twins", "kernel_tests", "kernel_bench", "tile_sweep", "actor_step", "actor_tests"]
    assert [line.split(":")[0] for line in summary.splitlines() if line.split(":")[0] in order] == order
    assert all(f"{name}: ok" in summary for name in order), summary
    assert "L qwen2.5-7b: fwd+bwd 27.0 ms (target <= 30.0): met" in summary  # the target lines
    # each benchmark ran with its arguments: every config, the tile sweep, the actor models under a time budget
    bench = [c for c in calls if "logprob_kernels.py" in c]
    assert "--configs qwen2.5-7b qwen2.5-7b-tp4 llama-3-8b qwen2.5-32b" in bench[0]
    assert "--tile-budgets 2M/8M 4M/4M 4M/16M 8M/16M" in bench[1]
    assert any("actor_step_gpu.py --models qwen2.5-0.5b qwen2.5-7b-l4 qwen2.5-1.5b --time-budget-s" in c for c in calls)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.txt", "bench.log", "logs.tar.gz"} <= set(files), files
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"./env.txt", "./pins.txt", "./build.log", "./summary.txt"} <= set(tar.getnames())
    # the run's status: 0 only when every phase ran and passed (the environment phase may fail on a machine without
    # nvidia-smi; the later phases ran all the same)
    assert proc.returncode == (1 if "FAILED" in summary else 0), summary


def test_the_deadline_skips_the_phases_it_cannot_fit(tmp_path):
    proc, out, calls = _run(tmp_path, DEADLINE_S="25", STUB_SLEEP="7")
    summary = (out / "summary.txt").read_text()
    assert "kernel_tests: ok" in summary
    for name in ("kernel_bench", "tile_sweep", "actor_step", "actor_tests"):
        assert f"{name}: SKIPPED (not run)" in summary, summary
    assert not any("logprob_kernels.py" in c for c in calls) and proc.returncode == 1


def _collect():
    spec = importlib.util.spec_from_file_location("collect_device_check", COLLECT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_collect_appends_new_rows_once_and_files_the_reports(tmp_path):
    bench = importlib.util.spec_from_file_location("logprob_kernels", REPO / "tools" / "bench" / "logprob_kernels.py")
    columns = importlib.util.module_from_spec(bench)
    sys.modules.setdefault("logprob_kernels", columns)
    bench.loader.exec_module(columns)
    src, results = tmp_path / "src", tmp_path / "results"
    src.mkdir()
    results.mkdir()
    row = dict.fromkeys(columns.COLUMNS, "")
    row.update(timestamp="2026-12-05T01:02:03+00:00", gpu_name="NVIDIA H200", op="linear_logprob_entropy",
               provider="ours", mode="full", config="qwen2.5-7b", ms_median="27.0")  # fmt: skip
    other = dict(row, mode="forward")
    for path, rows in ((src / "bench_kernels.csv", [row, other]), (results / "bench_kernels.csv", [other])):
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns.COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    (src / "summary.txt").write_text("kernel_tests: ok (60 s)\n")
    (src / "actor_step_gpu.md").write_text("| table |\n")
    collect = _collect()
    done = collect.collect(src, results)
    assert "+1 rows (1 already there)" in done[0]
    with (results / "bench_kernels.csv").open() as f:
        assert [r["mode"] for r in csv.DictReader(f)] == ["forward", "full"]
    assert (results / "gpu" / "h200_2026-12-05_summary.txt").read_text() == "kernel_tests: ok (60 s)\n"
    assert (results / "gpu" / "h200_2026-12-05_actor_step_gpu.md").exists()
    assert "+0 rows (2 already there)" in collect.collect(src, results)[0]  # idempotent
    (results / "bench_kernels.csv").write_text("a,b\n")
    assert collect.main([str(src), "--results", str(results)]) == 2  # columns differ: one line, nothing written
