"""Per-step metrics: what the paper plots, plus cost and drift, written to the console, JSONL and TensorBoard.

trainer --dict[str, float]--> MetricsLogger.log(step) --> console (rich bar / plain line)
                                                      --> run_dir/metrics.jsonl (one object per step)
                                                      --> run_dir/tb (TensorBoard, optional)
megatron-dapo plot RUN_DIR --> run_dir/plots/*.png
"""

from __future__ import annotations

import enum
import json
import math
import os
import sys
import time
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_dapo import wire

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


@wire.record
class Reduce(enum.Enum):
    """How one metric's parts from several ranks (or micro-batches) combine into its value."""

    MEAN = "mean"  # sum of the parts' totals / sum of their weights (0.0 when no weight): a token- or row-mean
    SUM = "sum"
    MAX = "max"
    MIN = "min"


@wire.record
@dataclass(frozen=True, slots=True)
class Stat:
    """One part of a metric and its reduction. MEAN: `value` is the sum of what is averaged and `weight` the count
    (or weight) it is over; SUM / MAX / MIN: `value` is the part's value (weight unused). Build with `Stat.mean`,
    `Stat.sum`, `Stat.max`, `Stat.min`; combine with `merge_stats` (parts as Python objects, e.g. gathered over the
    gloo exchange) or `all_reduce_stats` (tensors over process groups); read with `finalize`."""

    reduce: Reduce
    value: float
    weight: float = 1.0

    @classmethod
    def mean(cls, total: float, count: float) -> Stat:
        return cls(Reduce.MEAN, float(total), float(count))

    @classmethod
    def sum(cls, value: float) -> Stat:
        return cls(Reduce.SUM, float(value))

    @classmethod
    def max(cls, value: float) -> Stat:
        return cls(Reduce.MAX, float(value))

    @classmethod
    def min(cls, value: float) -> Stat:
        return cls(Reduce.MIN, float(value))

    def merge(self, other: Stat) -> Stat:
        if other.reduce is not self.reduce:
            raise ValueError(f"Stat.merge: a {self.reduce.value} part met a {other.reduce.value} part")
        if self.reduce is Reduce.MEAN:
            return Stat(Reduce.MEAN, self.value + other.value, self.weight + other.weight)
        if self.reduce is Reduce.SUM:
            return Stat(Reduce.SUM, self.value + other.value)
        pick = max if self.reduce is Reduce.MAX else min
        return Stat(self.reduce, pick(self.value, other.value))

    def result(self) -> float:
        if self.reduce is Reduce.MEAN:
            return self.value / self.weight if self.weight > 0 else 0.0
        return self.value


Stats = dict[str, Stat]


def merge_stats(parts: Iterable[Mapping[str, Stat]]) -> Stats:
    """Combine parts in order (keys may differ between parts: a key is over the parts that have it)."""
    out: Stats = {}
    for part in parts:
        for key, stat in part.items():
            out[key] = out[key].merge(stat) if key in out else stat
    return out


def finalize(stats: Mapping[str, Stat]) -> dict[str, float]:
    """The metric values: {key: float}."""
    return {key: stat.result() for key, stat in stats.items()}


def all_reduce_stats(stats: Mapping[str, Stat], groups: Sequence[Any], device: torch.device | str = "cpu") -> Stats:
    """Combine `stats` over each process group of `groups` in turn (None entries are skipped): one fp64 SUM
    all-reduce of every MEAN/SUM part (value, weight) and one MAX all-reduce of every MAX part and negated MIN part.
    Collective: every rank of a group passes the same keys with the same reductions (a rank with nothing to add passes
    `identity(stats)`-like parts: mean 0/0, sum 0, max -inf, min +inf)."""
    keys = sorted(stats)
    added = [k for k in keys if stats[k].reduce in (Reduce.MEAN, Reduce.SUM)]
    extreme = [k for k in keys if stats[k].reduce in (Reduce.MAX, Reduce.MIN)]
    sums = torch.tensor([[stats[k].value, stats[k].weight] for k in added], dtype=torch.float64, device=device)
    sign = {Reduce.MAX: 1.0, Reduce.MIN: -1.0}
    tops = torch.tensor([sign[stats[k].reduce] * stats[k].value for k in extreme], dtype=torch.float64, device=device)
    for group in groups:
        if group is None:
            continue
        if added:
            torch.distributed.all_reduce(sums, group=group)
        if extreme:
            torch.distributed.all_reduce(tops, op=torch.distributed.ReduceOp.MAX, group=group)
    out = {k: Stat(stats[k].reduce, float(v), float(w)) for k, (v, w) in zip(added, sums.tolist(), strict=True)}
    out.update(
        {k: Stat(stats[k].reduce, sign[stats[k].reduce] * v) for k, v in zip(extreme, tops.tolist(), strict=True)}
    )
    return {k: out[k] for k in keys}


def identity(reduce: Reduce) -> Stat:
    """The part that changes nothing when merged or all-reduced (a rank that holds none of the metric)."""
    return {
        Reduce.MEAN: Stat(Reduce.MEAN, 0.0, 0.0),
        Reduce.SUM: Stat(Reduce.SUM, 0.0),
        Reduce.MAX: Stat(Reduce.MAX, -math.inf),
        Reduce.MIN: Stat(Reduce.MIN, math.inf),
    }[reduce]


