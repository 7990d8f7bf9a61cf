"""tools/experiments/routing_replay_experiment.py: each arm's command is a valid run of the main job's config on the
upcycled model, and the report summarizes and plots metrics files (synthetic here; the real runs take an hour)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_dapo.config import load_config
from megatron_dapo.dev.experiments import main_job_command

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "routing_replay_experiment", ROOT / "tools/experiments/routing_replay_experiment.py"
)
exp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)


def test_every_arm_is_a_valid_run_config(tmp_path):
    seen = set()
    for arm in exp.ARMS:
        cmd = main_job_command(tmp_path / arm, 3, 5, exp.arm_overrides(arm, tmp_path / "model", ["--trainer.seed=7"]))
        cfg = load_config(ROOT / "examples" / "smollm2_arith_cpu.yaml", [a for a in cmd if a.startswith("--")])
        assert (
            cfg.trainer.total_steps == 3 and cfg.trainer.seed == 7 and cfg.actor.model_path == str(tmp_path / "model")
        )
        assert cfg.rollout.weight_dtype == "fp8" and cfg.algorithm.rollout_correction == "tis"
        assert not cfg.actor.shared_prefix and cfg.rollout.compare_logprobs
        seen.add(cfg.actor.routing_replay)
    assert seen == {"none", "r2", "r3"}


def test_report_table_and_plots(tmp_path, capsys):
    for k, arm in enumerate(exp.ARMS):
        rows = [{"step": 0, "eval/avg@4": 0.3}]
        for s in (1, 2):
            row = {"step": s, "reward/acc": 0.1 * s, "rollout_corr/kl_k3": 1e-3 * (k + 1), "time/step": 100.0 * s,
                   "rollout/logprob_mismatch": 0.01, "rollout/logprob_mismatch_max": 0.5 * s,
                   "rollout_corr/is_weight_mean": 1.0, "rollout_corr/is_weight_max": 2.0,
                   "rollout_corr/truncated_fraction": 0.001}  # fmt: skip
            if arm in exp.AGREEMENT:
                row[exp.AGREEMENT[arm]] = 0.9 + 0.02 * s
                row[exp.AGREEMENT[arm] + "_min"] = 0.8 + 0.01 * s
            rows.append(row)
        rows[-1]["eval/avg@4"] = 0.25 + 0.1 * k
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert exp.main(["report", "--out", str(tmp_path), "--img", str(tmp_path / "img")]) == 0
    text = capsys.readouterr().out
    assert "| none | 2 | - | 1.00e-03 | 1.00e-02 (1.00) |" in text
    assert "| r3 | 2 | 0.9300 (0.810) | 3.00e-03 |" in text and "eval/avg@4 0.300 -> 0.450 | 150 |" in text
    assert (tmp_path / "img" / "routing_replay_agreement_r3.png").exists()
    assert exp.main(["run", "--dry-run", "--steps", "2", "--out", str(tmp_path)]) == 0  # all done: prints commands
