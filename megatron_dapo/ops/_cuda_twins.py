"""Python binding of the CUDA C++ twins in csrc/ (ctypes + torch.library custom ops).

The library exposes a torch-free C ABI (see csrc/README.md), so it is loaded with ctypes and each entry point is
wrapped in a `torch.library.custom_op` (with a fake implementation, so torch.compile can trace through it).

Where the library comes from, first match wins:
1. env MEGATRON_DAPO_CUDA_LIB: path of a library built with `python csrc/build.py --out DIR`;
2. megatron_dapo/ops/_megatron_dapo_cuda*.so, built by `MEGATRON_DAPO_BUILD_CUDA=1 pip install -e .`.

Selection at run time: actor.logprob_impl "fused_cuda", or per call `fused_surrogate_loss(..., backend="cuda")`
(every policy loss) / `logprobs_and_entropy(..., backend="cuda")`; the log-prob twin is `logprobs_and_entropy_cuda`
below (single rank or one vocab shard via class_start / n_valid).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import Tensor

from megatron_dapo.algorithms.policy_loss import ClipBounds

ABI_VERSION = 3  # 3: the pg entry points take kind, seq_lr, seq_ids (every policy loss); mdapo_seq_log_ratio
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_c_int64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_SIGNATURES = {
    "mdapo_abi_version": ([], ctypes.c_int),
    "mdapo_error_string": ([ctypes.c_int], ctypes.c_char_p),
    "mdapo_pg_loss_workspace_rows": ([_c_int64], _c_int64),
    "mdapo_pg_loss_fwd": (
        [_ptr, _ptr, _ptr, _ptr, ctypes.c_int, _c_int64, _c_int64, ctypes.c_int]
        + [ctypes.c_float] * 6
        + [ctypes.c_int, ctypes.c_int, _ptr, _ptr]  # dual_clip, kind, seq_lr, seq_ids
        + [_ptr, _c_int64, _ptr, _ptr],
        ctypes.c_int,
    ),
    "mdapo_pg_loss_bwd": (
        [_ptr, _ptr, _ptr, _ptr, ctypes.c_int, _c_int64, _c_int64, ctypes.c_int]
        + [ctypes.c_float] * 6
        + [ctypes.c_int, ctypes.c_int, _ptr, _ptr]
        + [_ptr, _ptr, _ptr, _ptr],
        ctypes.c_int,
    ),
    "mdapo_seq_log_ratio": ([_ptr, _ptr, _ptr, ctypes.c_int, _ptr, _c_int64, _ptr, _ptr], ctypes.c_int),
    "mdapo_logprob_entropy_fwd": (
        [_ptr, _c_int64, ctypes.c_int, _ptr, _c_int64, _c_int64, _c_int64, _c_int64, ctypes.c_float, _ptr, _ptr, _ptr],
        ctypes.c_int,
    ),
    "mdapo_logprob_entropy_bwd": (
        [_ptr, _c_int64, ctypes.c_int, _ptr, _c_int64, _c_int64, _c_int64, _c_int64, ctypes.c_float]
        + [_ptr, _ptr, _ptr, _ptr, _c_int64, _ptr],
        ctypes.c_int,
    ),
}


def library_path() -> Path | None:
    """Path of the compiled twins library, or None when none is built (see the module docstring)."""
    env = os.environ.get("MEGATRON_DAPO_CUDA_LIB")
    if env:
        return Path(env)
    found = sorted(Path(__file__).resolve().parent.glob("_megatron_dapo_cuda*.so"))
    return found[0] if found else None


@functools.cache
def load_library(path: str | None = None) -> ctypes.CDLL:
    """Load the library (cached) and declare its C signatures; raise RuntimeError with the fix if unavailable."""
    lib_path = Path(path) if path else library_path()
    if lib_path is None or not lib_path.exists():
        raise RuntimeError(
            f"CUDA twins library not found ({lib_path or 'no MEGATRON_DAPO_CUDA_LIB, no built extension'}): build it "
            "with `python csrc/build.py --out DIR` and set MEGATRON_DAPO_CUDA_LIB=DIR/libmegatron_dapo_cuda.so, "
            "or reinstall with MEGATRON_DAPO_BUILD_CUDA=1"
        )
    lib = ctypes.CDLL(str(lib_path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    if lib.mdapo_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{lib_path}: ABI version {lib.mdapo_abi_version()} != expected {ABI_VERSION}; rebuild")
    return lib


def available() -> bool:
    """True when the library is built and loads (it still needs a GPU to run)."""
    try:
        load_library()
    except (RuntimeError, OSError):
        return False
    return True


def check(code: int, what: str) -> None:
    """Raise RuntimeError naming the entry point if a C call returned a CUDA error."""
    if code != 0:
        msg = load_library().mdapo_error_string(code).decode()
        raise RuntimeError(f"{what}: CUDA error {code} ({msg})")


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _pg_common(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor):
    """fp32 contiguous inputs and the mask argument pair (uint8 or fp32) of the pg entry points."""
    logp, old_logp, adv = (t.detach().to(torch.float32).contiguous() for t in (logp, old_logp, adv))
    if mask.dtype in (torch.bool, torch.uint8):
        mask, is_u8 = mask.contiguous().view(torch.uint8), 1
    else:
        mask, is_u8 = mask.to(torch.float32).contiguous(), 0
    return logp, old_logp, adv, mask, is_u8


def _layout_args(kind: int, seq_lr: Tensor | None, seq_ids: Tensor | None) -> tuple[int, int, int]:
    """(kind, seq_lr pointer, seq_ids pointer) of the pg entry points; 0 is the C null pointer."""
    return kind, 0 if seq_lr is None else seq_lr.data_ptr(), 0 if seq_ids is None else seq_ids.data_ptr()


@torch.library.custom_op("megatron_dapo::pg_loss_cuda", mutates_args=())
def _pg_loss_op(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    bounds: list[float],
    dual_clip: bool,
    kind: int,
    seq_lr: Tensor | None,
    seq_ids: Tensor | None,
    seq_len: int,
    grad_scale: Tensor | None,
) -> Tensor:
    lib = load_library()
    lp, old, a, m, is_u8 = _pg_common(logp, old_logp, adv, mask)
    n = lp.numel()
    head = (lp.data_ptr(), old.data_ptr(), a.data_ptr(), m.data_ptr(), is_u8, n, seq_len, int(a.shape == lp.shape))
    tail = (*bounds, int(dual_clip), *_layout_args(kind, seq_lr, seq_ids))
    if grad_scale is None:
        rows = lib.mdapo_pg_loss_workspace_rows(n)
        workspace = torch.empty((rows, 8), dtype=torch.float32, device=lp.device)
        out = torch.empty(7, dtype=torch.float32, device=lp.device)
        code = lib.mdapo_pg_loss_fwd(*head, *tail, workspace.data_ptr(), rows, out.data_ptr(), _stream(lp))
        check(code, "mdapo_pg_loss_fwd")
    else:
        scale = grad_scale.detach().to(torch.float32).contiguous()  # [2]: grad_out, inv_denom
        out = torch.empty_like(lp)
        code = lib.mdapo_pg_loss_bwd(
            *head, *tail, scale[0:1].data_ptr(), scale[1:2].data_ptr(), out.data_ptr(), _stream(lp)
        )
        check(code, "mdapo_pg_loss_bwd")
    return out


@_pg_loss_op.register_fake
def _(logp, old_logp, adv, mask, bounds, dual_clip, kind, seq_lr, seq_ids, seq_len, grad_scale):
    return logp.new_empty(7, dtype=torch.float32) if grad_scale is None else torch.empty_like(logp, dtype=torch.float32)


@torch.library.custom_op("megatron_dapo::seq_log_ratio_cuda", mutates_args=())
def seq_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, starts: Tensor) -> Tensor:
    """CUDA twin of GSPO's pass 1 (pg_loss.sequence_log_ratio_fused): [S] fp32 mean of logp - old_logp over the
    valid tokens of each sequence, the flat token ranges starts[s] .. starts[s + 1] - 1 (starts [S + 1] int32)."""
    lib = load_library()
    lp, old, _, m, is_u8 = _pg_common(logp, old_logp, logp, mask)
    st = starts.to(torch.int32).contiguous()
    out = torch.empty(st.numel() - 1, dtype=torch.float32, device=lp.device)
    code = lib.mdapo_seq_log_ratio(
        lp.data_ptr(), old.data_ptr(), m.data_ptr(), is_u8, st.data_ptr(), out.numel(), out.data_ptr(), _stream(lp)
    )
    check(code, "mdapo_seq_log_ratio")
    return out


@seq_log_ratio.register_fake
def _(logp, old_logp, mask, starts):
    return logp.new_empty(starts.numel() - 1, dtype=torch.float32)


def _bound_list(b: ClipBounds) -> list[float]:
    """(lo, hi, clip_c, log_lo, log_hi, log_c) in the order of the C entry points."""
    return [b.lo, b.hi, 0.0 if b.clip_c is None else b.clip_c, b.log_lo, b.log_hi, b.log_c]


def pg_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    bounds: ClipBounds,
    kind: int = 0,
    seq_lr: Tensor | None = None,
    seq_ids: Tensor | None = None,
    seq_len: int | None = None,
    grad_scale: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """CUDA twin of the pg kernels. Forward (grad_scale None): [7] fp32 totals in the layout of
    pg_loss._reduce_partials. Backward (grad_scale = (grad_out, inv_denom), 0-dim): d loss / d logp in logp's shape
    and dtype. kind: a pg_loss.KIND_CODES value; seq_lr [S] fp32 for GSPO; seq_ids [N] int32 for a packed layout
    (else rows of seq_len = logp.shape[-1] tokens)."""
    seq_len = max(logp.shape[-1], 1) if seq_len is None else seq_len
    scale = None if grad_scale is None else torch.stack([t.detach().to(torch.float32).reshape(()) for t in grad_scale])
    out = _pg_loss_op(
        logp, old_logp, adv, mask, _bound_list(bounds), bounds.clip_c is not None, kind, seq_lr, seq_ids, seq_len, scale
    )
    return out if grad_scale is None else out.to(logp.dtype)


def _logits_2d(logits: Tensor) -> Tensor:
    if logits.dtype not in DTYPE_CODES:
        raise ValueError(f"logprobs_and_entropy_cuda: logits dtype {logits.dtype} not in {list(DTYPE_CODES)}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()


@torch.library.custom_op("megatron_dapo::logprob_entropy_stats_cuda", mutates_args=())
def logprob_entropy_stats(
    logits: Tensor, labels: Tensor, temperature: float, class_start: int, n_valid: int
) -> tuple[Tensor, Tensor]:
    """Shard stats [3, T] fp32 (lse, entropy, target logit) and logp [T] fp32 = stats[2] - stats[0].

    logits: [T, V_local] fp32/fp16/bf16 (unit column stride); labels: [T] int64 global ids; columns >= n_valid are
    padding; labels outside [class_start, class_start + n_valid) contribute a target logit of 0.
    """
    lib = load_library()
    x = _logits_2d(logits)
    y = labels.to(torch.int64).contiguous()
    num_rows, n_cols = x.shape
    stats = torch.empty((3, num_rows), dtype=torch.float32, device=x.device)
    logp = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    code = lib.mdapo_logprob_entropy_fwd(
        x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], y.data_ptr(), num_rows, n_cols, n_valid, class_start,
        temperature, stats.data_ptr(), logp.data_ptr(), _stream(x),
    )  # fmt: skip
    check(code, "mdapo_logprob_entropy_fwd")
    return stats, logp


@logprob_entropy_stats.register_fake
def _(logits, labels, temperature, class_start, n_valid):
    num_rows = logits.shape[0]
    return logits.new_empty((3, num_rows), dtype=torch.float32), logits.new_empty(num_rows, dtype=torch.float32)


@torch.library.custom_op("megatron_dapo::logprob_entropy_grad_cuda", mutates_args=())
def logprob_entropy_grad(
    logits: Tensor,
    labels: Tensor,
    stats: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    class_start: int,
    n_valid: int,
) -> Tensor:
    """d(sum g_logp * logp + g_ent * H) / d logits [T, V_local] in logits' dtype; stats are the GLOBAL [3, T]."""
    lib = load_library()
    x = _logits_2d(logits)
    y = labels.to(torch.int64).contiguous()
    st = stats.to(torch.float32).contiguous()
    g_lp, g_h = (g.to(torch.float32).contiguous() for g in (grad_logp, grad_entropy))
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows, n_cols = x.shape
    code = lib.mdapo_logprob_entropy_bwd(
        x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], y.data_ptr(), num_rows, n_cols, n_valid, class_start,
        temperature, st.data_ptr(), g_lp.data_ptr(), g_h.data_ptr(), grad.data_ptr(), grad.stride(0), _stream(x),
    )  # fmt: skip
    check(code, "mdapo_logprob_entropy_bwd")
    return grad


