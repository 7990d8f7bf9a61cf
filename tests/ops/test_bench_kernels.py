"""tools/bench/logprob_kernels.py: a tiny CPU run writes one well-formed CSV row (no timing assertions)."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench" / "logprob_kernels.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("logprob_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("logprob_kernels", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_run_appends_row(tmp_path):
    bench = _load_module()
    out = tmp_path / "bench.csv"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--configs", "tiny", "--ops", "logprob_entropy"]
    cmd += ["--modes", "forward", "--providers", "ours", "--reps", "1", "--no-interp-check", "--in-process"]
    # TRITON_INTERPRET=0: the chunked CPU path, as in a real CPU run (conftest turns the interpreter on)
    env["TRITON_INTERPRET"] = "0"
    cmd += ["--csv", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == bench.COLUMNS
        rows = list(reader)
    assert len(rows) == 1
    row = rows[0]
    assert (row["op"], row["provider"], row["mode"], row["config"], row["device"]) == (
        "logprob_entropy",
        "ours",
        "forward",
        "tiny",
        "cpu",
    )
    assert not row["note"].startswith("error"), row["note"]
    shape = bench.MODEL_CONFIGS["tiny"]
    assert (int(row["tokens"]), int(row["vocab"]), row["dtype"]) == (shape.tokens, shape.vocab, shape.dtype)
    for key in ("ms_median", "ms_p20", "ms_p80", "peak_extra_mb", "saved_bytes_per_token", "gbps"):
        float(row[key])  # present and numeric
    # the chunked CPU path keeps [3, T] fp32 beyond its inputs
    assert float(row["saved_bytes_per_token"]) == 12.0
    assert row["gpu_name"].startswith("cpu:") and "torch-" in row["version"] and "triton-" in row["version"]


def test_shapes_come_from_named_configs_and_bad_provider_is_refused():
    bench = _load_module()
    assert bench.MODEL_CONFIGS["qwen2.5-7b"].hidden == 3584 and bench.MODEL_CONFIGS["qwen2.5-7b"].vocab == 152064
    assert bench.MODEL_CONFIGS["cpu-small"] == bench.ModelShape(hidden=1024, vocab=32000, tokens=4096, dtype="float32")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--providers", "nope"])
    assert bench.traffic_bytes("logprob_entropy", "forward", bench.MODEL_CONFIGS["tiny"]) == 64 * 512 * 4 + 24 * 64
    assert bench.matmul_flops("linear_logprob_entropy", "full", bench.MODEL_CONFIGS["tiny"]) == 6 * 64 * 64 * 512
