"""Colocated-SGLang smoke on one GPU: 2 DAPO steps of a tiny model, with the device memory after every step of the
memory choreography (megatron_dapo/memory.py) written down.

    torchrun --standalone --nproc-per-node 1 tools/gpu/sglang_smoke.py --config examples/tiny_gpu_sglang.yaml --out DIR

Run by tools/gpu/device_check.sh (phase 6). The model, data and run directory go to --work (default
/tmp/mdapo_sglang_smoke); into DIR (--out) go:
    sglang_smoke_memory.jsonl   one row per choreography action: {"step", "action", "free_gib" (whole device, SGLang's
                                processes included), "allocated_gib" / "reserved_gib" (this process), "peak_gib" (this
                                process's peak since the previous row, i.e. over the phase that just ran)}
    sglang_smoke_summary.json   metrics of the 2 steps, the choreography trace, pass/fail checks
    sglang_smoke_metrics.jsonl  the run's metrics.jsonl
Exit 0: trained 2 steps and every check passed; 1: a check failed; 0 with "SKIP" on stdout when sglang or
megatron-core cannot be imported or there is no GPU (the lent machine may lack them; nothing is installed here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys
import time
from pathlib import Path

GiB = float(1 << 30)


def _skip_reason() -> str:
    for name in ("sglang", "megatron.core"):
        try:
            if importlib.util.find_spec(name) is None:
                return f"{name} is not installed"
        except ModuleNotFoundError:
            return f"{name} is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import sglang  # noqa: F401
    except Exception as err:  # any import failure (missing kernels, CUDA mismatch) means: skip
        return f"sglang does not import: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return ""


def _instrument(trainer, rows: list[dict]) -> None:
    """Record device memory after every action of trainer.memory (instance attributes shadow the methods)."""
    import torch

    from megatron_dapo.memory import PHASES
    from megatron_dapo.memory import STEP_SEQUENCE

    mem = trainer.memory
    cuda = torch.cuda.is_available()
    for name in {*STEP_SEQUENCE, "start", "finish"} - set(PHASES):
        original = getattr(mem, name)

        def wrapped(original=original, name=name) -> None:
            peak = torch.cuda.max_memory_allocated() / GiB if cuda else 0.0
            original()
            row = {"step": trainer.step, "action": name}
            if cuda:
                torch.cuda.synchronize()
                free, _ = torch.cuda.mem_get_info()
                row["free_gib"] = round(free / GiB, 3)
                row["allocated_gib"] = round(torch.cuda.memory_allocated() / GiB, 3)
                row["reserved_gib"] = round(torch.cuda.memory_reserved() / GiB, 3)
                row["peak_gib"] = round(peak, 3)
                torch.cuda.reset_peak_memory_stats()
            rows.append(row)

        setattr(mem, name, wrapped)


def _checks(rows: list[dict], metrics: list[dict], trace: list[str], run_dir: Path, fp8: bool) -> dict[str, bool]:
    from megatron_dapo.memory import STEP_SEQUENCE

    steps = [m for m in metrics if m.get("step", 0) >= 1]
    by: dict[tuple[int, str], dict] = {}
    for r in rows:  # the first row of each action in each step (a checkpoint save and finish() repeat some)
        by.setdefault((r["step"], r["action"]), r)
    out = {
        "two_steps_logged": [m["step"] for m in steps] == [1, 2],
        "trained_with_finite_loss": all(math.isfinite(m.get("actor/loss", math.nan)) for m in steps),
        "sequence_ran_twice": trace.count(STEP_SEQUENCE[-1]) >= 2,
        "checkpoint_written": (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists(),
        "final_export_written": (run_dir / "hf_final" / "model.safetensors").exists(),
    }
    # Releasing the engine must give device memory back, and resuming the KV cache must take it again.
    rel, kv = by.get((2, "release_engine")), by.get((2, "resume_engine_kv"))
    wts = by.get((2, "resume_engine_weights"))
    if rel and kv and wts and "free_gib" in rel:
        out["release_frees_memory"] = rel["free_gib"] > kv["free_gib"] + 0.5
        out["kv_resume_takes_memory"] = wts["free_gib"] > kv["free_gib"] + 0.5
    # After the first step the engine's sampling log-probs follow the synced weights (bf16 tolerance; with FP8
    # rollout weights the gap is the quantisation's, recorded in the summary but not gated).
    if len(steps) == 2 and "rollout/logprob_mismatch_max" in steps[1] and not fp8:
        out["engine_follows_sync"] = steps[1]["rollout/logprob_mismatch_max"] < 0.5
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/tiny_gpu_sglang.yaml")
    parser.add_argument("--out", required=True, help="small results (memory rows, summary, metrics)")
    parser.add_argument("--work", default="/tmp/mdapo_sglang_smoke", help="model, data and run directory")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="check this script on CPU: the transformers engine instead of SGLang, no memory figures",
    )
    args, overrides = parser.parse_known_args()
    reason = "" if args.cpu_dry_run else _skip_reason()
    if args.cpu_dry_run:
        overrides = ["--rollout.engine=transformers", "--actor.dtype=fp32", *overrides]
    if reason:
        print(f"SKIP sglang smoke: {reason}", flush=True)
        return 0
    from megatron_dapo.config import load_config
    from megatron_dapo.dev.tiny import make_tiny_model
    from megatron_dapo.dev.tiny import make_tiny_run
    from megatron_dapo.trainer import DAPOTrainer

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)  # a previous run's checkpoint would be resumed (checkpoint.resume auto)
    paths = make_tiny_run(work / "tiny", num_train=32, num_test=4)
    make_tiny_model(paths["model"], hidden=256)  # head_dim 64: SGLang's attention backends refuse 16
    run_dir = work / "run"
    config = load_config(
        args.config,
        [
            f"--actor.model_path={paths['model']}",
            f"--data.train_files={paths['train']}",
            f"--trainer.run_dir={run_dir}",
            *overrides,
        ],
    )
    start = time.perf_counter()
    trainer = DAPOTrainer(config)
    print(f"sglang smoke: trainer and engine up in {time.perf_counter() - start:.1f} s", flush=True)
    rows: list[dict] = []
    _instrument(trainer, rows)
    trainer.fit()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    (out / "sglang_smoke_memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fp8 = getattr(config.rollout, "weight_dtype", "auto") == "fp8"
    checks = _checks(rows, metrics, trainer.memory.trace, run_dir, fp8)
    summary = {
        "checks": checks,
        "trace": trainer.memory.trace,
        "metrics": metrics[-2:],
        "seconds": time.perf_counter() - start,
    }
    (out / "sglang_smoke_summary.json").write_text(json.dumps(summary, indent=1))
    (out / "sglang_smoke_metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(checks, indent=1))
    if trainer.engine is not None:
        trainer.engine.shutdown()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
