"""The one call every loss function ends in: the reference or the fused kernel of a `Surrogate`."""

from torch import Tensor

from megatron_dapo.algorithms.policy_loss import LossInputs
from megatron_dapo.algorithms.policy_loss import Surrogate
from megatron_dapo.algorithms.policy_loss import surrogate_loss


def run_surrogate(inputs: LossInputs, spec: Surrogate, fused: bool | str) -> tuple[Tensor, dict[str, Tensor]]:
    """`surrogate_loss` (fused False) or `ops.pg_loss.fused_surrogate_loss` (fused True or a backend name, "triton"
    or "cuda": the kernel on GPU or under the Triton interpreter, the same reference otherwise). Triton is imported
    only when the fused path is asked for."""
    if not fused:
        return surrogate_loss(inputs, spec)
    from megatron_dapo.ops.pg_loss import fused_surrogate_loss

    return fused_surrogate_loss(inputs, spec, backend=fused if isinstance(fused, str) else None)
