"""The per-step memory choreography (megatron_dapo/memory.py) with a recording engine and a fake device ledger.

The ledger books bytes per owner on one GPU. The trainer process frees into torch's caching allocator (the bytes stay
reserved until empty_cache; a later trainer allocation reuses them); the engine is another process and frees for real.
Its sizes are the planner's terms for the shipped 32B layout, so driving the real sequence through it must give the
planner's phase totals (less the two runtime assumptions) for every actor.offload setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from megatron_dapo.config import load_config
from megatron_dapo.memory import ENGINE_TAGS
from megatron_dapo.memory import OFFLOAD_MODES
from megatron_dapo.memory import PARTS
from megatron_dapo.memory import PHASES
from megatron_dapo.memory import STEP_SEQUENCE
from megatron_dapo.memory import MemoryChoreographer
from megatron_dapo.memory import resident_by_phase
from megatron_dapo.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]
CFG_32B = ROOT / "examples/qwen2.5_32b_dapo.yaml"
ENGINE_OWNERS = {"weights": "engine weights", "kv_cache": "engine KV cache", "cuda_graph": "engine CUDA graphs"}
ACTOR_OWNERS = {"params": "actor params", "grads": "actor grads", "optimizer": "actor optimizer"}


class Ledger:
    """Bytes (GiB here) per owner on one GPU, the trainer's cached reserve, and the peak per phase."""

    def __init__(self) -> None:
        self.live: dict[str, float] = {}
        self.cached = 0.0
        self.phase = "start"
        self.peaks: dict[str, float] = {}

    @property
    def total(self) -> float:
        return sum(self.live.values()) + self.cached

    def alloc(self, owner: str, size: float, *, trainer: bool) -> None:
        assert owner not in self.live, f"{owner} allocated twice"
        if trainer:  # the caching allocator hands out reserved blocks first
            self.cached -= min(self.cached, size)
        self.live[owner] = size
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), self.total)

    def free(self, owner: str, *, trainer: bool) -> None:
        size = self.live.pop(owner)
        if trainer:
            self.cached += size

    def empty_cache(self) -> None:
        self.cached = 0.0


class RecordingEngine:
    """release_memory / resume_memory book the engine's regions; generate() needs all of them."""

    def __init__(self, ledger: Ledger, sizes: dict[str, float], calls: list) -> None:
        self.ledger, self.sizes, self.calls = ledger, sizes, calls
        for tag in ENGINE_TAGS:
            ledger.alloc(ENGINE_OWNERS[tag], sizes[ENGINE_OWNERS[tag]], trainer=False)

    def release_memory(self, tags: Sequence[str]) -> None:
        self.calls.append(("release_memory", tuple(tags)))
        for tag in tags:
            self.ledger.free(ENGINE_OWNERS[tag], trainer=False)

    def resume_memory(self, tags: Sequence[str]) -> None:
        self.calls.append(("resume_memory", tuple(tags)))
        for tag in tags:
            self.ledger.alloc(ENGINE_OWNERS[tag], self.sizes[ENGINE_OWNERS[tag]], trainer=False)

    def generate(self) -> None:
        assert all(o in self.ledger.live for o in ENGINE_OWNERS.values()), "generate with released engine memory"
        self.ledger.alloc("engine workspace", self.sizes["engine workspace"], trainer=False)
        self.ledger.free("engine workspace", trainer=False)


class RecordingActor:
    def __init__(self, ledger: Ledger, sizes: dict[str, float], calls: list) -> None:
        self.ledger, self.sizes, self.calls = ledger, sizes, calls
        for part in PARTS:
            ledger.alloc(ACTOR_OWNERS[part], sizes[ACTOR_OWNERS[part]], trainer=True)

    def offload_state(self, parts: Sequence[str]) -> int:
        self.calls.append(("offload_state", tuple(parts)))
        for part in parts:
            self.ledger.free(ACTOR_OWNERS[part], trainer=True)
        return 0

    def reload_state(self, parts: Sequence[str] | None = None) -> int:
        self.calls.append(("reload_state", tuple(parts or ())))
        for part in parts or PARTS:
            if ACTOR_OWNERS[part] not in self.ledger.live:
                self.ledger.alloc(ACTOR_OWNERS[part], self.sizes[ACTOR_OWNERS[part]], trainer=True)
        return 0

    def work(self, owner: str) -> None:
        """A phase's temporaries (activations, sync buckets): allocated, then freed into the cache."""
        assert all(o in self.ledger.live for o in ACTOR_OWNERS.values()) or owner == "sync buffers"
        self.ledger.alloc(owner, self.sizes[owner], trainer=True)
        self.ledger.free(owner, trainer=True)


