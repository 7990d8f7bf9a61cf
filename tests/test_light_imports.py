"""Light entry points (issue 37 item 5): `import megatron_dapo` and the commands a login node or an sbatch script runs
before any training process (`megatron-dapo check | plan | status | get`) import no torch, each in a fresh
interpreter; the choice names they validate against are the ones the torch-side components implement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
from megatron_dapo.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}))
"""


def _probe(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_megatron_dapo_and_read_a_config_import_no_torch():
    code = "import sys, megatron_dapo; from megatron_dapo.config import load_config; load_config('examples/" \
           "qwen3_30b_a3b_dapo.yaml'); print('torch' in sys.modules)"  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from megatron_dapo.dev.tiny import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("light"), num_train=4, num_test=2, moe=True)


def _run_args(tiny, run_dir) -> list[str]:
    from megatron_dapo.dev.tiny import tiny_overrides

    return ["--config", str(ROOT / "examples" / "tiny_cpu.yaml"), *tiny_overrides(tiny, run_dir)]


def test_plan_check_status_and_get_import_no_torch(tiny_moe, tmp_path):
    config = str(ROOT / "examples" / "qwen2.5_32b_dapo.yaml")
    cases = {
        "plan": ["plan", "--config", config, "--nodes", "4"],
        "plan --lead-time": ["plan", "--config", config, "--nodes", "4", "--lead-time"],
        "check": ["check", *_run_args(tiny_moe, tmp_path / "run"), "--world-size", "2", "--actor.expert_parallel=2"],
        "check (a refused layout)": ["check", *_run_args(tiny_moe, tmp_path / "run"), "--world-size", "3",
                                     "--actor.expert_parallel=2"],
        "status": ["status", *_run_args(tiny_moe, tmp_path / "run")],
        "get": ["get", "--config", config, "actor.tensor_parallel"],
    }  # fmt: skip
    expected = {"plan": 0, "plan --lead-time": 0, "check": 0, "check (a refused layout)": 2, "status": 3, "get": 0}
    for name, argv in cases.items():
        got = _probe(*argv)
        assert got == {"code": expected[name], "torch": []}, (name, got)


def test_declared_choices_are_the_implemented_ones():
    """The names choices.py and loss_configs.py declare (what a config is checked against without torch) are exactly
    the implementations the torch-side registries hold once loaded."""
    from megatron_dapo import choices
    from megatron_dapo.actor.loss import LOGPROB_IMPLS
    from megatron_dapo.algorithms import POLICY_LOSSES
    from megatron_dapo.algorithms.loss_configs import LOSS_CONFIGS
    from megatron_dapo.config import choices as registered

    assert set(choices.LOGPROB_IMPLS) == set(LOGPROB_IMPLS) == set(registered("actor.logprob_impl"))
    assert set(LOSS_CONFIGS) == set(POLICY_LOSSES) == set(registered("algorithm.policy_loss"))
    assert all(POLICY_LOSSES[name].config_cls is LOSS_CONFIGS[name] for name in POLICY_LOSSES)
    assert set(registered("algorithm.rollout_correction")) == set(choices.ROLLOUT_CORRECTIONS)
