"""tools/experiments/tool_use.py: each arm's data is valid prompt data whose few-shot turns render through the chat
template (the tool arm's with a tool turn), and each arm's command is a valid run of the main job's config (the real
runs take most of an hour)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_dapo.config import load_config
from megatron_dapo.data.dataset import load_examples
from megatron_dapo.dev.experiments import main_job_command

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tool_use", ROOT / "tools/experiments/tool_use.py")
exp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)


def test_arms_data_and_commands(tmp_path):
    for arm, environment in (("tool", "python_tool"), ("no_tool", "single_turn")):
        data = exp.write_data(arm, tmp_path / arm, num_train=5, num_test=2)
        rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
        assert len(load_examples(data / "train.jsonl")) == len(rows) == 5  # the trainer's reader takes tool turns
        for row in rows:
            *shots, question = row["prompt"]
            a, b = (int(x) for x in question["content"].splitlines()[-1].rstrip(" =").split(" * "))
            assert row["reward_model"]["ground_truth"] == str(a * b) and 11 <= a <= 99 and 101 <= b <= 999
            roles = [m["role"] for m in shots]
            assert roles == (["user", "assistant", "tool", "assistant"] if arm == "tool" else ["user", "assistant"]) * 3
        cmd = main_job_command(tmp_path / "run", 8, 1, exp.arm_overrides(arm, data))
        cfg = load_config(ROOT / "examples" / "smollm2_arith_cpu.yaml", [a for a in cmd if a.startswith("--")])
        assert cfg.reward.environment == environment and cfg.trainer.total_steps == 8 and cfg.trainer.seed == 1
        assert cfg.trainer.eval_every == 0 and cfg.checkpoint.save_every == 0 and not cfg.rollout.partial
        assert cfg.data.train_files == [str(data / "train.jsonl")]


def test_summary_means_and_standard_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(exp, "OUT", tmp_path)
    monkeypatch.setattr(exp, "RUNS", tmp_path)
    for seed, acc in ((0, 0.2), (1, 0.4)):
        run = tmp_path / f"tool_seed{seed}"
        run.mkdir()
        rows = [{"step": 0}, {"step": 1, "reward/acc": acc, "episode/tool_calls": 1.0}, {"step": 2, "reward/acc": acc}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "exit_code").write_text("0\n")
    text = exp.summarise([0, 1])
    tool = next(line for line in text.splitlines() if line.startswith("| tool |"))
    assert "| 2 | 2 | 0 0 | 0.300 +- 0.100 |" in tool  # mean 0.3, SE = sd 0.1414 / sqrt 2
