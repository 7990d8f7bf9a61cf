"""logging.tracker: the run's metrics to Weights & Biases or MLflow, against stand-in modules with the calls the real
packages take (wandb.init / run.log(step=) / run.finish; mlflow.set_tracking_uri / set_experiment / start_run /
log_metrics(step=) / log_dict / end_run); a resumed run continues the same tracker run; W&B is offline without a key;
a missing package is one line before launch."""

from __future__ import annotations

import json
import sys
import types

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.config import LoggingConfig
from megatron_dapo.config import load_config
from megatron_dapo.launch import StartupError
from megatron_dapo.launch import preflight
from megatron_dapo.metrics import MetricsLogger
from megatron_dapo.trackers import make_tracker
from megatron_dapo.trackers import mlflow_key
from tests.reliability.test_preflight import setup  # noqa: F401  (the fixture)

ROW = {"reward/mean": 0.5, "episode/reward_by_tool_calls/2+": -1.0, "eval/acc": None, "actor/grad_norm": float("nan")}


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []

    class Run:
        def log(self, data, step=None):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return calls


def test_wandb_offline_without_a_key_and_resumed_into_the_same_run(fake_wandb, tmp_path, monkeypatch):
    run_dir = tmp_path / "run7"
    log = MetricsLogger(run_dir, console="none", tracker=make_tracker("wandb", run_dir, "proj", {"actor": {"lr": 1}}))
    log.log(3, ROW)
    log.close()
    init = fake_wandb[0][1]
    assert init["mode"] == "offline" and init["project"] == "proj" and init["name"] == "run7"
    assert init["dir"] == str(run_dir) and init["resume"] == "allow" and init["config"] == {"actor": {"lr": 1}}
    # Only finite numbers, at the trainer's step; the tracker closes with the logger.
    assert fake_wandb[1:] == [("log", {"reward/mean": 0.5, "episode/reward_by_tool_calls/2+": -1.0}, 3), ("finish",)]
    monkeypatch.setenv("WANDB_API_KEY", "k")
    make_tracker("wandb", run_dir, "proj", {})
    again = fake_wandb[-1][1]
    assert again["id"] == init["id"] and again["mode"] == "online"  # a resumed job continues its run


def test_mlflow_file_store_names_and_resume(tmp_path, monkeypatch):
    calls = []

    def start_run(run_id=None, run_name=None):
        calls.append(("start_run", run_id, run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "abc123"))

    mod = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("uri", uri)),
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=start_run,
        log_dict=lambda d, path: calls.append(("log_dict", d, path)),
        log_metrics=lambda m, step=None: calls.append(("log_metrics", m, step)),
        end_run=lambda: calls.append(("end_run",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", mod)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    tracker = make_tracker("mlflow", run_dir, "proj", {"a": 1})
    tracker.log(2, ROW)
    tracker.close()
    assert calls[0] == ("uri", f"sqlite:///{run_dir.resolve()}/mlflow.db") and calls[1] == ("experiment", "proj")
    assert calls[2] == ("start_run", None, "r") and calls[3] == ("log_dict", {"a": 1}, "config.json")
    assert calls[4] == ("log_metrics", {"reward/mean": 0.5, "episode/reward_by_tool_calls/2_": -1.0}, 2)
    calls.clear()
    make_tracker("mlflow", run_dir, "proj", {"a": 1})
    assert ("start_run", "abc123", None) in calls and not any(c[0] == "log_dict" for c in calls)
    assert mlflow_key("a+b:c/d e.f-g_h") == "a_b_c/d e.f-g_h"


def test_tracker_config_and_missing_package(setup, monkeypatch):  # noqa: F811
    with pytest.raises(ConfigError, match=r"logging.tracker: must be one of \['mlflow', 'none', 'wandb'\]"):
        LoggingConfig(tracker="comet")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(StartupError, match=r"logging.tracker=wandb, but the wandb package is not installed; pip"):
        preflight(load_config(None, [*setup, "--logging.tracker=wandb"]), 2)
    json.dumps(load_config(None, [*setup, "--logging.tracker=mlflow"]).to_dict())  # the config a tracker gets
