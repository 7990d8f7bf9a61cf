"""tools/experiments/async_experiment.py: each arm's command is a valid run of the main job's config (the split
arms refuse nothing), and the report summarizes and plots metrics files (synthetic here; the real runs take half an
hour)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_dapo.config import load_config
from megatron_dapo.dev.experiments import main_job_command

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("async_experiment", ROOT / "tools/experiments/async_experiment.py")
exp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)


def test_every_arm_is_a_valid_run_config(tmp_path):
    split = {}
    for arm, overrides in exp.ARMS.items():
        cmd = main_job_command(tmp_path / arm, 8, 0, [*exp.COMMON, *overrides])
        cfg = load_config(ROOT / "examples" / "smollm2_arith_cpu.yaml", [a for a in cmd if a.startswith("--")])
        assert cfg.trainer.total_steps == 8 and cfg.trainer.eval_every == 0
        assert cfg.algorithm.rollout_correction == "tis"
        split[arm] = (cfg.rollout.engine_ranks, cfg.actor.pipeline_parallel, cfg.trainer.max_staleness)
    assert split == {"sync": (0, 2, -1), "async": (1, 1, 1), "lockstep": (1, 1, 0)}


def test_report_table_and_plots(tmp_path, capsys):
    (tmp_path / "base_heldout.json").write_text(json.dumps({"eval/avg@4": 0.2}))
    for k, arm in enumerate(("sync", "async")):
        rows = []
        for s in (1, 2, 3):
            age = 0.0 if arm == "sync" or s == 1 else 1.0
            rows.append({"step": s, "reward/acc": 0.1 * s, "time/step": 100.0 - 40 * k, "time/generate": 50.0 - 40 * k,
                         "time/logprobs": 10.0, "time/update": 30.0, "time/weight_sync": 0.0,
                         "sampling/prompts_kept": 8, "stream/engine_busy_fraction": 0.9,
                         "time/engine_wait_for_weights": 5.0 * k, "stream/response_age_mean": age / 2,
                         "stream/response_age_max": age, "rollout_corr/kl_k3": 1e-4 + 1e-2 * age,
                         "rollout_corr/is_weight_mean": 1.0, "rollout_corr/is_weight_max": 2.0,
                         "rollout_corr/truncated_fraction": 0.001})  # fmt: skip
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / arm / "heldout.json").write_text(json.dumps({"eval/avg@4": 0.3 + 0.1 * k, "eval/pass@4": 0.5}))
    assert exp.main(["report", "--out", str(tmp_path), "--img", str(tmp_path / "img")]) == 0
    text = capsys.readouterr().out
    # s/step over steps 2-3; per kept group; wall = all steps; actor busy = (10 + 30 + 0) / step
    assert "| sync | 3 | 100 | 12.5 | 300 | 0.40 (50) | 0.90 (0) | 0.00 (0) | 1.0e-04 / nan |" in text
    assert "| async | 3 | 60 | 7.5 | 180 | 0.67 (10) | 0.90 (5) | 0.33 (1) | 1.0e-04 / 1.0e-02 |" in text
    assert text.count("| 0.200 -> 0.300 |") == 1 and "| 0.200 -> 0.400 |" in text
    assert (tmp_path / "img" / "async_age.png").exists()
