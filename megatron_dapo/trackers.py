"""Experiment trackers beside metrics.jsonl and TensorBoard (logging.tracker): Weights & Biases or MLflow.

    logging.tracker: "none" | "wandb" | "mlflow";  logging.tracker_project: the W&B project / MLflow experiment

W&B: wandb.init(project, name = the run directory's name, id kept in run_dir/wandb_run_id so a resumed job continues
its run, resume="allow", dir=run_dir, mode = $WANDB_MODE, else "online" with $WANDB_API_KEY set and "offline"
without one: no key, no network needed; `wandb sync` uploads later), run.log(row, step=step), run.finish().
MLflow: tracking URI $MLFLOW_TRACKING_URI, else SQLite at run_dir/mlflow.db (MLflow 3 refuses new file stores);
set_experiment(project);
start_run(run_id kept in run_dir/mlflow_run_id); log_metrics(row, step=step) with each name mapped onto the
characters MLflow accepts; end_run(). Both get the run config once (W&B config, MLflow's config.json artifact).
Only finite numbers are logged (a None or NaN metric is left out of that step's row). Rank 0 only (MetricsLogger).
Checked once against the real packages (wandb 0.31.0 offline, mlflow 3.17.2 on SQLite, in a separate virtualenv: a
resumed tracker continued the same run, steps 1 and 2 in one MLflow history); CI tests the calls against stand-ins
(tests/test_trackers.py) and installs neither.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from pathlib import Path
from typing import Any

TRACKERS = ("none", "wandb", "mlflow")
"""logging.tracker's values; each but "none" is also the package it imports."""

_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts (alphanumerics, _ - . space /; others become "_")."""
    return _MLFLOW_KEY.sub("_", name)


def local_store(run_dir: Path) -> str:
    """The MLflow tracking URI of a run without MLFLOW_TRACKING_URI: a SQLite file in its run directory."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def finite(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def _run_id(run_dir: Path, name: str, new: str | None) -> tuple[str | None, Path]:
    """(the id kept in run_dir/<name>, or `new` when none is kept, the id file)."""
    path = run_dir / name
    kept = path.read_text().strip() if path.is_file() else ""
    return kept or new, path


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import wandb

        run_id, path = _run_id(run_dir, "wandb_run_id", secrets.token_hex(4))
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
                              mode=mode, config=config)  # fmt: skip
        path.write_text(run_id)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # MLflow 3 keeps its file store read-only: a SQLite file
            mlflow.set_tracking_uri(local_store(run_dir))
        mlflow.set_experiment(project)
        run_id, path = _run_id(run_dir, "mlflow_run_id", None)
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_dir.name)
        if run_id is None:
            path.write_text(run.info.run_id)
            mlflow.log_dict(config, "config.json")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in finite(metrics).items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def make_tracker(kind: str, run_dir: str | Path, project: str, config: dict[str, Any]) -> Any:
    """The tracker `kind` names (None for "none"); config: the run config as plain values."""
    if kind == "none":
        return None
    cls = {"wandb": WandbTracker, "mlflow": MLflowTracker}[kind]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return cls(Path(run_dir), project, config)