def _planned(offload: str):
    """(sizes of every owner, planner phase totals less the runtimes) for stage 1 of the shipped 32B layout."""
    cfg = load_config(CFG_32B, [f"--actor.offload={offload}"])
    plan = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    phase = {p.name: p for p in plan.phases if p.stage == 1}
    upd, gen, lp, sync = phase["update"], phase["generation"], phase["log-probs"], phase["sync"]
    state = sum(upd.term(o) for o in ACTOR_OWNERS.values())
    sizes = {o: upd.term(o) for o in ACTOR_OWNERS.values()}
    sizes.update({o: gen.term(o) for o in (*ENGINE_OWNERS.values(), "engine workspace")})
    runtimes = upd.term("trainer runtime") + upd.term("engine runtime")
    sizes["activations (update)"] = upd.total_gib - runtimes - state
    sizes["working set (log-probs)"] = lp.total_gib - runtimes - state
    sizes["sync buffers"] = sync.term("sync buffers")
    expected = {name: phase[name].total_gib - runtimes for name in PHASES}
    return sizes, expected


def _run(offload: str, steps: int = 2, empty_cache: bool = True):
    sizes, expected = _planned(offload)
    ledger, calls, trace = Ledger(), [], []
    engine, actor = RecordingEngine(ledger, sizes, calls), RecordingActor(ledger, sizes, calls)
    ledger.peaks.clear()  # the initial booking (everything, as at engine start) is set-up, not the sequence
    ledger.phase = "between"

    def phase(name: str, work):
        def run() -> None:
            ledger.phase = name
            ledger.peaks[name] = max(ledger.peaks.get(name, 0.0), ledger.total)
            work()
            calls.append(("phase", name))
            ledger.phase = "between"  # the actions between phases

        return run

    chor = MemoryChoreographer(
        engine,
        actor,
        offload=offload,
        barrier=lambda: calls.append(("barrier",)),
        empty_cache=(lambda: (calls.append(("empty_cache",)), ledger.empty_cache())) if empty_cache else lambda: None,
        trace=trace,
    )
    for _ in range(steps):
        chor.run_step(
            {
                "generation": phase("generation", engine.generate),
                "log-probs": phase("log-probs", lambda: actor.work("working set (log-probs)")),
                "update": phase("update", lambda: actor.work("activations (update)")),
                "sync": phase("sync", lambda: actor.work("sync buffers")),
            }
        )
    return ledger, calls, trace, expected


def test_step_order_is_the_documented_sequence():
    ledger, calls, trace, _ = _run("all")
    # The first step first sends away what "all" keeps off the GPU while generating; then the sequence, twice.
    assert trace == ["start", *STEP_SEQUENCE, *STEP_SEQUENCE]
    step = calls[calls.index(("phase", "generation"), 1) + 1 :]  # the second step, after its generation
    step = step[: step.index(("phase", "generation"))] if ("phase", "generation") in step else step
    assert step[:4] == [
        ("release_memory", ENGINE_TAGS),
        ("barrier",),
        ("reload_state", ()),  # () = everything offloaded
        ("phase", "log-probs"),
    ]
    assert step[4:] == [
        ("phase", "update"),
        ("offload_state", ("grads", "optimizer")),
        ("empty_cache",),
        ("barrier",),
        ("resume_memory", ("weights",)),
        ("phase", "sync"),
        ("offload_state", ("params",)),
        ("empty_cache",),
        ("barrier",),
        ("resume_memory", ("kv_cache", "cuda_graph")),
    ]


@pytest.mark.parametrize("offload", ["none", "optimizer", "all"])
def test_ledger_peaks_match_the_planner(offload: str):
    ledger, _, _, expected = _run(offload)
    for name in PHASES:
        assert ledger.peaks[name] == pytest.approx(expected[name], abs=1e-9), name
    # No action between phases (release, reload, offload, resume) goes above the largest phase.
    assert ledger.peaks["between"] <= max(expected.values()) + 1e-9
    assert max(ledger.peaks.values()) == pytest.approx(max(expected.values()), abs=1e-9)
    if offload == "none":  # the shipped layout: generation is the largest phase (docs/planning.md, 67.14 - 3.5)
        assert max(ledger.peaks, key=ledger.peaks.get) == "generation"
        assert ledger.peaks["generation"] == pytest.approx(67.14 - 3.5, abs=0.01)


def test_without_empty_cache_the_engine_resumes_on_top_of_the_cache():
    """Why empty_cache is a step: the activations and the offloaded state stay reserved otherwise, and the engine
    (another process) cannot reuse them: the sync and the next generation would hold them too."""
    with_cache, _, _, expected = _run("all", empty_cache=False)
    assert with_cache.peaks["generation"] > expected["generation"] + 1.0
    assert with_cache.peaks["sync"] > expected["sync"] + 1.0


