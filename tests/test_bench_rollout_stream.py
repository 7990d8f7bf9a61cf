"""tools/bench/rollout_stream.py: the summary of the rounds-vs-stream runs (the runs themselves are the main job)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("rollout_stream", ROOT / "tools" / "bench" / "rollout_stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(run_dir: Path, steps: list[dict], evals: tuple[float, float]) -> None:
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/avg@4": evals[0]}]
    for k, s in enumerate(steps, start=1):
        rows.append({"step": k, "reward/acc": 0.1, **s})
    rows[-1]["eval/avg@4"] = evals[1]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_is_generation_per_kept_group_and_per_token(tmp_path):
    def step(gen, kept, tps, total):
        return {
            "time/generate": gen,
            "sampling/prompts_kept": kept,
            "sampling/prompts_sampled": 2 * kept,
            "perf/gen_tokens_per_s": tps,
            "time/step": total,
        }

    _write(tmp_path / "rounds_0", [step(40, 8, 50, 70), step(20, 8, 50, 50)], (0.3, 0.4))
    _write(tmp_path / "stream_0", [step(24, 8, 60, 50), step(12, 8, 60, 40)], (0.3, 0.5))
    tool = _tool()
    table = tool.summarize(tmp_path)
    rounds, stream = table
    assert rounds["gen_s_per_kept_group"] == pytest.approx(60 / 16)
    assert stream["gen_s_per_kept_group"] == pytest.approx(36 / 16)
    assert rounds["gen_ms_per_token"] == pytest.approx(1000 / 50) and stream["gen_ms_per_token"] == pytest.approx(
        1000 / 60
    )
    assert rounds["step_s_median"] == 60 and stream["heldout_last"] == [0.5]
    text = tool.markdown(table)
    assert rounds["tokens_per_kept_group"] == pytest.approx(60 * 50 / 16)
    assert "generation per kept group 0.60x (tokens 0.72x)" in text and "step time 0.75x" in text
