"""The rollout engines as the rest of the package sees them: one table of what each engine can do, so that no file
outside rollout/ branches on an engine's name (config checks, the start-up checks, the planner, the split launch).
Torch-free: the config reads it on any import path. How each engine is built is rollout/factory.py's.

    name           package   modes                  fp8 weights   split launch         routing (r3)   delta sync
    transformers   (ours)    colocated              colocated     colocated (embedded)  yes            colocated, split
    sglang         sglang    colocated, server      both          server (drives them)  yes            server (loader)
    vllm           vllm      colocated              no            no                    no             no
    (memory: every engine is planned with SGLang's rules)

"server (loader)": SGLang servers apply the changed elements with rollout/sglang_loader.py, from actor rank 0 or, on a
split launch with rollout.weight_sync_route "direct", from the engine ranks relaying them (config.RolloutConfig's
check); FP8 ones too (the float8 weights and their block scales), except those relayed: an engine rank keeps no base
to quantize a change against. FP8 servers serve rollout/fp8.SGLANG_FP8_QUANTIZATION_CONFIG (docs/rollout.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    """One rollout engine's capabilities.

    package: the Python package an in-process engine imports (the start-up check imports it); None: nothing beyond
        this package. Server mode needs none here (it talks HTTP to servers started elsewhere).
    modes: the rollout.mode values it runs in. fp8_modes: those where rollout.weight_dtype "fp8" is implemented.
    split_modes: those where a split launch (rollout.engine_ranks > 0) runs it: "colocated" (the engine ranks hold
        embedded engines and receive the weights over the weight channel) or "server" (the engine ranks drive
        rollout.server_urls; actor rank 0 pushes the weights to the servers, or on the direct route the engine
        ranks relay them).
    routing: returns every token's routed experts (actor.routing_replay r3).
    delta_modes: those where its weight update applies changed-weights entries (rollout.weight_sync_delta,
        rollout/delta.py). SGLang servers apply them with rollout/sglang_loader.py (its custom-weight-loader seam),
        whoever sends them (actor rank 0, or the engine ranks relaying them).
    label: its name in prose. planned_as: the engine whose memory rules the planner applies to it.
    """

    name: str
    label: str
    package: str | None
    modes: tuple[str, ...]
    fp8_modes: tuple[str, ...]
    split_modes: tuple[str, ...]
    routing: bool
    delta_modes: tuple[str, ...] = ()
    planned_as: str = "sglang"

    def needs_package(self, mode: str) -> str | None:
        """The package the start-up check must import for this engine in `mode` (None: nothing to import)."""
        return None if mode == "server" else self.package


ENGINES: dict[str, EngineKind] = {
    e.name: e
    for e in (
        EngineKind(
            "transformers",
            "transformers",
            None,
            ("colocated",),
            ("colocated",),
            ("colocated",),
            routing=True,
            delta_modes=("colocated",),
        ),  # fmt: skip
        EngineKind(
            "sglang",
            "SGLang",
            "sglang",
            ("colocated", "server"),
            ("colocated", "server"),
            ("server",),
            routing=True,
            delta_modes=("server",),
        ),  # fmt: skip
        EngineKind("vllm", "vLLM", "vllm", ("colocated",), (), (), routing=False),
    )
}
"""rollout.engine's values."""

MODES = ("colocated", "server")
"""rollout.mode's values: the engine in the training processes, or servers started elsewhere."""


def engine_kind(name: str) -> EngineKind:
    """The table's entry for rollout.engine `name` (ValueError naming the field otherwise)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine: must be one of {list(ENGINES)}, got {name!r}")
    return ENGINES[name]


def with_capability(what: str, mode: str | None = None) -> str:
    """The engines (and modes) that have capability `what` ("fp8", "split", "routing", "delta"), for error lines."""
    names = []
    for e in ENGINES.values():
        modes = {"fp8": e.fp8_modes, "split": e.split_modes, "routing": e.modes if e.routing else (),
                 "delta": e.delta_modes}[what]  # fmt: skip
        names += [f"{m} {e.name}" if len(e.modes) > 1 else e.name for m in modes if mode is None or m == mode]
    return ", ".join(f'"{n}"' for n in names)
