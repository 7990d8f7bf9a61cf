"""The CUDA C++ twins in csrc/: they compile for sm_90 with the machine's nvcc, export their C ABI, load through
ctypes, and (on a GPU) match the references."""

import ctypes
import math
import shutil
import subprocess

import pytest
import torch

from csrc import build as csrc_build
from megatron_dapo.algorithms.policy_loss import ClipBounds
from megatron_dapo.ops import _cuda_twins

pytestmark = pytest.mark.skipif(
    csrc_build.find_nvcc() is None and shutil.which("nvcc") is None, reason="nvcc not found (CUDA toolkit absent)"
)


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("mdapo_cuda") / csrc_build.LIB_NAME
    return csrc_build.build_library(out, archs=["90"])


def test_library_builds_and_exports_symbols(built_lib):
    assert built_lib.exists() and built_lib.stat().st_size > 10_000
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    symbols = subprocess.run([nm, "-D", "--defined-only", str(built_lib)], capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    missing = set(csrc_build.EXPORTED_SYMBOLS) - exported
    assert not missing, f"symbols missing from {built_lib}: {missing}"
    # the binding declares exactly the entry points the library exports
    assert set(_cuda_twins._SIGNATURES) == set(csrc_build.EXPORTED_SYMBOLS)


def test_ctypes_load_and_host_entry_points(built_lib, monkeypatch):
    monkeypatch.setenv("MEGATRON_DAPO_CUDA_LIB", str(built_lib))
    _cuda_twins.load_library.cache_clear()
    try:
        lib = _cuda_twins.load_library()
        assert lib.mdapo_abi_version() == _cuda_twins.ABI_VERSION
        assert _cuda_twins.available()
        assert lib.mdapo_pg_loss_workspace_rows(0) == 1
        assert lib.mdapo_pg_loss_workspace_rows(2048) == 1 and lib.mdapo_pg_loss_workspace_rows(2049) == 2
        assert lib.mdapo_error_string(0) == b"no error"
        # invalid arguments are rejected before any launch (cudaErrorInvalidValue = 1)
        assert lib.mdapo_logprob_entropy_fwd(None, 1, 7, None, 3, 4, 4, 0, 1.0, None, None, None) == 1
        assert lib.mdapo_logprob_entropy_fwd(None, 1, 0, None, 3, 4, 4, 0, 0.0, None, None, None) == 1
        bounds = (0.8, 1.28, 0.0, math.log(0.8), math.log(1.28), 0.0)
        assert lib.mdapo_pg_loss_fwd(*([None] * 4), 0, 10, 0, 0, *bounds, 0, 0, None, None, None, 0, None, None) == 1
        # kind out of range, GSPO without its sequence log-ratios: refused before any launch
        ws = 1  # rows the workspace would need for 10 tokens
        assert lib.mdapo_pg_loss_fwd(*([None] * 4), 0, 10, 10, 0, *bounds, 0, 3, None, None, None, ws, None, None) == 1
        assert lib.mdapo_pg_loss_fwd(*([None] * 4), 0, 10, 10, 0, *bounds, 0, 1, None, None, None, ws, None, None) == 1
        assert (
            lib.mdapo_pg_loss_bwd(*([None] * 4), 0, 10, 10, 0, *bounds, 0, 1, None, None, None, None, None, None) == 1
        )
        assert lib.mdapo_seq_log_ratio(None, None, None, 0, None, 0, None, None) == 0  # no sequences: nothing to do
        assert lib.mdapo_seq_log_ratio(None, None, None, 0, None, 3, None, None) == 1  # no offsets
        if not torch.cuda.is_available():
            x = torch.zeros(2, 3)
            with pytest.raises(RuntimeError, match="mdapo_pg_loss_fwd: CUDA error"):
                _cuda_twins.pg_loss(x, x, torch.zeros(2), x > 0, ClipBounds.make(0.2, 0.28, None))
            with pytest.raises(RuntimeError, match="mdapo_pg_loss_bwd: CUDA error"):
                scale = (torch.ones(()), torch.ones(()))
                _cuda_twins.pg_loss(x, x, torch.zeros(2), x > 0, ClipBounds.make(0.2, 0.28, None), grad_scale=scale)
    finally:
        _cuda_twins.load_library.cache_clear()


def test_missing_library_message(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_DAPO_CUDA_LIB", str(tmp_path / "nope.so"))
    _cuda_twins.load_library.cache_clear()
    try:
        assert not _cuda_twins.available()
        with pytest.raises(RuntimeError, match="csrc/build.py"):
            _cuda_twins.load_library()
    finally:
        _cuda_twins.load_library.cache_clear()


def test_arch_parsing_and_setup_hook():
    assert csrc_build.parse_archs(["9.0", "sm_80", "90"]) == ("90", "80")
    with pytest.raises(ValueError, match="bad CUDA arch"):
        csrc_build.parse_archs(["hopper"])
    cmd = csrc_build.nvcc_command(
        "nvcc", [csrc_build.CSRC_DIR / "pg_loss.cu"], csrc_build.CSRC_DIR / "x.o", ("90",), "object"
    )
    assert "arch=compute_90,code=sm_90" in cmd and "-c" in cmd
    ext_modules, cmdclass = csrc_build.cuda_extension()
    assert [e.name for e in ext_modules] == [csrc_build.EXT_NAME]
    assert "build_ext" in cmdclass


def _cuda_env(built_lib, monkeypatch):
    monkeypatch.setenv("MEGATRON_DAPO_CUDA_LIB", str(built_lib))
    _cuda_twins.load_library.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shard", [False, True])
def test_gpu_logprob_entropy_twin(built_lib, monkeypatch, dtype, shard):
    from megatron_dapo.ops.reference import _chunk_dz
    from megatron_dapo.ops.reference import _chunk_stats

    _cuda_env(built_lib, monkeypatch)
    num_rows, v_local, temperature = 37, 5000, 0.7
    logits = (torch.randn(num_rows, v_local, device="cuda") * 3).to(dtype).requires_grad_()
    class_start, n_valid = (v_local, v_local - 123) if shard else (0, v_local)
    labels = torch.randint(class_start, class_start + n_valid, (num_rows,), device="cuda")
    if shard:
        labels[:3] = 0  # off-shard labels contribute a target logit of 0
    logp, ent = _cuda_twins.logprobs_and_entropy_cuda(
        logits, labels, temperature=temperature, class_start_idx=class_start, n_valid=n_valid
    )
    g_lp, g_h = torch.randn(num_rows, device="cuda"), torch.randn(num_rows, device="cuda")
    (grad,) = torch.autograd.grad((logp * g_lp + ent * g_h).sum(), logits)
    z = logits.detach().double() / temperature
    z[:, n_valid:] = float("-inf")
    stats = _chunk_stats(z, labels - class_start)
    ref_dz = _chunk_dz(z, labels - class_start, stats, torch.stack([g_lp, g_h]).double()) / temperature
    torch.testing.assert_close(logp.double(), stats[2] - stats[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), stats[1], rtol=1e-5, atol=2e-5)
    tol = {"rtol": 1e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 3e-3}
    torch.testing.assert_close(grad.double(), ref_dz, **tol)
    assert torch.all(grad[:, n_valid:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_gpu_pg_loss_twin(built_lib, monkeypatch, clip_c):
    from megatron_dapo.algorithms.policy_loss import dapo_policy_loss
    from megatron_dapo.ops.pg_loss import clipped_pg_loss

    _cuda_env(built_lib, monkeypatch)
    logp = (-torch.rand(8, 3000, device="cuda") * 3).requires_grad_()
    old = logp.detach() + torch.randn_like(logp) * 0.5
    adv = torch.randn(8, device="cuda")
    mask = torch.rand(8, 3000, device="cuda") > 0.2
    kw = {"clip_ratio_c": clip_c}
    loss, m = clipped_pg_loss(logp, old, adv, mask, backend="cuda", **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_loss, ref_m = dapo_policy_loss(logp, old, adv, mask, **kw)
    (ref_grad,) = torch.autograd.grad(ref_loss, logp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=2e-6)
    for k, v in m.items():
        torch.testing.assert_close(v, ref_m[k], rtol=1e-5, atol=2e-6, msg=k)
    assert isinstance(_cuda_twins.load_library(), ctypes.CDLL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gspo", "cispo", "dr_grpo", "gspo_packed"])
def test_gpu_policy_loss_kinds_twin(built_lib, monkeypatch, name):
    """GSPO, CISPO and Dr. GRPO through the CUDA twin = the reference (padded rows; GSPO also packed)."""
    from megatron_dapo.algorithms import LossInputs
    from megatron_dapo.algorithms.policy_loss import ClipBounds
    from megatron_dapo.algorithms.policy_loss import Surrogate
    from megatron_dapo.algorithms.policy_loss import surrogate_loss
    from megatron_dapo.ops.pg_loss import fused_surrogate_loss

    _cuda_env(built_lib, monkeypatch)
    spec = {
        "gspo": Surrogate("gspo", ClipBounds.make(3e-4, 4e-4, None), "seq-mean-token-mean"),
        "gspo_packed": Surrogate("gspo", ClipBounds.make(3e-4, 4e-4, None), "seq-mean-token-mean"),
        "cispo": Surrogate("cispo", ClipBounds.make(None, 0.28, None), "token-mean"),
        "dr_grpo": Surrogate("clip", ClipBounds.make(0.2, 0.2, None), "seq-mean-token-sum-norm", 3000.0),
    }[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    old = -torch.rand(8, 3000, device="cuda", generator=gen) * 3
    spread = 3e-4 if spec.kind == "gspo" else 0.5
    logp = (old + (torch.rand(8, 3000, device="cuda", generator=gen) - 0.5) * 2 * spread).requires_grad_()
    adv = torch.randn(8, device="cuda", generator=gen)
    mask = (
        torch.arange(3000, device="cuda")[None, :]
        < torch.tensor([1, 0, 2999, 3000, 257, 1024, 7, 2048], device="cuda")[:, None]
    )
    ref, ref_m = surrogate_loss(LossInputs(logp, old, adv, mask), spec)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    if name == "gspo_packed":
        lengths = mask.sum(-1)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        x = logp.detach()[mask].requires_grad_()
        loss, m = fused_surrogate_loss(
            LossInputs(x, old[mask], adv, torch.ones_like(x, dtype=torch.bool)), spec, cu_seqlens=cu, backend="cuda"
        )
        (grad,) = torch.autograd.grad(loss, x)
        ref_grad = ref_grad[mask]
    else:
        loss, m = fused_surrogate_loss(LossInputs(logp, old, adv, mask), spec, backend="cuda")
        (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=2e-7)
    for k, v in m.items():
        torch.testing.assert_close(v, ref_m[k], rtol=1e-5, atol=2e-6, msg=k)