def mismatch_stats(actor_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Stats:
    """Train/inference drift as Stats: mean and max |actor - engine| log-prob over response tokens, and the mean
    importance ratio exp(actor - engine) (1 when both sides agree). actor_logp, engine_logp, mask: [B, S] float;
    sums in fp64."""
    diff = (actor_logp.float() - engine_logp.float())[mask.bool()].double()
    n = float(diff.numel())
    if not n:
        return {"rollout/logprob_mismatch": Stat.mean(0.0, 0.0), "rollout/logprob_mismatch_max": Stat.max(0.0)}
    return {
        "rollout/logprob_mismatch": Stat.mean(float(diff.abs().sum()), n),
        "rollout/logprob_mismatch_max": Stat.max(float(diff.abs().max())),
        "rollout/actor_engine_ratio_mean": Stat.mean(float(diff.exp().sum()), n),
    }


def logprob_mismatch(actor_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """`mismatch_stats` of one batch, finalized."""
    return finalize(mismatch_stats(actor_logp, engine_logp, mask))


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
        tracker: Any = None,
    ) -> None:
        """tracker: a W&B / MLflow tracker (megatron_dapo/trackers.py) or None; closed with the logger."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        self.total_steps = total_steps
        self.tracker = tracker
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

    @classmethod
    def for_run(cls, config: Any, run_dir: str | Path) -> MetricsLogger:
        """The logger of a run (rank 0): its logging section's sinks, the tracker it names (megatron_dapo/trackers.py,
        given the whole config), total_steps for the progress bar."""
        from megatron_dapo.trackers import make_tracker

        log = config.logging
        tracker = make_tracker(log.tracker, run_dir, log.tracker_project, config.to_dict())
        return cls(run_dir, console=log.console, jsonl=log.jsonl, tensorboard=log.tensorboard,
                   total_steps=config.trainer.total_steps, tracker=tracker)  # fmt: skip

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
        if self.tracker is not None:
            self.tracker.log(step, metrics)
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
        if self.tracker is not None:
            self.tracker.close()


def metrics_row(step: int, metrics: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl record of one step: {"step": step, metric: value or None when not finite, ...}, keys sorted."""
    return {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}


TIMING_PREFIXES = ("time/", "perf/", "stream/", "weight_sync/seconds", "weight_sync/gb_per_s")
"""Metrics that depend on timing (phase seconds, rates, the stream's scheduling); the rest of a row is the same in
every run of a deterministic job, interrupted and resumed or not."""


def without_timing(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl rows without their TIMING_PREFIXES keys: what a resumed or restarted run must reproduce."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


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


def parse_metrics_line(line: str) -> dict[str, Any] | str:
    """One line of metrics.jsonl as the row `metrics_row` writes ({"step": int >= 0, metric: finite number or None}),
    or why it is not one (a torn write, an edit: not JSON, not an object, a step that is no count such as 1e400 or
    true, a value that is not a finite number)."""
    try:
        row = json.loads(line)
    except ValueError as err:  # JSONDecodeError, and numbers past what json accepts
        return f"not JSON ({getattr(err, 'msg', err)})"
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"its step is {step!r}, not a count"
    for key, value in row.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value)):
            return f"{key} is {value!r}, not a finite number"
    return row


def read_metrics(run_dir: str | Path, log: Any = None) -> list[dict[str, Any]]:
    """The rows of run_dir/metrics.jsonl; a line that is not a row (parse_metrics_line) is dropped and named through
    `log` (default: a warning on stderr)."""
    path = Path(run_dir) / "metrics.jsonl"
    log = log or (lambda line: print(f"warning: {line}", file=sys.stderr))
    return [row for _, row in _metrics_rows(path.read_text(errors="replace"), path, log)]


def _metrics_rows(text: str, path: Path, log: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) of each metrics row of `text` (metrics.jsonl's); a line that is not one is named through `log`."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = parse_metrics_line(line)
        if isinstance(row, str):
            log(f"{path} line {number}: not a metrics row ({row}: a torn write or an edit); dropped: {line[:60]!r}")
            continue
        yield line, row


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
        written.append(save_step_plot(fig, ax, name, out_dir / f"{name}.png"))
        plt.close(fig)
    return written


def save_step_plot(fig: Any, ax: Any, title: str, path: Path, title_size: float | None = None) -> Path:
    """Label a per-step matplotlib axis (x: step, grid, legend) and save its figure to `path` (100 dpi)."""
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=title_size)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


# ---------------------------------------------------------------------------------------------------------------
# metrics.jsonl repair on resume (the trainer's start-up)
# ---------------------------------------------------------------------------------------------------------------
def drop_unsaved_metrics(path: Path, log: Any = print) -> None:
    """A start from step 0 in a run dir whose metrics.jsonl has rows (an attempt or run that failed before its first
    checkpoint, then restarted or run again): those steps are trained and logged again, so their old rows go (named
    through `log`) instead of appearing twice."""
    if not path.exists() or not path.read_text(errors="replace").strip():
        return
    lines = len([x for x in path.read_text(errors="replace").splitlines() if x.strip()])
    truncate_metrics(path, -1, log=lambda _: None)
    log(f"{path}: dropped {lines} row(s) of an earlier start that saved no checkpoint; this run starts at step 0")


def truncate_metrics(path: Path, step: int, log: Any = print, restore: dict[str, Any] | None = None) -> None:
    """Drop metric rows logged after the checkpoint we resume from (a crash between log and save), and lines that are
    not JSON (a torn last line from a kill in mid-write): each such line is named through `log`. `restore`: the
    checkpoint's own row of `step`, written back when the file no longer has that step (logged)."""
    if not path.exists() and restore is None:
        return
    kept, steps = [], set()
    text = path.read_text(errors="replace") if path.exists() else ""
    for line, row in _metrics_rows(text, path, log):
        if row["step"] <= step:
            kept.append(line)
            steps.add(row["step"])
    if restore is not None and int(restore["step"]) == step and step not in steps:
        kept.append(json.dumps(restore))
        log(f"{path}: step {step}'s metrics row was missing; restored it from the checkpoint")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
