"""Explicit shims that let megatron-core 0.16 run on CPU over gloo (development machines and CI).

API:
    apply_cpu_compat() -> None      install every shim once (idempotent; no-op when CUDA is available)
    moe_without_te_compat() -> None the two MoE shims below, also needed on a GPU without Transformer Engine
    mla_without_te_compat() -> None the multi-latent attention shim below, likewise
    cpu_compat_applied() -> bool    whether the shims are installed in this process
    import_megatron_core() -> None  import megatron.core; without CUDA, its jit fusions stay plain functions

Call it explicitly, before building models or process groups, and only when CUDA is absent:

    if not torch.cuda.is_available():
        apply_cpu_compat()

Nothing is patched at import time. What the shims do (each one exists because megatron-core assumes a GPU):

- `torch.cuda.current_device()` returns `torch.device("cpu")`: megatron passes it as `device=` (~100 places).
- `torch.cuda.synchronize`/`empty_cache` become no-ops; `current_stream`/`default_stream`/`Stream`/`stream`/`Event`
  become inert stand-ins (CPU work is synchronous, so waiting on a stream or event is always satisfied).
- The "cuda" RNG is the CPU default generator: `torch.cuda.get_rng_state/set_rng_state/manual_seed(_all)` and
  megatron's `_get_cuda_rng_state/_set_cuda_rng_state` read and write it, so `model_parallel_cuda_manual_seed`, the
  RNG tracker's `fork()` and activation recompute (which restores RNG states) work unchanged.
- Modules with literal `device="cuda"` tensor factories (pipeline schedules, optimizer, grad-norm clipping, causal
  masks, ...) see a stand-in `torch` module whose factories map device "cuda" to "cpu"; other attributes pass
  through, so there is no per-op cost in model code.
- A few cold functions (construction-time only) run under a TorchFunctionMode that maps `Tensor.cuda()` to the CPU
  and reports CPU tensors as `torch.cuda.*Tensor` from `Tensor.type()`: the optimizer's dtype checks and the
  tied-embedding copy to the last pipeline stage.

- MoE (`moe_without_te_compat`, applied with the rest and by build_gpt_model for MoE models without TE):
  megatron-core 0.16.1's router tests `te_general_gemm is not None`, a name its moe_utils defines only when TE
  imports (NameError without it): it is set to None there. The alltoall dispatcher converts its split sizes with
  `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts CUDA tensors only; CPU tensors stay tensors, which
  `all_to_all_single` rejects as split sizes (TypeError): the token dispatcher's copy returns them as numpy.

- Multi-latent attention (`mla_without_te_compat`, by build_gpt_model for MLA models without TE): megatron-core
  0.16.1's multi_latent_attention sets HAVE_TE when `megatron.core.extensions.transformer_engine` imports, which it
  does without TE (its TE classes are then placeholders), and tests `isinstance(linear_proj, TELinear)` under it
  (TypeError): its HAVE_TE is set to the extension's own.

Known not to work on CPU whatever the shims: gradient_accumulation_fusion, persist_layer_norm, apply_rope_fusion
(needs TE), sequence_parallel, the dynamic inference engine. bf16 parameters need megatron's Float16Module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_MARKER = "_megatron_dapo_cpu_compat"

# Modules that create tensors with a literal device="cuda"; they get the device-mapping `torch` stand-in.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.transformer.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)

# (module, qualified attribute) of cold functions that run under _CudaToCpuMode.
_MODE_WRAPPED = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    # asserts param.grad.type() == 'torch.cuda.FloatTensor' whenever clip_grad > 0
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
)

_FACTORIES = (
    "arange",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
)


def _no_compile(model: Any = None, **_: Any) -> Any:
    """torch.compile's signature, compiling nothing (decorator and call forms)."""
    return (lambda fn: fn) if model is None else model


