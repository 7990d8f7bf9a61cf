#!/usr/bin/env bash
# All GPU evidence in one command, within 10 minutes on one H200 (issue 36 item 4). Nothing is installed from a
# registry and torch is never replaced: python3 there already holds CUDA torch and Triton; megatron-core and Liger
# come as carried wheels in .whl/ (pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl
# megatron-core==0.16.1 liger-kernel==0.8.5; the device README has the full command).
#
# Phases, in order of value, each under its own timeout and all under one deadline (DEADLINE_S, default 540 s, so
# the whole run ends inside a 600 s device call; a phase that would start with under 20 s left is skipped and says
# so). A failing phase does not stop the later ones.
#   1. environment                env.txt (nvidia-smi, versions) and pins.txt (installed vs requirements/gpu.lock)
#   2. carried wheels             .whl/*.whl installed --no-deps into /tmp/site
#   3. CUDA C++ twins             python3 csrc/build.py --arch 90 (the cuda_twin provider and tests need them)
#   4. kernel tests               pytest -m gpu tests/ops tests/algorithms (compiled kernels and twins vs fp64)
#   5. kernel benchmark           tools/bench/logprob_kernels.py: BENCH_CONFIGS (the 7B shape, its TP=4 shard,
#                                 Llama-3-8B, Qwen2.5-32B), every provider (Liger's when its wheel is carried), then
#                                 the fused LM head's tile sweep at the 7B shape (TILE_BUDGETS); issue 36's target
#                                 lines at the end of bench.log
#   6. actor step                 tools/bench/actor_step_gpu.py (ACTOR_MODELS; every logprob_impl and transformers)
#   7. actor tests                pytest -m gpu tests/actor (needs megatron-core)
#   8. SGLang smokes              only with ONLY=sglang_smoke / ONLY=sglang_fp8 (7 min each; SGLang must import)
# Output: $OUT (default results/gpu/device_check) holds at most 8 files, the device tool's limit: bench_kernels.csv,
# bench.log, actor_step_gpu.json, actor_step_gpu.md, pytest_gpu.log, pytest_gpu_actor.log, summary.txt (each phase's
# status and seconds, the target lines) and logs.tar.gz (every log, junit xml and env file).
# Afterwards, here: python tools/gpu/collect_device_check.py <the folder> (rows into results/bench_kernels.csv, the
# actor step and logs into results/gpu/, the target lines printed), then fill docs/benchmarks.md "Kernels / GPU".
# Knobs: DEADLINE_S, BENCH_CONFIGS, TILE_BUDGETS, ACTOR_MODELS, ONLY, PYTHON.
set -o pipefail

OUT="${OUT:-$PWD/results/gpu/device_check}"
WORK="${WORK:-/tmp/device_check}"
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/mdapo_inductor}"
PY="${PYTHON:-python3}"
DEADLINE_S="${DEADLINE_S:-540}"
BENCH_CONFIGS="${BENCH_CONFIGS:-qwen2.5-7b qwen2.5-7b-tp4 llama-3-8b qwen2.5-32b}"
TILE_BUDGETS="${TILE_BUDGETS:-2M/8M 4M/4M 4M/16M 8M/16M}"
ACTOR_MODELS="${ACTOR_MODELS:-qwen2.5-0.5b qwen2.5-7b-l4 qwen2.5-1.5b}"
START=$SECONDS
status=0
: >"$WORK/summary.txt"

left() { echo $((DEADLINE_S - (SECONDS - START))); }

# phase NAME WANT_S CMD...: run CMD under timeout min(WANT_S, time left); record status and seconds in summary.txt.
phase() {
    local name=$1 want=$2
    shift 2
    local budget
    budget=$(left)
    if [ "$budget" -lt 20 ]; then
        echo "$name: SKIPPED (not run): $budget s left of DEADLINE_S=$DEADLINE_S" | tee -a "$WORK/summary.txt"
        status=1
        return 0
    fi
    [ "$want" -lt "$budget" ] && budget=$want
    local t0=$SECONDS rc=0
    timeout "$budget" "$@" || rc=$?
    local what="ok"
    [ "$rc" -eq 124 ] && what="TIMED OUT after ${budget}s"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && what="FAILED rc=$rc"
    [ "$rc" -ne 0 ] && status=1
    echo "$name: $what ($((SECONDS - t0)) s)" | tee -a "$WORK/summary.txt"
}

# 1. environment
phase env 60 bash -c "nvidia-smi; $PY -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print(\"triton\", triton.__version__)'; nvcc --version" \
    >"$WORK/env.txt" 2>&1