@logprob_entropy_grad.register_fake
def _(logits, labels, stats, grad_logp, grad_entropy, temperature, class_start, n_valid):
    return torch.empty_like(logits)


class _LogProbEntropyCuda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, class_start, n_valid):
        stats, logp = logprob_entropy_stats(logits, labels, temperature, class_start, n_valid)
        ctx.save_for_backward(logits, labels, stats)
        ctx.args = (temperature, class_start, n_valid)
        return logp, stats[1]

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, labels, stats = ctx.saved_tensors
        g_logp = torch.zeros_like(stats[0]) if g_logp is None else g_logp
        g_ent = torch.zeros_like(stats[0]) if g_ent is None else g_ent
        grad = logprob_entropy_grad(logits, labels, stats, g_logp, g_ent, *ctx.args)
        return grad, None, None, None, None


def logprobs_and_entropy_cuda(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, class_start_idx: int = 0, n_valid: int | None = None
) -> tuple[Tensor, Tensor]:
    """CUDA C++ twin of `ops.logprobs_and_entropy` without a tp_group (one rank, or one shard's local softmax).

    Args:
        logits: [T, V_local] fp32/fp16/bf16 CUDA tensor.
        labels: [T] int64 global token ids; ids outside [class_start_idx, class_start_idx + n_valid) are ignored.
        temperature: logits are divided by it.
        class_start_idx: global id of local column 0.
        n_valid: leading local columns that are real tokens (the rest is vocab padding); default all.
    Returns:
        (logp, entropy): [T] fp32 each, differentiable w.r.t. logits.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logprobs_and_entropy_cuda: need logits [T, V] and labels [T], got {tuple(logits.shape)}, "
            f"{tuple(labels.shape)}"
        )
    if not temperature > 0.0:
        raise ValueError(f"logprobs_and_entropy_cuda: temperature must be > 0, got {temperature}")
    n_valid = logits.shape[1] if n_valid is None else n_valid
    return _LogProbEntropyCuda.apply(logits, labels, float(temperature), int(class_start_idx), int(n_valid))
