#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (device README: python3 there already holds CUDA torch and Triton; nothing
# can be downloaded, so nothing is pip-installed from a registry and torch is never replaced).
#
# Phases, each under its own timeout, ~10 minutes for 1-5 (the smoke adds up to 7: under the 10-minute limit of one
# device command run it apart with ONLY=sglang_smoke); a failing phase does not stop the later ones:
#   1. environment report                       (nvidia-smi, python3 / torch / triton versions; pins.txt: the
#                                                 installed versions beside requirements/gpu.lock's)
#   2. optional wheels carried in .whl/          (e.g. liger_kernel-*.whl, installed --no-deps into /tmp/site)
#   3. build the CUDA C++ twins                  (python3 csrc/build.py --arch 90)
#   4. pytest -m gpu tests/ops tests/algorithms (TRITON_INTERPRET=0: compiled kernels on the GPU, IS weights too)
#   4b. pytest -m gpu tests/actor                (the actor on the GPU: packed THD on Transformer Engine's attention
#                                                 or the varlen submodule, fused LM head and fused loss vs the padded
#                                                 reference; the MoE actors with grouped-GEMM experts (TEGroupedMLP
#                                                 with TE) vs transformers fp64 and their export; needs
#                                                 megatron-core: carry its wheel in .whl/, e.g.
#                                                 pip download --no-deps -d .whl the lock's megatron-core pin)
#   5. python3 tools/bench/logprob_kernels.py --device cuda
#   6. colocated-SGLang smoke                   (phase_sglang_smoke: tools/gpu/sglang_smoke.py under torchrun, 1 GPU: a
#                                                 tiny model trains 2 steps with SGLang in-process through the memory
#                                                 choreography, actor offload "all", a checkpoint and the final export;
#                                                 the device memory after every choreography action is recorded.
#                                                 Skipped (not run), with the reason in sglang_smoke.log, when sglang or
#                                                 megatron-core does not import there: nothing comes from a registry)
#   7. FP8 sync into colocated SGLang            (phase_sglang_fp8: the same smoke rerun with rollout.weight_dtype=fp8
#                                                 and algorithm.rollout_correction=tis: SGLang serves block-FP8 linear
#                                                 layers and takes <name> + <name>_scale_inv every step. Skipped (not
#                                                 run) like phase 6. Output: $OUT/sglang_fp8/, sglang_fp8.log)
# Everything useful lands in $OUT: env.txt, build.log, pytest_gpu.log, pytest_gpu.xml, pytest_gpu_actor.log,
# pytest_gpu_actor.xml, bench.log, bench_kernels.csv, sglang_smoke.log, sglang_smoke_{memory,metrics}.jsonl,
# sglang_smoke_summary.json.
#
# Run from the repository root, e.g. through the device tool:
#   bash tools/gpu/device_check.sh          (with carry [".whl"] if Liger's wheel was downloaded there)
# Afterwards, append $OUT/bench_kernels.csv's rows to results/bench_kernels.csv and fill the GPU part of
# docs/benchmarks.md ("Kernels" section).
# Knobs: BENCH_CONFIGS (default: the four GPU model shapes), BENCH_TIMEOUT, PYTEST_TIMEOUT, SGLANG_SMOKE_TIMEOUT,
# SGLANG_FP8_TIMEOUT; ONLY=sglang_smoke runs phases 1, 2 and 6 alone, ONLY=sglang_fp8 phases 1, 2 and 7 (each smoke
# takes up to 7 minutes: under the 10-minute limit of one device command, run them apart).
set -x
set -o pipefail

OUT="${OUT:-$PWD/results/tmp/device_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/mdapo_inductor}"
PY="${PYTHON:-python3}"
BENCH_CONFIGS="${BENCH_CONFIGS:-smollm2-135m qwen2.5-7b llama-3-8b qwen2.5-32b}"
status=0
skipped=""

# 1. environment
timeout 60 bash -c "nvidia-smi; $PY -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print(\"triton\", triton.__version__)'; nvcc --version" \
    >"$OUT/env.txt" 2>&1 || status=1