"$PY" tools/gpu/lock_gpu_stack.py --compare-installed >"$WORK/pins.txt" 2>&1 \
    || echo "pins: the device's versions differ from requirements/gpu.lock (table in pins.txt)" >>"$WORK/env.txt"

# 2. carried wheels (never from a registry)
if compgen -G ".whl/*.whl" >/dev/null; then
    phase wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$WORK/env.txt" 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if [ "${ONLY:-}" = "" ]; then
    # 3. CUDA twins
    phase build_cuda_twins 150 "$PY" csrc/build.py --out build/cuda --arch 90 >"$WORK/build.log" 2>&1
    if [ -f build/cuda/libmegatron_dapo_cuda.so ]; then
        export MEGATRON_DAPO_CUDA_LIB="$PWD/build/cuda/libmegatron_dapo_cuda.so"
    fi

    # 4. kernel tests
    phase kernel_tests 150 bash -c "'$PY' -m pytest -m gpu tests/ops tests/algorithms -q -rs -p no:cacheprovider \
        --junitxml='$WORK/pytest_gpu.xml' 2>&1 | tee '$WORK/pytest_gpu.log'"

    # 5. kernel benchmark, then the fused LM head's tile sweep at the 7B shape
    # shellcheck disable=SC2086
    phase kernel_bench 200 bash -c "'$PY' tools/bench/logprob_kernels.py --device cuda --configs $BENCH_CONFIGS \
        --csv '$WORK/bench_kernels.csv' 2>&1 | tee '$WORK/bench.log'"
    # shellcheck disable=SC2086
    phase tile_sweep 60 bash -c "'$PY' tools/bench/logprob_kernels.py --device cuda --configs qwen2.5-7b \
        --ops linear_logprob_entropy --providers ours --modes forward full --tile-budgets $TILE_BUDGETS \
        --csv '$WORK/bench_kernels.csv' 2>&1 | tee -a '$WORK/bench.log'"

    # 6. the actor step on one GPU (writes after every arm; --time-budget-s leaves room for the phases after it)
    # shellcheck disable=SC2086
    phase actor_step 150 bash -c "'$PY' tools/bench/actor_step_gpu.py --models $ACTOR_MODELS --time-budget-s 110 \
        --out '$WORK/actor_step_gpu' 2>&1 | tee '$WORK/actor_step.log'"

    # 7. the actor's GPU tests (skipped inside pytest when megatron-core is missing)
    phase actor_tests 120 bash -c "'$PY' -m pytest -m gpu tests/actor -q -rs -p no:cacheprovider \
        --junitxml='$WORK/pytest_gpu_actor.xml' 2>&1 | tee '$WORK/pytest_gpu_actor.log'"
fi

# 8. colocated-SGLang smokes (one at a time: ONLY=sglang_smoke or ONLY=sglang_fp8); skipped when SGLang or
# megatron-core does not import there (nothing comes from a registry)
sglang_smoke() {
    local name=$1
    shift
    if ! "$PY" -c 'import sglang, megatron.core' >"$WORK/$name.log" 2>&1; then
        echo "$name: SKIPPED (not run): sglang or megatron.core does not import here" | tee -a "$WORK/summary.txt"
        return 0
    fi
    mkdir -p "$WORK/$name"
    phase "$name" 420 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 tools/gpu/sglang_smoke.py \
        --config examples/tiny_gpu_sglang.yaml --out "$WORK/$name" --work "/tmp/mdapo_$name" "$@" \
        >>"$WORK/$name.log" 2>&1
    tail -n 60 "$WORK/$name.log"
}
if [ "${ONLY:-}" = sglang_smoke ]; then
    sglang_smoke sglang_smoke
elif [ "${ONLY:-}" = sglang_fp8 ]; then
    sglang_smoke sglang_fp8 --rollout.weight_dtype=fp8 --algorithm.rollout_correction=tis
fi

# Results: the target lines, then at most 8 files into $OUT
grep -E "^(L|K) .*(met|MISSED)" "$WORK/bench.log" >>"$WORK/summary.txt" 2>/dev/null
echo "device_check: status=$status (0 = every phase ran and passed), $((SECONDS - START)) s" | tee -a "$WORK/summary.txt"
for f in bench_kernels.csv bench.log actor_step_gpu.json actor_step_gpu.md pytest_gpu.log pytest_gpu_actor.log \
    summary.txt; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude=logs.tar.gz . 2>/dev/null
exit $status
