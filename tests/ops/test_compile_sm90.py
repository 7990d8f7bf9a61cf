"""Compile every log-prob/entropy Triton kernel for sm_90 (H100/H200) without a GPU: triton.compile + ptxas.

The interpreter (TRITON_INTERPRET=1, set by conftest) replaces @triton.jit functions, so the compile runs in a
child process with the interpreter off. Catches what the interpreter never checks: tl.dot shape/dtype rules,
constexpr typing, layouts, and a shared-memory budget above the sm_90 limit.

Run directly (python tests/ops/test_compile_sm90.py) to print the per-kernel compile report.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90
F32_POINTERS = ("stats_ptr", "grad_out_ptr", "dh_ptr")
I64_POINTERS = ("labels_ptr",)


def _signature(fn, data_dtype: str) -> dict[str, str]:
    """Triton signature: *_ptr args are pointers (data dtype unless stats/labels), ints i32, inv_temp fp32."""
    sig = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in F32_POINTERS:
            sig[name] = "*fp32"
        elif name in I64_POINTERS:
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = f"*{data_dtype}"
        elif name == "inv_temp":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _compile_all() -> list[dict]:
    import triton

    from megatron_dapo.ops import linear_logprob_entropy as lle
    from megatron_dapo.ops import logprob_entropy as le

    target = triton.backends.compiler.GPUTarget("cuda", 90, 32)
    bt, bv, bh, bho, warps = lle.GPU_BLOCKS
    jobs = []
    for dt in ("bf16", "fp32"):
        jobs.append((le._logprob_entropy_fwd_kernel, dt, {"BLOCK_T": 1, "BLOCK_V": le.BLOCK_V}, le.NUM_WARPS))
        jobs.append((le._logprob_entropy_bwd_kernel, dt, {"BLOCK_T": 1, "BLOCK_V": le.BLOCK_V_BWD}, le.NUM_WARPS))
        lin = {"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_H": bh, "UPCAST": False, "DOT_PRECISION": "tf32"}
        if dt == "fp32":
            lin["DOT_PRECISION"] = "ieee"
        jobs.append((lle._linear_fwd_kernel, dt, lin, warps))
        jobs.append((lle._linear_bwd_dweight_kernel, dt, {**lin, "BLOCK_HO": bho}, warps))
        jobs.append((lle._linear_bwd_dhidden_kernel, dt, {**lin, "BLOCK_HO": bho}, warps))
    report = []
    for fn, dt, constexprs, num_warps in jobs:
        src = triton.compiler.ASTSource(fn, _signature(fn, dt), constexprs)
        compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
        report.append(
            {
                "kernel": fn.__name__,
                "dtype": dt,
                "shared": compiled.metadata.shared,
                "cubin_bytes": len(compiled.asm["cubin"]),
            }
        )
    return report


def test_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 10
    for row in report:
        assert row["cubin_bytes"] > 0, row
        assert row["shared"] <= SM90_MAX_SHARED, row


if __name__ == "__main__":
    rows = _compile_all()
    if "--json" in sys.argv:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(r)
