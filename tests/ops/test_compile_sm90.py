"""Compile every Triton kernel of megatron_dapo.ops for sm_90 (H100/H200) without a GPU: triton.compile + ptxas,
then read each cubin's resource usage (registers, stack = spill space, shared memory) with the wheel's cuobjdump.

The interpreter (TRITON_INTERPRET=1, set by conftest) replaces @triton.jit functions, so the compile runs in a
child process with the interpreter off. Catches what the interpreter never checks: tl.dot shape/dtype rules,
constexpr typing, layouts, a shared-memory budget above the sm_90 limit, and register spills (a kernel at the
255-register cap spills to local memory; issue 9 found the first fused-linear kernels spilling 360-2280 B/thread).

Run directly (python tests/ops/test_compile_sm90.py) to print the per-kernel report as a markdown table.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90
MAX_REGISTERS = 255  # per thread on sm_90
F32_POINTERS = (
    "stats_ptr", "state_ptr", "grad_out_ptr", "dh_ptr", "partial_ptr", "inv_denom_ptr", "old_ptr", "adv_ptr",
    "seq_lr_ptr", "out_ptr",
)  # fmt: skip
I64_POINTERS = ("labels_ptr",)
I32_POINTERS = ("seq_id_ptr", "starts_ptr")
F32_SCALARS = ("inv_temp", "lo", "hi", "clip_c", "log_lo", "log_hi", "log_c")


def _signature(fn, data_dtype: str, overrides: dict | None = None) -> dict[str, str]:
    """Triton signature: *_ptr args are pointers (data dtype unless fp32 stats/labels), ints i32, scalars fp32."""
    sig = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in F32_POINTERS:
            sig[name] = "*fp32"
        elif name in I64_POINTERS:
            sig[name] = "*i64"
        elif name in I32_POINTERS:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{data_dtype}"
        elif name in F32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    sig.update(overrides or {})
    return sig


def _jobs() -> list[tuple]:
    """(kernel, data dtype, constexprs, num_warps, signature overrides) for every launch configuration we ship."""
    from megatron_dapo.ops import logprob_entropy as le
    from megatron_dapo.ops import pg_loss as pg
    from megatron_dapo.ops import tiling

    jobs = []
    fwd_bv, bwd_bv = le.GPU_BLOCKS
    no_carry = {"CARRY_IN": False, "CARRY_OUT": False}
    for dt in ("bf16", "fp16", "fp32"):  # logprobs_and_entropy over logits of each dtype
        consts = {"BLOCK_T": 1, "BLOCK_V": fwd_bv, **no_carry}
        jobs.append((le._logprob_entropy_fwd_kernel, dt, consts, le.NUM_WARPS, {}))
        jobs.append((le._logprob_entropy_bwd_kernel, dt, {"BLOCK_T": 1, "BLOCK_V": bwd_bv}, le.NUM_WARPS, {}))
    # The fused LM head's tiles: fp32 logits from the GEMM, the forward's online state carried across vocab tiles,
    # d logits written in the weight dtype; vocab blocks as wide as the GPU budget's tiles at T = 4096.
    budget = tiling.GPU_BUDGET
    _, fwd_vc = tiling.tile_shape(budget.max_tokens, 1 << 30, budget.forward_elements, budget)
    _, bwd_vc = tiling.tile_shape(budget.max_tokens, 1 << 30, budget.backward_elements, budget)
    for carry_in, carry_out in ((False, True), (True, True), (True, False)):
        consts = {"BLOCK_T": 1, "BLOCK_V": min(fwd_bv, fwd_vc), "CARRY_IN": carry_in, "CARRY_OUT": carry_out}
        jobs.append((le._logprob_entropy_fwd_kernel, "fp32", consts, le.NUM_WARPS, {}))
    for dt in ("bf16", "fp16"):
        consts = {"BLOCK_T": 1, "BLOCK_V": min(bwd_bv, bwd_vc)}
        jobs.append((le._logprob_entropy_bwd_kernel, "fp32", consts, le.NUM_WARPS, {"grad_in_ptr": f"*{dt}"}))
    clip, gspo, cispo = (pg.KIND_CODES[k] for k in ("clip", "gspo", "cispo"))
    for dt in ("bf16", "fp32"):  # logp dtype; old_logp/adv fp32; mask uint8 (bool) or fp32 (weights)
        # (ADV_PER_TOKEN, DUAL_CLIP, KIND, PACKED, mask pointer)
        for per_token, dual, kind, packed, mask in (
            (False, True, clip, False, "*u8"),
            (True, False, clip, False, "*fp32"),
            (False, False, gspo, False, "*fp32"),
            (False, False, gspo, True, "*fp32"),
            (False, False, cispo, False, "*u8"),
        ):
            flags = {"ADV_PER_TOKEN": per_token, "DUAL_CLIP": dual, "KIND": kind, "PACKED": packed}
            for backward in (False, True):
                consts = {**flags, "BACKWARD": backward, "BLOCK": pg.BLOCK_TOKENS}
                jobs.append((pg._pg_loss_kernel, dt, consts, 4, {"mask_ptr": mask}))
        jobs.append((pg._seq_log_ratio_kernel, dt, {"BLOCK": 256}, 4, {"mask_ptr": "*fp32"}))
    return jobs


def _resource_usage(cubin: bytes, cuobjdump: str) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the one kernel in `cubin`, from `cuobjdump --dump-resource-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout)}
    if "REG" not in found or "STACK" not in found:
        raise RuntimeError(f"unexpected cuobjdump output: {out.stdout[-500:]}")
    return found


def _compile_all() -> list[dict]:
    import triton

    target = triton.backends.compiler.GPUTarget("cuda", 90, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    report = []
    for fn, dt, constexprs, num_warps, overrides in _jobs():
        src = triton.compiler.ASTSource(fn, _signature(fn, dt, overrides), constexprs)
        compiled = triton.compile(src, target=target, options={"num_warps": num_warps})
        usage = _resource_usage(compiled.asm["cubin"], cuobjdump)
        report.append(
            {
                "kernel": fn.__name__,
                "dtype": dt,
                "config": constexprs | {"warps": num_warps, **overrides},
                "registers": usage["REG"],
                "stack": usage["STACK"],
                "local": usage.get("LOCAL", 0),
                "shared": compiled.metadata.shared,
                "cubin_bytes": len(compiled.asm["cubin"]),
            }
        )
    return report


def test_kernels_compile_for_sm90_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == 3 * 2 + 3 + 2 + 2 * (5 * 2 + 1)
    kernels = {r["kernel"] for r in report}
    assert kernels >= {"_pg_loss_kernel", "_logprob_entropy_fwd_kernel", "_logprob_entropy_bwd_kernel"}
    for row in report:
        assert row["cubin_bytes"] > 0, row
        assert row["shared"] <= SM90_MAX_SHARED, row
        assert row["registers"] <= MAX_REGISTERS, row
        # Stack frame bytes on these kernels are register spills (no local arrays, no calls): must be none.
        assert row["stack"] == 0 and row["local"] == 0, f"register spill: {row}"


if __name__ == "__main__":
    rows = _compile_all()
    if "--json" in sys.argv:
        print(json.dumps(rows))
    else:
        print("| kernel | dtype | config | registers | stack (spill) B | shared B |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
            print(f"| {r['kernel']} | {r['dtype']} | {cfg} | {r['registers']} | {r['stack']} | {r['shared']} |")
