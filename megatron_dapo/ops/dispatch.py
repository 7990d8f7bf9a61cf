"""One dispatch rule for every fused op in megatron_dapo.ops.

``use_triton(tensor)`` decides which implementation an op runs:

- CUDA tensors run the compiled Triton kernels.
- CPU tensors run the chunked pure-torch references in ``ops/reference.py`` ...
- ... unless ``TRITON_INTERPRET=1`` is set in the environment, in which case CPU tensors run the same Triton kernels
  through the Triton interpreter (tests). The variable must be set before the kernel modules are imported, because
  Triton picks the interpreter when ``@triton.jit`` runs; tests/conftest.py does this.

The environment is read once at import time, the same moment Triton reads it, so the two never disagree.

``kernel_backend(backend)`` picks the GPU implementation: the compiled Triton kernels ("triton", default) or the
CUDA C++ twins from csrc/ ("cuda"). A run chooses it with its one kernel switch, ``actor.logprob_impl`` (the registry
in actor/loss.py: "reference", "fused" / "fused_linear" on Triton, "fused_cuda" on the CUDA twins); no environment
variable selects a backend. ``TRITON_INTERPRET`` is Triton's own debugging switch, used by the tests only.
"""

import os

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on ``tensor`` should run its Triton kernel.

    Args:
        tensor: any input tensor of the op; only its device is read.

    Returns:
        True for CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1 was set at import; False otherwise
        (the op then runs its chunked torch reference).
    """
    if tensor.is_cuda:
        return True
    return _INTERPRET and tensor.device.type == "cpu"


def interpreting() -> bool:
    """True when the Triton interpreter is active (TRITON_INTERPRET=1 at import time)."""
    return _INTERPRET


KERNEL_BACKENDS = ("triton", "cuda")


def kernel_backend(backend: str | None = None) -> str:
    """The GPU backend name: ``backend`` if given, else "triton".

    Args:
        backend: "triton", "cuda" or None.

    Returns:
        One of KERNEL_BACKENDS; an unknown name raises ValueError naming the choices.
    """
    name = backend or "triton"
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend: unknown {name!r}; choose one of {KERNEL_BACKENDS}")
    return name
