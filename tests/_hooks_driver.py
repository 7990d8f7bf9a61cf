"""megatron_dapo.cli with the programs' testing hook (DAPOTrainer.test_hook, EngineRank.test_hook) filled in from the
environment:
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
The environment "scripted_turns" (tests/_scripted_env.py) is registered for multi-turn runs of the random model.
MEGATRON_DAPO_ENGINE_KILL="SEED:COUNT": each rank's embedded engine dies COUNT times in the run while the rollout
    stream drives it, at the rank's engine steps (counted over the run) drawn from Random(SEED, rank) in
    1..ENGINE_KILL_SPAN: its model is dropped (everything in flight is lost) and the step raises EngineDied, as a
    crashed engine process would. Evaluation is left alone (an engine failure there ends the job: docs/reliability.md).
JOB_STORE_PORT_FILE=PATH: rank 0 writes the port of the job store it hosts to PATH (what an attacker on the host would
    find by trying the ports rank 0 listens on; tests/reliability/test_hostile_store.py).
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
    from megatron_dapo.engine_rank import EngineRank
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


ENGINE_KILL_SPAN = 300
"""Within the engine steps of one rank in the 4-step tiny run (~110 a step), so nearly every drawn kill lands."""


def _kill_engines(seed: int, count: int) -> None:
    """MEGATRON_DAPO_ENGINE_KILL: TransformersEngine.step dies at seeded points while RolloutStream.run is running."""
    import random

    from megatron_dapo.rollout import EngineDied
    from megatron_dapo.rollout.stream import RolloutStream
    from megatron_dapo.rollout.transformers_engine import TransformersEngine

    rng = random.Random(f"{seed}:{os.environ.get('RANK', '0')}")
    deaths = sorted(rng.sample(range(1, ENGINE_KILL_SPAN + 1), count))
    state = {"in_stream": False, "steps": 0}
    step, run = TransformersEngine.step, RolloutStream.run

    def dying_step(engine):
        if state["in_stream"]:
            n = state["steps"] = state["steps"] + 1
            if deaths and n >= deaths[0]:
                deaths.pop(0)
                engine.shutdown()
                raise EngineDied(f"test hook: the engine was killed at engine step {n} of this rank")
        return step(engine)

    def streaming_run(stream, *args, **kwargs):
        state["in_stream"] = True
        try:
            return run(stream, *args, **kwargs)
        finally:
            state["in_stream"] = False

    TransformersEngine.step = dying_step
    RolloutStream.run = streaming_run


def _report_job_store(path: str) -> None:
    """JOB_STORE_PORT_FILE: rank 0 writes its job store's port to `path` once the store exists."""
    from megatron_dapo import generation

    make = generation.job_store

    def reporting(rank, *args, **kwargs):
        store = make(rank, *args, **kwargs)
        if rank == 0 and hasattr(store, "port"):
            with open(path, "w") as f:
                f.write(str(store.port))
        return store

    generation.job_store = reporting


def test_hook(self: DAPOTrainer | EngineRank, point: str) -> None:
    fault = _setting("MEGATRON_DAPO_FAULT")
    if fault is not None and fault == (point, float(self.step)):
        self.barrier()
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
        self.notice(f"test hook: {NOTICE[name].format(step=self.step, seconds=slow[1])}")
        time.sleep(slow[1])


if __name__ == "__main__":
    from megatron_dapo.actor.cpu_compat import import_megatron_core

    import_megatron_core()  # before the trainer imports it (as cli.train does)
    import tests._scripted_env  # noqa: F401  (registers reward.environment "scripted_turns")
    from megatron_dapo.engine_rank import EngineRank
    from megatron_dapo.trainer import DAPOTrainer

    DAPOTrainer.test_hook = EngineRank.test_hook = test_hook
    if "JOB_STORE_PORT_FILE" in os.environ:
        _report_job_store(os.environ["JOB_STORE_PORT_FILE"])
    if "MEGATRON_DAPO_ENGINE_KILL" in os.environ:
        kill_seed, kill_count = os.environ["MEGATRON_DAPO_ENGINE_KILL"].split(":")
        _kill_engines(int(kill_seed), int(kill_count))
    sys.exit(cli.main())
