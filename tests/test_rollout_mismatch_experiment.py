"""tools/experiments/rollout_mismatch_experiment.py: each arm's command is a valid run of the main job's config, and
the report summarizes and plots metrics files (synthetic here; the real runs are long)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_dapo.config import load_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "rollout_mismatch_experiment", ROOT / "tools/experiments/rollout_mismatch_experiment.py"
)
exp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)


def test_every_arm_is_a_valid_run_config(tmp_path):
    seen = set()
    for arm in exp.ARMS:
        cmd = exp.arm_command(arm, tmp_path, steps=3, seed=5, extra=["--trainer.prompts_per_step=4"])
        overrides = [a for a in cmd if a.startswith("--")]
        cfg = load_config(ROOT / "examples" / "smollm2_arith_cpu.yaml", overrides)
        assert cfg.trainer.total_steps == 3 and cfg.trainer.seed == 5 and cfg.trainer.eval_every == 3
        assert cfg.trainer.run_dir.endswith(arm) and cfg.trainer.prompts_per_step == 4
        seen.add((cfg.rollout.weight_dtype, cfg.algorithm.rollout_correction))
    assert seen == {("auto", "none"), ("fp8", "none"), ("fp8", "tis")}


def test_report_table_and_plots(tmp_path, capsys):
    for k, arm in enumerate(exp.ARMS):
        rows = [
            {
                "step": s,
                "reward/acc": 0.1 * s,
                "rollout_corr/kl_k3": 1e-3 * k + 1e-6,
                "rollout/logprob_mismatch": 0.01,
                "rollout_corr/log_ppl_abs_diff": 0.02,
                "weight_sync/bytes": 2e6,
            }  # fmt: skip
            for s in (1, 2)
        ]
        rows[-1]["eval/avg@4"] = 0.25 + 0.1 * k
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert exp.main(["report", "--out", str(tmp_path), "--img", str(tmp_path / "img")]) == 0
    text = capsys.readouterr().out
    assert "| fp8_tis | 2 | 2.00e-03" in text and "eval/avg@4 0.450" in text
    assert (tmp_path / "img" / "rollout_mismatch_kl_k3.png").exists()
    assert exp.main(["run", "--dry-run", "--steps", "2", "--out", str(tmp_path)]) == 0  # all done: prints commands
