"""Atomic, resumable checkpoints: model and optimizer (Megatron dist_checkpointing via the actor), trainer state
(step, data position, sampler carry-over, RNG states), the run's config; keep the newest K; preemption-safe.

    run_dir/checkpoints/
        step_00000004/            complete: has COMPLETE, renamed into place only after every rank wrote
            actor/                MegatronActor.save_checkpoint (sharded model + optimizer + scheduler)
            trainer_state.pt      step, data iterator, sampler carry, metrics continuity (weights_only-safe)
            rng_rank{r}.pt        torch / python RNG states per rank
            config.yaml
            COMPLETE
        step_00000006.partial/    an interrupted save: ignored by `latest()`, removed by the next save

SIGTERM / SIGUSR1 (Slurm preemption) only set a flag; the trainer checks it at step boundaries, agreeing across ranks,
saves and exits 0.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

COMPLETE = "COMPLETE"
PREFIX = "step_"

# Fields that may not change when resuming a run (others, e.g. total_steps or logging, may).
INCOMPATIBLE_FIELDS = (
    ("actor", "model_path"),
    ("actor", "dtype"),
    ("algorithm", "group_size"),
    ("trainer", "prompts_per_step"),
    ("trainer", "seed"),
    ("data", "train_files"),
    ("data", "seed"),
    ("data", "shuffle"),
)


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and "." not in p.name and (p / COMPLETE).exists()
    ]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def check_compatible(saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]], where: str) -> None:
    """Raise ValueError naming every field that changed in a way a resumed run cannot absorb."""
    changed = [
        f"{s}.{f}: {saved.get(s, {}).get(f)!r} -> {current.get(s, {}).get(f)!r}"
        for s, f in INCOMPATIBLE_FIELDS
        if saved.get(s, {}).get(f) != current.get(s, {}).get(f)
    ]
    if changed:
        raise ValueError(
            f"{where}: cannot resume, the config changed incompatibly ({'; '.join(changed)}); "
            f"use a new trainer.run_dir or checkpoint.resume=never"
        )


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


class CheckpointManager:
    """Save / find / load checkpoints under `root`. Every rank constructs one; `barrier` synchronises ranks.

    Args:
        root: checkpoint directory (shared filesystem on clusters).
        keep_last: number of complete checkpoints kept.
        rank: global rank; rank 0 owns directory creation, renames and pruning.
        barrier: a callable that blocks until every rank reaches it (torch.distributed.barrier on a group).
    """

    def __init__(self, root: str | Path, keep_last: int, rank: int = 0, barrier: Callable[[], None] = lambda: None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.rank = rank
        self.barrier = barrier

    def save(
        self,
        step: int,
        trainer_state: dict[str, Any],
        config: dict[str, Any],
        save_actor: Callable[[Path], None] | None = None,
        *,
        crash_hook: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint `step` atomically; returns its final path.

        `save_actor(dir)` is called on every rank (it may be collective). `crash_hook` exists for tests: it runs
        after the actor and trainer files are written but before the checkpoint is marked complete.
        """
        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"{PREFIX}*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        self.barrier()
        if save_actor is not None:
            save_actor(partial / "actor")
        torch.save(rng_state(), partial / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            torch.save(trainer_state, partial / "trainer_state.pt")
            (partial / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.barrier()
        if crash_hook is not None:
            crash_hook(partial)
        if self.rank == 0:
            (partial / COMPLETE).write_text(f"{step}\n")
            _fsync_dir(partial)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            for old in list_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self.barrier()
        return final

    def load(
        self, path: str | Path, config: dict[str, Any], load_actor: Callable[[Path], None] | None = None
    ) -> dict[str, Any]:
        """Check config compatibility, restore the actor, this rank's RNG states; return the trainer state."""
        path = Path(path)
        if not (path / COMPLETE).exists():
            raise ValueError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
        saved = yaml.safe_load((path / "config.yaml").read_text())
        check_compatible(saved, config, str(path))
        if load_actor is not None:
            load_actor(path / "actor")
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=True))
        return torch.load(path / "trainer_state.pt", weights_only=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PreemptionFlag:
    """SIGTERM / SIGUSR1 set a flag instead of killing the process; the trainer saves at the next step boundary.

    `install()` must run in the main thread. `requested(all_reduce_max)` combines the flag across ranks so every
    rank stops at the same step (pass a function doing a MAX all-reduce of a 0/1 tensor, or None for one process).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.flag = False
        self.signum: int | None = None

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.flag = True
        self.signum = signum

    def requested(self, all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
        local = torch.tensor([1 if self.flag else 0], dtype=torch.int64)
        if all_reduce_max is not None:
            local = all_reduce_max(local)
        return bool(local.item())
