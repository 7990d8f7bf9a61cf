"""megatron_dapo.cli with the trainer's testing hook (DAPOTrainer.test_hook) filled in from the environment:
`python -m tests._hooks_driver train ...` (under torchrun) stands in for a run that crashes or has one slow phase.
The trainer itself reads none of these variables.

MEGATRON_DAPO_FAULT="POINT:N": at hook point POINT of step N ("after_step": after step N's checkpoint; "in_save":
    step N's checkpoint has its manifest but no completion marker), every rank meets at a barrier, then SIGKILLs
    itself (all die at the same point, before a launcher's SIGTERM can reach a survivor).
MEGATRON_DAPO_CRASH="POINT:N:RANK:KIND": in the job's first attempt only (megatron_dapo/restarts.py), rank RANK alone
    fails at hook point POINT of step N: KIND "raise" raises RuntimeError, "kill" SIGKILLs itself (as the OOM killer
    would); the other ranks carry on until the launcher stops them. A restarted attempt runs clean.
SLOW_STEP="N:SECONDS": after step N's work, before its step boundary ("step_end"), the step sleeps SECONDS more.
SLOW_SAVE="N:SECONDS": step N's checkpoint sleeps SECONDS after its files are written, before its manifest.
SLOW_GEN="N:SECONDS": during step N's generation, every fresh prompt the stream starts takes SECONDS longer.
SLOW_LOGP="N:SECONDS": after step N's log-probs pass, before its update, the step sleeps SECONDS more.
Each slow hook prints a "test hook: ..." notice (rank 0) when it starts sleeping.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from megatron_dapo import cli
from megatron_dapo.restarts import attempt_number

if TYPE_CHECKING:
    from megatron_dapo.trainer import DAPOTrainer

SLOW = {
    "step_end": "SLOW_STEP",
    "before_manifest": "SLOW_SAVE",
    "fresh_prompt": "SLOW_GEN",
    "logprobs_end": "SLOW_LOGP",
}
NOTICE = {
    "SLOW_STEP": "step {step} takes {seconds:g} s longer",
    "SLOW_SAVE": "the save of step {step} takes {seconds:g} s longer",
    "SLOW_GEN": "generation of step {step} is slow",
    "SLOW_LOGP": "the log-probs of step {step} take {seconds:g} s longer",
}


def _setting(name: str) -> tuple[str, float] | None:
    if name not in os.environ:
        return None
    head, value = os.environ[name].rsplit(":", 1)
    return head, float(value)


def test_hook(self: DAPOTrainer, point: str) -> None:
    fault = _setting("MEGATRON_DAPO_FAULT")
    if fault is not None and fault == (point, float(self.step)):
        self._barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    crash = os.environ.get("MEGATRON_DAPO_CRASH")
    if crash is not None and attempt_number() == 0:
        where, step, rank, kind = crash.split(":")
        if (where, int(step), int(rank)) == (point, self.step, self.rank):
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"test hook: rank {rank} fails at {point} of step {step}")
    name = SLOW.get(point)
    slow = _setting(name) if name else None
    if slow is not None and int(slow[0]) == self.step:
        self._notice(f"test hook: {NOTICE[name].format(step=self.step, seconds=slow[1])}")
        time.sleep(slow[1])


if __name__ == "__main__":
    from megatron_dapo.actor.cpu_compat import import_megatron_core

    import_megatron_core()  # before the trainer imports it (as cli.train does)
    from megatron_dapo.trainer import DAPOTrainer

    DAPOTrainer.test_hook = test_hook
    sys.exit(cli.main())