def import_megatron_core() -> None:
    """Import megatron.core (explicitly, before anything else in the process imports it); without CUDA, with
    torch.compile a no-op for the duration of the import.

    Why: megatron.core.jit binds `jit_fuser = torch.compile` at import, and megatron's fusion modules decorate with it
    as the package imports them; each decoration sets up dynamo and inductor, ~5 s of every CPU process's start-up
    (profiled: 38 calls, 7.9 s of a 46 s one-step run). None of those functions runs in our CPU paths (their bias /
    fusion switches are off; called once, inductor would spend ~40 s compiling it), so left undecorated they change
    no number. torch.compile is restored right after; with CUDA, or when megatron.core is already imported, this is a
    plain import."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        importlib.import_module("megatron.core")
        return
    compile_ = torch.compile
    torch.compile = _no_compile
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_


def cpu_compat_applied() -> bool:
    """True once apply_cpu_compat() has installed the shims in this process."""
    return bool(getattr(torch.cuda, _MARKER, False))


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs = dict(kwargs)
        kwargs["device"] = "cpu"
    return kwargs


class _CpuDeviceTorch(types.ModuleType):
    """`torch` as seen by a megatron module with device="cuda" literals: factories build CPU tensors."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    @staticmethod
    def _factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
            kwargs = _map_device(kwargs)
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps device "cuda" to the CPU and makes CPU tensors report `torch.cuda.*Tensor` types (cold paths only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = _map_device(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


def _under_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CudaToCpuMode():
            return fn(*args, **kwargs)

    return wrapper


class _Stream:
    """Inert CUDA stream stand-in: CPU work is synchronous, so every wait is already satisfied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _Event:
    """Inert CUDA event stand-in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        del other
        return 0.0


_DEFAULT_STREAM = _Stream()


def _patch_torch_cuda() -> None:
    cpu_gen = torch.default_generator
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    # The "cuda" RNG is the CPU default generator (the one CPU init/dropout draw from). Never call
    # torch.manual_seed here: it seeds torch.cuda too, which would recurse into these shims.
    cuda.get_rng_state = lambda device="cuda": cpu_gen.get_state()
    cuda.set_rng_state = lambda new_state, device="cuda": cpu_gen.set_state(new_state)
    cuda.manual_seed = lambda seed: cpu_gen.manual_seed(int(seed)) and None
    cuda.manual_seed_all = cuda.manual_seed
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


class _DropCpuRngWarning(logging.Filter):
    """The RNG tracker warns when the CPU RNG moves inside fork(); on CPU the tracker *is* the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_megatron_rng() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    cpu_gen = torch.default_generator

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        del device, clone, graph_safe
        return cpu_gen.get_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        del device, graph_safe
        cpu_gen.set_state(new_state)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state
    logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())


def _patch_megatron_modules() -> None:
    stand_in = _CpuDeviceTorch()
    for name in _CUDA_LITERAL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # optional deps (e.g. psutil for dist_checkpointing) missing: nothing to patch
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = stand_in
    for module_name, qualname in _MODE_WRAPPED:
        owner: Any = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = owner.__dict__[attr]
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(owner, attr, type(raw)(_under_mode(raw.__func__)))
        else:
            setattr(owner, attr, _under_mode(raw))


def moe_without_te_compat() -> None:
    """The MoE shims (module docstring). Idempotent; changes nothing when Transformer Engine is importable."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher

    if getattr(moe_utils, "HAVE_TE", False) or getattr(token_dispatcher, _MARKER, False):
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(to_cpu)
    def splits_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        out = to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out

    token_dispatcher.maybe_move_tensor_to_cpu = splits_to_cpu
    setattr(token_dispatcher, _MARKER, True)


def mla_without_te_compat() -> None:
    """The multi-latent attention shim (module docstring). Idempotent; changes nothing when TE is importable."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not getattr(transformer_engine, "HAVE_TE", False):
        multi_latent_attention.HAVE_TE = False


def apply_cpu_compat() -> None:
    """Install the CPU shims for megatron-core (see the module docstring). Idempotent.

    Does nothing when CUDA is available: GPU runs must use the real CUDA paths.
    """
    if cpu_compat_applied():
        return
    if torch.cuda.is_available():
        logging.getLogger(__name__).info("CUDA is available: megatron-core CPU shims not applied")
        return
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_modules()
    moe_without_te_compat()
    setattr(torch.cuda, _MARKER, True)
