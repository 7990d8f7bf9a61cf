"""Worker entry for the preemption tests: `python -m tests.reliability._slow_step_driver train ...` is
megatron_dapo.cli with one phase made slow, standing in for a long SmolLM2 step (the hooks stay in the tests).

SLOW_STEP="N:SECONDS": after step N's work, before its step boundary, the step sleeps SECONDS more.
SLOW_SAVE="N:SECONDS": step N's checkpoint sleeps SECONDS after the actor's files are written, before its manifest.
SLOW_GEN="N:SECONDS": during step N's generation, every fresh prompt the stream starts takes SECONDS longer.
Each hook prints a "test hook: ..." notice (rank 0) when it starts sleeping.
"""

from __future__ import annotations

import os
import sys
import time

from megatron_dapo import cli
from megatron_dapo.checkpoint import CheckpointManager
from megatron_dapo.trainer import DAPOTrainer


def _hook(name: str) -> tuple[int, float] | None:
    if name not in os.environ:
        return None
    step, seconds = os.environ[name].split(":")
    return int(step), float(seconds)


_train_step, _save, _fresh = DAPOTrainer.train_step, DAPOTrainer.save, DAPOTrainer._fresh
_write_manifest = CheckpointManager._write_manifest
_saving: list[int] = []


def _slow_train_step(self: DAPOTrainer) -> dict[str, float]:
    metrics = _train_step(self)
    hook = _hook("SLOW_STEP")
    if hook and self.step == hook[0]:
        self._notice(f"test hook: step {self.step} takes {hook[1]:g} s longer")
        time.sleep(hook[1])
    return metrics


def _slow_save(self: DAPOTrainer):
    _saving[:] = [self.step]
    try:
        return _save(self)
    finally:
        _saving.clear()


def _slow_write_manifest(self: CheckpointManager, path) -> None:
    hook = _hook("SLOW_SAVE")
    if hook and _saving == [hook[0]]:
        if self.rank == 0:
            print(f"[megatron_dapo] test hook: the save of step {hook[0]} takes {hook[1]:g} s longer", file=sys.stderr,
                  flush=True)  # fmt: skip
        time.sleep(hook[1])
    _write_manifest(self, path)


def _slow_fresh(self: DAPOTrainer, offset: int):
    hook = _hook("SLOW_GEN")
    if hook and self.step == hook[0]:
        self._notice(f"test hook: generation of step {self.step} is slow")
        time.sleep(hook[1])
    return _fresh(self, offset)


DAPOTrainer.train_step = _slow_train_step
DAPOTrainer.save = _slow_save
DAPOTrainer._fresh = _slow_fresh
CheckpointManager._write_manifest = _slow_write_manifest

if __name__ == "__main__":
    sys.exit(cli.main())
