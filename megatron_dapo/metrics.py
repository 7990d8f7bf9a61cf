"""Per-step metrics: what the paper plots, plus cost and drift, written to the console, JSONL and TensorBoard.

trainer --dict[str, float]--> MetricsLogger.log(step) --> console (rich bar / plain line)
                                                      --> run_dir/metrics.jsonl (one object per step)
                                                      --> run_dir/tb (TensorBoard, optional)
megatron-dapo plot RUN_DIR --> run_dir/plots/*.png
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# Every training step writes at least these keys (the end-to-end test checks them).
STEP_METRICS = (
    "reward/mean",
    "reward/acc",
    "reward/overlong_penalty_mean",
    "response/length_mean",
    "response/length_max",
    "response/truncation_rate",
    "actor/entropy",
    "actor/clipfrac_high",
    "actor/clipfrac_low",
    "actor/approx_kl",
    "actor/loss",
    "actor/grad_norm",
    "rollout/logprob_mismatch",
    "sampling/prompts_sampled",
    "sampling/prompts_kept",
    "sampling/prompts_per_useful",
    "stream/prompts_started",
    "stream/tokens_generated",
    "stream/tokens_aborted",
    "stream/groups_carried",
    "stream/response_age_max",
    "stream/engine_busy_fraction",
    "stream/queue_wait_s",
    "time/generate",
    "time/logprobs",
    "time/update",
    "time/weight_sync",
    "time/step",
    "perf/tokens_per_s",
    "perf/actor_tokens_per_s",
    "train/pad_fraction",
)


def response_metrics(
    lengths: Tensor, truncated: Tensor, rewards: Tensor, accs: Tensor, penalties: Tensor
) -> dict[str, float]:
    """Reward and length statistics of every sampled response of a step (all generation batches).

    Args:
        lengths: [N] int response lengths (EOS included); truncated: [N] bool (finish reason "length");
        rewards: [N] float shaped rewards; accs: [N] bool verifier accuracy; penalties: [N] float overlong penalty.
    """
    if lengths.numel() == 0:
        return {}
    return {
        "reward/mean": float(rewards.float().mean()),
        "reward/acc": float(accs.float().mean()),
        "reward/overlong_penalty_mean": float(penalties.float().mean()),
        "response/length_mean": float(lengths.float().mean()),
        "response/length_max": float(lengths.max()),
        "response/truncation_rate": float(truncated.float().mean()),
    }


def logprob_mismatch(actor_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Train/inference drift: mean and max |actor - engine| log-prob over response tokens, and the mean
    importance ratio exp(actor - engine) (1 when both sides agree).

    Args:
        actor_logp, engine_logp, mask: [B, S] float.
    """
    valid = mask.bool()
    if not valid.any():
        return {"rollout/logprob_mismatch": 0.0, "rollout/logprob_mismatch_max": 0.0}
    diff = (actor_logp.float() - engine_logp.float())[valid]
    return {
        "rollout/logprob_mismatch": float(diff.abs().mean()),
        "rollout/logprob_mismatch_max": float(diff.abs().max()),
        "rollout/actor_engine_ratio_mean": float(diff.exp().mean()),
    }


