"""tools/bench/actor_step_gpu.py: its FLOP formula by hand, its length mix, and a tiny CPU run of every arm (the
same code a GPU runs, on the CPU dispatch; no timing assertions)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "bench" / "actor_step_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("actor_step_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("actor_step_gpu", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_model_flops_by_hand():
    bench = _load()
    rows = bench.Rows(tokens=None, response=None, prompts=[3, 4], responses=[2, 1])
    # tiny: h 64, 2 layers, 4 heads x 16, 2 KV heads, ffn 96, V 512. Per layer: q, k, v 64 x (4 + 2 + 2) x 16 = 8192,
    # o 64 x 64 = 4096, gate/up/down 3 x 64 x 96 = 18,432 -> 30,720. Tokens 10: linear 2 x 10 x (2 x 30,720 + 64 x
    # 512) = 1,884,160; attention 4 x 2 layers x 64 x (5 x 6 / 2 + 5 x 6 / 2 = 30 causal pairs) = 15,360.
    assert bench.model_flops(bench.MODELS["tiny"], rows) == 1_884_160 + 15_360


def test_length_mix():
    bench = _load()
    rows = bench.make_rows(256, 16, 1000, 500, seed=3)
    assert len(rows.prompts) == 256 and all(200 <= p <= 300 for p in rows.prompts)
    assert all(len(set(rows.prompts[i : i + 16])) == 1 for i in range(0, 256, 16))  # a group shares its prompt
    capped = sum(r == 1000 for r in rows.responses) / 256
    assert 0.15 < capped < 0.35 and min(rows.responses) >= 50
    assert rows.response.sum() == sum(rows.responses)
    for i, (p, r) in enumerate(zip(rows.prompts, rows.responses)):
        assert (
            rows.response[i, p : p + r].all() and not rows.response[i, :p].any() and not rows.tokens[i, p + r :].any()
        )


def test_cpu_run_of_every_arm(tmp_path):
    out = tmp_path / "asg"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "tiny", "--rows", "8", "--group", "4"]
    cmd += ["--max-response", "24", "--token-budget", "800", "--reps", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["errors"] == []
    summary = {r["impl"]: r for r in record["summary"]}
    assert set(summary) == {"fused_linear", "fused", "reference", "hf_transformers"}
    assert summary["fused_linear"]["spec"] == "local" and summary["hf_transformers"]["spec"].startswith("transformers")
    for impl, row in summary.items():
        assert row["reps"] == 1 and row["update_s"] > 0 and row["update_mfu"] > 0, impl
        if impl != "hf_transformers":
            assert row["logprobs_s"] > 0 and row["pad_fraction"] == 0.0  # packed: no padding computed
    assert summary["hf_transformers"]["pad_fraction"] > 0  # padded micro-batches
    # every arm saw the same tokens; the actor trained (a finite loss)
    reps = [r for r in record["reps"] if not r["warmup"]]
    assert len({r["real_tokens"] for r in reps}) == 1 and all(r["loss"] == r["loss"] for r in reps)
    assert "| tiny | fused_linear | local |" in out.with_suffix(".md").read_text()