def test_planner_takes_residency_from_the_sequence():
    """plan.py orders and fills its phases from memory.py: same names, same order, same resident parts."""
    cfg = load_config(CFG_32B, ["--actor.offload=optimizer"])
    plan = make_plan(cfg, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    names = list(dict.fromkeys(p.name for p in plan.phases))
    assert names == ["engine start", *PHASES]
    assert [n for n in STEP_SEQUENCE if n in PHASES] == list(PHASES)
    res = resident_by_phase("optimizer")
    assert res["generation"] == {"engine": ENGINE_TAGS, "actor": ("params", "grads")}
    assert res["sync"] == {"engine": ("weights",), "actor": ("params", "grads")}
    assert res["update"]["engine"] == () and res["update"]["actor"] == PARTS
    gen = plan.peak("generation")
    assert gen.term("actor optimizer") == 0.0 and gen.term("actor grads") > 0.0


def test_engine_regions_are_resumed_before_generating_and_unknown_phases_refused():
    sizes, _ = _planned("none")
    ledger, calls = Ledger(), []
    engine = RecordingEngine(ledger, sizes, calls)
    chor = MemoryChoreographer(engine, RecordingActor(ledger, sizes, calls), empty_cache=lambda: None)
    chor.release_engine()  # e.g. a step that failed after releasing
    chor.run_step({"generation": engine.generate})
    assert ("resume_memory", ENGINE_TAGS) in calls
    with pytest.raises(ValueError, match="unknown phases"):
        chor.run_step({"generate": engine.generate})
    with pytest.raises(ValueError, match="actor.offload"):
        MemoryChoreographer(engine, None, offload="params")  # type: ignore[arg-type]


def test_offload_config_field_is_checked():
    from megatron_dapo.config import ActorConfig

    assert ActorConfig().offload == "none"
    assert ActorConfig(offload="all").offload == "all"
    with pytest.raises(ValueError, match="actor.offload"):
        ActorConfig(offload="cpu")


@pytest.mark.parametrize("offload", OFFLOAD_MODES)
def test_an_engine_that_sizes_its_pool_at_start_starts_in_the_generation_memory_state(offload):
    """build_engine(sized_at_start=True): while the engine starts, the actor holds exactly what it holds during
    generation (actor.offload's parts are in host memory, the cache emptied, every rank past the barrier)."""
    probe, trace, seen = _ProbeForBuild(), [], {}

    def make():
        seen["actor_at_start"] = tuple(p for p in PARTS if p in probe.actor)
        seen["trace_at_start"] = list(trace)
        return probe

    chor = MemoryChoreographer(None, probe, offload=offload, barrier=lambda: trace.append("barrier"), trace=trace)
    assert chor.build_engine(make, sized_at_start=True) is probe and chor.engine is probe
    during_generation = resident_by_phase(offload)["generation"]["actor"]
    assert seen["actor_at_start"] == during_generation
    if offload != "none":
        assert seen["trace_at_start"] == ["engine_start", "barrier"]  # emptied and synchronised before the start
    chor.run_step({})  # the first step does not offload again
    assert "start" not in trace
    plain = MemoryChoreographer(None, _ProbeForBuild(), offload=offload)
    assert plain.build_engine(lambda: "engine", sized_at_start=False) == "engine" and "engine_start" not in plain.trace


class _ProbeForBuild:
    def __init__(self) -> None:
        from megatron_dapo.memory import PARTS

        self.actor = set(PARTS)

    def offload_state(self, parts):
        self.actor -= set(parts)
        return 0

    def reload_state(self, parts=None):
        from megatron_dapo.memory import PARTS

        self.actor |= set(PARTS if parts is None else parts)
        return 0

    def release_memory(self, tags):
        pass

    def resume_memory(self, tags):
        pass


@pytest.mark.parametrize("offload", OFFLOAD_MODES)
def test_a_restarted_engines_sync_reads_the_parameters_and_leaves_generation_memory_as_it_was(offload):
    """replace_engine adopts a rebuilt engine with nothing released; sync_beside_generation brings the parameters back
    for the export when actor.offload keeps them away while generating, and leaves the generation state after it."""
    probe, trace = _ProbeForBuild(), []
    chor = MemoryChoreographer(None, probe, offload=offload, barrier=lambda: trace.append("barrier"), trace=trace)
    chor.build_engine(lambda: probe, sized_at_start=True)
    chor.run_step({})  # one step: the engine's regions were released and resumed, the actor as in generation
    generating = tuple(p for p in PARTS if p in probe.actor)
    assert generating == resident_by_phase(offload)["generation"]["actor"]
    new = _ProbeForBuild()
    assert chor.replace_engine(lambda: new) is new and chor.engine is new and chor.released == set()
    seen = {}
    with chor.sync_beside_generation():
        seen["during"] = tuple(p for p in PARTS if p in probe.actor)
    assert "params" in seen["during"]
    assert tuple(p for p in PARTS if p in probe.actor) == generating
    assert trace[-1] == "barrier"  # the cache emptied, every rank past it