def mismatch_sums(actor_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Tensor:
    """The parts of `logprob_mismatch` that combine over ranks: [sum |d|, max |d|, sum exp(d), count] fp64,
    d = actor - engine over response tokens. actor_logp, engine_logp, mask: [B, S] float."""
    valid = mask.bool()
    diff = (actor_logp.float() - engine_logp.float())[valid].double()
    if diff.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    return torch.stack([diff.abs().sum(), diff.abs().max(), diff.exp().sum(), torch.tensor(float(diff.numel()))])


def mismatch_from_sums(parts: list[Tensor]) -> dict[str, float]:
    """`logprob_mismatch` of the union of the ranks whose `mismatch_sums` are `parts`."""
    total = torch.stack(parts)
    count = float(total[:, 3].sum())
    if count == 0:
        return {"rollout/logprob_mismatch": 0.0, "rollout/logprob_mismatch_max": 0.0}
    return {
        "rollout/logprob_mismatch": float(total[:, 0].sum() / count),
        "rollout/logprob_mismatch_max": float(total[:, 1].max()),
        "rollout/actor_engine_ratio_mean": float(total[:, 2].sum() / count),
    }


class PhaseTimer:
    """Wall-clock seconds per named phase: `with timer("generate"): ...` -> {"time/generate": s}."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


class MetricsLogger:
    """Writes one record per step. Only the logging rank should create one (rank 0)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        console: str = "rich",
        jsonl: bool = True,
        tensorboard: bool = False,
        total_steps: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        self.total_steps = total_steps
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._progress = None
        if console == "rich":
            from rich.progress import Progress

            self._progress = Progress(transient=False)
            self._task = self._progress.add_task("DAPO", total=total_steps)
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = metrics_row(step, metrics)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        line = format_step(step, metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=line)
            self._progress.console.print(line)
        elif self.console == "plain":
            print(line, flush=True)

    def sync(self) -> None:
        """Put the rows logged so far on disk (fsync; before a checkpoint marks their step as done)."""
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def metrics_row(step: int, metrics: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl record of one step: {"step": step, metric: value or None when not finite, ...}, keys sorted."""
    return {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_step(step: int, m: dict[str, float]) -> str:
    keys = [
        ("acc", "reward/acc", "{:.3f}"),
        ("reward", "reward/mean", "{:+.3f}"),
        ("ent", "actor/entropy", "{:.3f}"),
        ("len", "response/length_mean", "{:.0f}"),
        ("trunc", "response/truncation_rate", "{:.2f}"),
        ("clip_hi", "actor/clipfrac_high", "{:.3f}"),
        ("kl", "actor/approx_kl", "{:+.4f}"),
        ("per_useful", "sampling/prompts_per_useful", "{:.2f}"),
        ("s", "time/step", "{:.1f}"),
    ]
    keys += [(key[5:], key, "{:.3f}") for key in sorted(m) if key.startswith("eval/") and "@" in key]
    parts = [f"step {step}"] + [f"{name} {fmt.format(m[key])}" for name, key, fmt in keys if key in m]
    return " | ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {i + 1}: invalid JSON ({err.msg})") from None
    return rows


PLOTS: Sequence[tuple[str, Sequence[str]]] = (
    ("reward", ("reward/mean",)),
    ("accuracy", ("reward/acc",)),
    ("entropy", ("actor/entropy",)),
    ("length", ("response/length_mean", "response/length_max")),
    ("truncation", ("response/truncation_rate",)),
    ("prompts_per_useful", ("sampling/prompts_per_useful",)),
    ("prompts_sampled", ("sampling/prompts_sampled", "sampling/prompts_kept", "stream/prompts_started")),
    ("stream_tokens", ("stream/tokens_generated", "stream/tokens_aborted")),
    ("engine_busy", ("stream/engine_busy_fraction", "stream/engine_busy_fraction_min")),
    ("carried", ("stream/groups_carried", "stream/response_age_max", "stream/response_age_mean")),
    ("rollout_mismatch", ("rollout_corr/kl_k3", "rollout_corr/log_ppl_abs_diff")),
    (
        "eval_accuracy",
        (
            "eval/avg@32",
            "eval/pass@32",
            "eval/cons@32",
            "eval/avg@4",
            "eval/pass@4",
            "eval/cons@4",
            "eval/avg@8",
            "eval/pass@8",
            "eval/cons@8",
        ),
    ),
)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Draw one PNG per curve of PLOTS into run_dir/plots; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in PLOTS:
        series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for key, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def masked_mean(values: Tensor, mask: Tensor) -> float:
    m = mask.to(torch.float32)
    return float((values.float() * m).sum() / m.sum().clamp_min(1.0))
