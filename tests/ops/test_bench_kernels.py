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


def test_target_report_from_synthetic_rows():
    """Issue 36's targets read from one run's rows: ratios to Liger's FLCE, torch.compile and the recompute limit
    (4 x 2THV at the run's measured GEMM rate), memory, the 7B shape's absolute times, bandwidth shares, twins."""
    bench = _load_module()

    def row(op, provider, mode, config="qwen2.5-7b", **kw):
        return dict(dict.fromkeys(bench.COLUMNS, ""), op=op, provider=provider, mode=mode, config=config, **kw)

    lin, lp = "linear_logprob_entropy", "logprob_entropy"
    rows = [
        dict(dict.fromkeys(bench.COLUMNS, ""), op="device_matmul", provider="torch", tflops=790.0),
        row(lin, "ours", "full", ms_median=27.0, peak_extra_mb=1170.0),
        row(lin, "ours", "forward", ms_median=9.5, peak_extra_mb=16.1),
        row(lin, "liger_flce", "full", ms_median=47.3, peak_extra_mb=1126.0),
        row(lin, "torch_compile", "full", ms_median=24.0, peak_extra_mb=7300.0),
        row(lp, "ours", "forward", ms_median=1.0, bw_share=0.80),
        row(lp, "ours", "backward", ms_median=1.0, bw_share=0.90),
        row(lp, "cuda_twin", "backward", ms_median=1.2),
    ]
    report = "\n".join(bench.target_report(rows))
    # recompute limit: 8 x 4096 x 3584 x 152064 / 790e12 = 22.6 ms -> 27 / 22.6 = 1.19
    assert "fwd+bwd ours / liger_flce 0.57 (target <= 0.63): met" in report
    assert "fwd+bwd ours / torch_compile 1.12 (target <= 1.25): met" in report
    assert "recompute limit 22.6 ms = 1.19 (target <= 1.3): met" in report
    assert "fwd+bwd peak extra 1.143 GiB (target <= 1.2): met" in report
    assert "fwd+bwd 27.0 ms (target <= 30.0): met" in report
    assert "forward peak extra 16.1 MiB (target <= 16.0): MISSED" in report
    assert "forward 9.5 ms (target <= 9.0): MISSED" in report
    assert "forward at 0.80 of the copy bandwidth (target >= 0.85): MISSED" in report
    assert "backward at 0.90 of the copy bandwidth (target >= 0.85): met" in report
    assert "CUDA twin / Triton backward 1.20 (target <= 1.25): met" in report


def test_tile_budget_arguments():
    bench = _load_module()
    assert bench.parse_tile_budget("4M/8M") == (4 << 20, 8 << 20)
    assert bench.parse_tile_budget("512k/1048576") == (512 << 10, 1 << 20)
    for bad in ("4M", "x/8M", "0/1M", ""):
        with pytest.raises(Exception, match="FORWARD/BACKWARD"):
            bench.parse_tile_budget(bad)
    args = bench.parse_args(["--device", "cpu", "--tile-budgets", "2M/8M", "4M/16M"])
    assert args.tile_budgets == ["2M/8M", "4M/16M"]
    assert bench._applicable("linear_logprob_entropy", "ours@2M/8M", "cuda")
    assert not bench._applicable("linear_logprob_entropy", "ours@2M/8M", "cpu")
    assert bench.MODEL_CONFIGS["qwen2.5-7b-tp4"].vocab == 152064 // 4 and "qwen2.5-7b-tp4" in bench.GPU_CONFIGS