# 1b. the device's stack against the project's pins (requirements/gpu.lock, the versions tools/gpu/Dockerfile
# installs): a report, not a gate (a lent machine has what it has); carry wheels of the pinned versions in .whl/,
# e.g. pip download --no-deps -d .whl "$(grep -E '^megatron-core==' requirements/gpu.lock)"
timeout 60 "$PY" tools/gpu/lock_gpu_stack.py --compare-installed >"$OUT/pins.txt" 2>&1 \
    || echo "pins: the device's versions differ from requirements/gpu.lock (table in pins.txt)" >>"$OUT/env.txt"

# 2. carried wheels (optional): never from a registry (also for ONLY=sglang_smoke: megatron-core may come from here)
if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >>"$OUT/env.txt" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site" || status=1
fi

if [ "${ONLY:-}" = "" ]; then
# 3. CUDA twins
timeout 300 "$PY" csrc/build.py --out build/cuda --arch 90 >"$OUT/build.log" 2>&1 || status=1
if [ -f build/cuda/libmegatron_dapo_cuda.so ]; then
    export MEGATRON_DAPO_CUDA_LIB="$PWD/build/cuda/libmegatron_dapo_cuda.so"
fi

# 4. GPU tests of the ops
timeout "${PYTEST_TIMEOUT:-240}" "$PY" -m pytest -m gpu tests/ops tests/algorithms -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log" || status=1

# 4b. GPU tests of the actor (skipped inside pytest when megatron-core is missing)
timeout "${PYTEST_ACTOR_TIMEOUT:-240}" "$PY" -m pytest -m gpu tests/actor -q -rs -p no:cacheprovider \
    --junitxml="$OUT/pytest_gpu_actor.xml" 2>&1 | tee "$OUT/pytest_gpu_actor.log" || status=1

# 5. benchmark (rows go to $OUT/bench_kernels.csv; copy them into results/bench_kernels.csv afterwards)
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" "$PY" tools/bench/logprob_kernels.py --device cuda --configs $BENCH_CONFIGS \
    --csv "$OUT/bench_kernels.csv" 2>&1 | tee "$OUT/bench.log" || status=1
fi

# 6. colocated-SGLang smoke (1 GPU, tiny model, 2 steps); the run itself goes to /tmp, only small files to $OUT
phase_sglang_smoke() {
    local log="$OUT/sglang_smoke.log"
    if ! "$PY" -c 'import sglang, megatron.core' >"$log" 2>&1; then
        echo "SKIP (not run) sglang smoke: sglang or megatron.core does not import here (error above)" | tee -a "$log"
        skipped="$skipped sglang_smoke"
        return 0
    fi
    timeout "${SGLANG_SMOKE_TIMEOUT:-420}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        tools/gpu/sglang_smoke.py --config examples/tiny_gpu_sglang.yaml --out "$OUT" --work /tmp/mdapo_sglang_smoke \
        >>"$log" 2>&1 || status=1
    tail -n 60 "$log"
}
if [ "${ONLY:-}" = "" ] || [ "${ONLY:-}" = sglang_smoke ]; then
    phase_sglang_smoke
fi

# 7. FP8 sync into colocated SGLang (ONLY=sglang_fp8 runs phases 1, 2 and 7 alone)
phase_sglang_fp8() {
    local log="$OUT/sglang_fp8.log"
    if [ ! -f tools/gpu/sglang_smoke.py ]; then
        echo "SKIP (not run) sglang fp8: needs tools/gpu/sglang_smoke.py, the colocated-SGLang smoke of branch mem" | tee "$log"
        skipped="$skipped sglang_fp8"
        return 0
    fi
    if ! "$PY" -c 'import sglang, megatron.core' >"$log" 2>&1; then
        echo "SKIP (not run) sglang fp8: sglang or megatron.core does not import here (error above)" | tee -a "$log"
        skipped="$skipped sglang_fp8"
        return 0
    fi
    mkdir -p "$OUT/sglang_fp8"
    timeout "${SGLANG_FP8_TIMEOUT:-420}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        tools/gpu/sglang_smoke.py --config examples/tiny_gpu_sglang.yaml --out "$OUT/sglang_fp8" \
        --work /tmp/mdapo_sglang_fp8 --rollout.weight_dtype=fp8 --algorithm.rollout_correction=tis \
        >>"$log" 2>&1 || status=1
    tail -n 60 "$log"
}
if [ "${ONLY:-}" = "" ] || [ "${ONLY:-}" = sglang_fp8 ]; then
    phase_sglang_fp8
fi

echo "device_check: status=$status (0 = every phase that ran passed); not run:${skipped:- none}"
exit $status
