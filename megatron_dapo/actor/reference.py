"""The frozen reference model of a loss with a KL term (GRPO with loss.kl_coef > 0).

    trainer: old_logp = actor.compute_logprobs(batch)      (the policy that sampled, current weights)
             ref_logp = reference.compute_logprobs(batch)  (actor.model_path as loaded, never updated)
             actor.update(batch)                           (loss += kl_coef * agg(k3(logp, ref_logp)))

The reference is a second Megatron model with the actor's parallel layout (TP/PP/DP groups), built from
actor.model_path with `MegatronActor(frozen=True)`: the same model code and log-prob path (packing, shared prefix,
kernels), no gradient buffers and no optimizer. It costs one more copy of the parameters per model-parallel rank
(docs/memory.md, "Reference model") and follows the actor's parameter offload (actor.offload: when the actor's
parameters leave the GPU for generation, so do the reference's).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.actor.distributed import ParallelGroups
from megatron_dapo.config import RunConfig


def reference_model(config: RunConfig, groups: ParallelGroups) -> MegatronActor:
    """The frozen reference: actor.model_path's weights in a `MegatronActor(frozen=True)` (collective: every rank)."""
    return MegatronActor(config, groups, hf_dir=config.actor.model_path, frozen=True)


class WithReference:
    """The actor and its reference as one `memory.MemoryActor`: the reference's parameters move with the actor's
    "params" part (it has no other part). Returns the bytes moved, both models together."""

    def __init__(self, actor: MegatronActor, reference: MegatronActor) -> None:
        self.actor, self.reference = actor, reference

    def offload_state(self, parts: Sequence[str]) -> int:
        moved = self.actor.offload_state(parts)
        return moved + (self.reference.offload_state(("params",)) if "params" in parts else 0)

    def reload_state(self, parts: Sequence[str] | None = None) -> int:
        moved = self.actor.reload_state(parts)
        return moved + (self.reference.reload_state(("params",)) if parts is None or "params" in parts else 0)
