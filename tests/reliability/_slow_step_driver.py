"""Worker entry for the preemption test: `python -m tests.reliability._slow_step_driver train ...` is
megatron_dapo.cli with one step made slow, standing in for a long SmolLM2 step (the hook stays in the tests).

SLOW_STEP="N:SECONDS": after step N's work, before its step boundary, the step sleeps SECONDS more.
"""

from __future__ import annotations

import os
import sys
import time

from megatron_dapo import cli
from megatron_dapo.trainer import DAPOTrainer

_step, _seconds = os.environ["SLOW_STEP"].split(":")
_train_step = DAPOTrainer.train_step


def _slow_train_step(self: DAPOTrainer) -> dict[str, float]:
    metrics = _train_step(self)
    if self.step == int(_step):
        self._notice(f"test hook: step {self.step} takes {_seconds} s longer")
        time.sleep(float(_seconds))
    return metrics


DAPOTrainer.train_step = _slow_train_step

if __name__ == "__main__":
    sys.exit(cli.main())
