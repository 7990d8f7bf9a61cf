"""The per-step device-memory choreography of a colocated rollout engine and the actor, owned by one object.

    generation             engine: weights + KV cache + CUDA graphs    actor: what actor.offload keeps
    release_engine         engine.release_memory(weights, kv_cache, cuda_graph); barrier
    reload_actor           actor state back from host memory (what the last step offloaded)
    log-probs, update      engine: nothing                              actor: params + grads + optimizer
    offload_actor          actor.offload: optimizer -> optimizer state; all -> grads + optimizer state
    empty_cache            torch.cuda.empty_cache (activations, offloaded state); barrier
    resume_engine_weights  engine.resume_memory(weights)
    sync                   engine: weights                              actor: params (+ the rest unless offloaded)
    offload_actor_params   all -> params (the export has read them)
    empty_cache            (sync buckets, params); barrier
    resume_engine_kv       engine.resume_memory(kv_cache, cuda_graph)  -> the next step's generation

STEP_SEQUENCE is that list; MemoryChoreographer walks it as the trainer enters each phase (`phase`, `end_step`; or
`run_step` for a whole step) and nothing else in the trainer moves memory.
The planner (plan.py) reads what is resident in each phase from resident_by_phase(), which runs this same sequence
with probes, so the planned phases and the code cannot drift apart. Diagram and numbers: docs/rollout.md.

Why this order: a colocated engine sizes its KV pool from the memory free when it starts, so resuming it needs that
memory back. The actor's activations and anything it freed stay reserved by torch's caching allocator until
empty_cache; the engine lives in other processes and cannot reuse that cache. The weights come back first (the sync
writes into them), the KV cache and graphs last, after the actor's state has left and the cache is empty (verl:
resume weights -> sync -> offload -> empty_cache -> resume KV). The barriers keep ranks that share GPUs with an engine
(engine TP > 1: its workers sit on other ranks' GPUs) in step: no rank reloads its actor state before the engine has
released, and the engine resumes only after every rank has emptied its cache.

Pure Python: torch is imported only to empty the CUDA cache (skipped without CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any
from typing import Protocol

from megatron_dapo.config import register_choices

ENGINE_TAGS = ("weights", "kv_cache", "cuda_graph")
"""Engine memory regions, as SGLang 0.5.23 names them (sglang/srt/constants.py GPU_MEMORY_TYPE_*)."""
KV_TAGS = ("kv_cache", "cuda_graph")
"""Regions resumed after the weight sync."""
PARTS = ("params", "grads", "optimizer")
"""Actor state parts (actor/offload.py says what each holds)."""
OFFLOAD_MODES = ("none", "optimizer", "all")
register_choices("actor.offload", *OFFLOAD_MODES)
"""actor.offload values."""
PHASES = ("generation", "log-probs", "update", "sync")
"""The phases whose work the caller supplies (the planner's phases, after "engine start")."""
STEP_SEQUENCE = (
    "generation",
    "release_engine",
    "reload_actor",
    "log-probs",
    "update",
    "offload_actor",
    "empty_cache",
    "resume_engine_weights",
    "sync",
    "offload_actor_params",
    "empty_cache",
    "resume_engine_kv",
)
"""One training step, in order (the module docstring says what each entry does)."""


def parts_offloaded(mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(parts offloaded after the update, parts offloaded after the weight sync) for actor.offload=mode.

    "optimizer" moves the optimizer state (fp32 main params + Adam moments); "all" also the gradients, and the
    parameters once the sync's export has read them.
    """
    table = {"none": ((), ()), "optimizer": (("optimizer",), ()), "all": (("grads", "optimizer"), ("params",))}
    if mode not in table:
        raise ValueError(f"actor.offload: must be one of {OFFLOAD_MODES}, got {mode!r}")
    return table[mode]


class MemoryEngine(Protocol):
    """The part of a RolloutEngine the choreography drives (rollout/base.py)."""

    def release_memory(self, tags: Sequence[str]) -> None: ...

    def resume_memory(self, tags: Sequence[str]) -> None: ...


class MemoryActor(Protocol):
    """The part of MegatronActor the choreography drives."""

    def offload_state(self, parts: Sequence[str]) -> int: ...

    def reload_state(self, parts: Sequence[str] | None = None) -> int: ...


def _cuda_empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class MemoryChoreographer:
    """Runs STEP_SEQUENCE: the engine's memory regions and the actor's offload around the caller's phases.

    engine: the colocated engine on this rank (None on ranks without one, and for engines on other GPUs: those
    still offload and empty their cache, and take part in the barriers). actor: offload_state / reload_state.
    offload: actor.offload. barrier: a barrier over every rank (a gloo group; None for one rank).
    empty_cache: frees the caching allocator's unused memory (default: torch.cuda.empty_cache when CUDA is
    available, else nothing). trace: every action and phase is appended to it in order (tests, debugging).
    """

    def __init__(
        self,
        engine: MemoryEngine | None,
        actor: MemoryActor,
        *,
        offload: str = "none",
        barrier: Callable[[], None] | None = None,
        empty_cache: Callable[[], None] | None = None,
        trace: list[str] | None = None,
    ) -> None:
        self.engine = engine
        self.actor = actor
        self.after_update, self.after_sync = parts_offloaded(offload)
        self.offload = offload
        self.barrier = barrier or (lambda: None)
        self.empty_cache_fn = empty_cache or _cuda_empty_cache
        self.trace = trace if trace is not None else []
        self.released: set[str] = set()
        """Engine regions released by this object and not resumed yet."""
        self.started = False
        self._cursor = 0  # the next entry of STEP_SEQUENCE in the step in progress

    # ------------------------------------------------------------------------------------------ the sequence
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Enter phase `name` (one of PHASES) of the step: the memory actions of STEP_SEQUENCE since the last phase run
        first, then the caller's work runs inside. Phases are entered in STEP_SEQUENCE's order, each at most once a
        step (a phase not entered is passed over, its actions still run); `end_step` runs the actions after the last
        one. The trainer's step reads as `with memory.phase("generation"): ...` for each phase in turn."""
        if name not in PHASES:
            raise ValueError(f"MemoryChoreographer.phase: unknown phase {name!r} (expected one of {PHASES})")
        target = STEP_SEQUENCE.index(name)
        if target < self._cursor:
            raise RuntimeError(
                f"MemoryChoreographer.phase: {name!r} entered after {STEP_SEQUENCE[self._cursor - 1]!r} in one step"
            )
        self._advance(target)
        if name == "generation":
            self.ensure_engine_resident()
        self.trace.append(name)
        self._cursor = target + 1
        yield

    def end_step(self) -> None:
        """Run the memory actions after the step's last phase; the next `phase` starts a new step."""
        self._advance(len(STEP_SEQUENCE))
        self._cursor = 0

    def _advance(self, target: int) -> None:
        """The entries of STEP_SEQUENCE from the cursor up to (not including) `target`: actions run, phases that were
        not entered are passed over (named in the trace). A step's first call also runs `start` once."""
        if not self.started:
            self.start()
        for name in STEP_SEQUENCE[self._cursor : target]:
            self.trace.append(name)
            if name not in PHASES:
                getattr(self, name)()
        self._cursor = target

    def run_step(self, phases: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
        """One training step as one call: each of PHASES entered in turn, phases[name]() run inside the ones given
        (a missing one only passes its memory actions). Returns {phase: its return value}."""
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"MemoryChoreographer.run_step: unknown phases {sorted(unknown)} (expected {PHASES})")
        out: dict[str, Any] = {}
        for name in PHASES:
            with self.phase(name):
                if name in phases:
                    out[name] = phases[name]()
        self.end_step()
        return out

    def build_engine(self, make: Callable[[], Any], *, sized_at_start: bool) -> Any:
        """Build this rank's engine (make() -> engine or None) and adopt it.

        sized_at_start: the engine sizes its KV pool once, from the GPU memory free when it starts (SGLang: weights +
        KV = mem_fraction_static x free memory at start; release/resume never re-size it). Then the engine starts in
        the memory state of the generation phase: what actor.offload keeps off the GPU while generating leaves first
        (offloaded, the cache emptied, a barrier: ranks share the engine's GPUs), so the pool is sized for the memory
        generation really has. Before, the engine started beside the whole actor and its pool stayed that small.
        """
        parts = (*self.after_update, *self.after_sync)
        if sized_at_start and parts:
            self.trace.append("engine_start")
            self.actor.offload_state(parts)
            self.empty_cache()
            self.started = True  # start() would offload the same parts
        self.engine = make()
        if sized_at_start and parts:
            self.barrier()
        return self.engine

    def replace_engine(self, make: Callable[[], Any]) -> Any:
        """Adopt a rebuilt engine (the old one died while generating): make() runs in the generation phase's memory
        state, as the first build did (an engine sizing its KV pool at start sizes it alike); nothing is released."""
        self.trace.append("engine_restart")
        self.engine = make()
        self.released = set()
        return self.engine

    @contextmanager
    def sync_beside_generation(self) -> Iterator[None]:
        """Around a weight sync in the generation phase (a restarted engine's): the actor's parameters are read by the
        export, so with actor.offload=all they come back for it and leave after; the cache is emptied after (the
        export's buckets), then a barrier. Every other engine stays resident: the sync's peak beside them is one
        bucket plus one gathered tensor, the headroom an engine's mem_fraction leaves (docs/rollout.md)."""
        self.trace.append("sync_beside_generation")
        if self.after_sync:
            self.actor.reload_state(self.after_sync)
        try:
            yield
        finally:
            if self.after_sync:
                self.actor.offload_state(self.after_sync)
            self.empty_cache()

    def start(self) -> None:
        """Before the first generation: offload what actor.offload keeps off the GPU while generating (the actor is
        built before the engine sizes its KV pool, so everything is resident until now)."""
        self.started = True
        parts = (*self.after_update, *self.after_sync)
        if parts:
            self.trace.append("start")
            self.actor.offload_state(parts)
            self.empty_cache()

    # ------------------------------------------------------------------------------------------ actions
    def release_engine(self) -> None:
        """Release weights, KV cache and CUDA graphs, then wait for every rank (they may share the engine's GPUs)."""
        if self.engine is not None:
            todo = [t for t in ENGINE_TAGS if t not in self.released]
            if todo:
                self.engine.release_memory(todo)
            self.released |= set(todo)
        self.barrier()

    def reload_actor(self) -> None:
        """Bring back whatever of the actor is in host memory (the log-probs need the parameters, the update all)."""
        self.actor.reload_state(None)

    def offload_actor(self) -> None:
        """Move what actor.offload sends away after the update (optimizer state; with "all" the gradients too)."""
        if self.after_update:
            self.actor.offload_state(self.after_update)

    def empty_cache(self) -> None:
        """Return the caching allocator's free blocks to the device, then wait for every rank."""
        self.empty_cache_fn()
        self.barrier()

    def resume_engine_weights(self) -> None:
        """Map the engine's weight memory back (contents are rewritten by the sync)."""
        self._resume(("weights",))

    def offload_actor_params(self) -> None:
        """With actor.offload=all the parameters leave once the export has read them."""
        if self.after_sync:
            self.actor.offload_state(self.after_sync)

    def resume_engine_kv(self) -> None:
        """Map the KV cache and CUDA graphs back: the engine is ready to generate."""
        self._resume(KV_TAGS)

    def ensure_engine_resident(self) -> None:
        """Resume any region still released (e.g. after an interrupted step); a no-op in the normal sequence."""
        self._resume(ENGINE_TAGS)

    def finish(self) -> None:
        """After the last step (the final export reads the parameters): release the engine, reload the actor's
        parameters if they were offloaded. The engine cannot generate afterwards."""
        self.trace.append("finish")
        self.release_engine()
        self.actor.reload_state(("params",))

    def _resume(self, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in self.released]
        if todo and self.engine is not None:
            self.engine.resume_memory(todo)
        self.released -= set(todo)


# ---------------------------------------------------------------------------------------------- for the planner
class _Probe:
    """Engine and actor stand-in that records which regions / parts are on the device."""

    def __init__(self) -> None:
        self.engine = set(ENGINE_TAGS)
        self.actor = set(PARTS)

    def release_memory(self, tags: Sequence[str]) -> None:
        self.engine -= set(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        self.engine |= set(tags)

    def offload_state(self, parts: Sequence[str]) -> int:
        self.actor -= set(parts)
        return 0

    def reload_state(self, parts: Sequence[str] | None = None) -> int:
        self.actor |= set(PARTS if parts is None else parts)
        return 0

    def snapshot(self) -> dict[str, tuple[str, ...]]:
        return {
            "engine": tuple(t for t in ENGINE_TAGS if t in self.engine),
            "actor": tuple(p for p in PARTS if p in self.actor),
        }


def resident_by_phase(offload: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """{phase: {"engine": regions on the device, "actor": parts on the device}} in the steady state (a second step)
    of MemoryChoreographer with actor.offload=offload. plan.py builds its phases from this."""
    probe = _Probe()
    chor = MemoryChoreographer(probe, probe, offload=offload, empty_cache=lambda: None)
    seen: dict[str, dict[str, tuple[str, ...]]] = {}
    for _ in range(2):
        chor.run_step({name: (lambda name=name: seen.__setitem__(name, probe.snapshot())) for name in PHASES})
    return seen
