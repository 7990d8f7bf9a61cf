import json
import math

import pytest
import torch

from megatron_dapo.metrics import MetricsLogger
from megatron_dapo.metrics import PhaseTimer
from megatron_dapo.metrics import logprob_mismatch
from megatron_dapo.metrics import plot_run
from megatron_dapo.metrics import read_metrics
from megatron_dapo.metrics import response_metrics


def test_response_metrics_values():
    m = response_metrics(
        torch.tensor([4, 10, 6]),
        torch.tensor([False, True, False]),
        torch.tensor([1.0, -2.0, -1.0]),
        torch.tensor([True, False, False]),
        torch.tensor([0.0, -1.0, 0.0]),
    )
    assert m["reward/mean"] == pytest.approx(-2 / 3) and m["reward/acc"] == pytest.approx(1 / 3)
    assert m["response/length_max"] == 10 and m["response/truncation_rate"] == pytest.approx(1 / 3)
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-1 / 3)


def test_logprob_mismatch():
    a = torch.tensor([[0.0, -1.0, -2.0]])
    e = torch.tensor([[5.0, -1.5, -2.0]])
    m = logprob_mismatch(a, e, torch.tensor([[0.0, 1.0, 1.0]]))
    assert m["rollout/logprob_mismatch"] == pytest.approx(0.25) and m["rollout/logprob_mismatch_max"] == 0.5


def test_logger_jsonl_plots_and_timer(tmp_path):
    timer = PhaseTimer()
    with timer("generate"):
        pass
    logger = MetricsLogger(tmp_path, console="plain", jsonl=True, tensorboard=True, total_steps=2)
    for step in (1, 2):
        logger.log(step, {"reward/acc": 0.1 * step, "actor/entropy": float("nan"), **timer.metrics()})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/acc"] == pytest.approx(0.2)
    assert rows[0]["actor/entropy"] is None and rows[0]["time/generate"] >= 0
    assert any((tmp_path / "tb").iterdir())
    files = plot_run(tmp_path)
    assert (tmp_path / "plots" / "accuracy.png") in files
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n{bad\n")
    with pytest.raises(ValueError, match="metrics.jsonl line 2"):
        read_metrics(tmp_path)
    assert not math.isnan(rows[1]["reward/acc"])
