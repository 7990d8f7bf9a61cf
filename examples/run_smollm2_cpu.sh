#!/usr/bin/env bash
# The main job: a short real DAPO run of SmolLM2-135M-Instruct on CPU (2 ranks over gloo).
#   bash examples/run_smollm2_cpu.sh [--section.field=value ...]     e.g. --trainer.total_steps=40
# Prints per-step metrics; writes runs/smollm2_arith_cpu/{metrics.jsonl,plots/*.png,checkpoints,hf_final}.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python tools/setup/prepare_smollm2.py               # GGUF -> cached safetensors (once, ~1 min)
data=runs/data/chain_sum_2x2d
if [ ! -f "$data/train.jsonl" ]; then
  python tools/data/make_dataset.py --task chain_sum --num-train 2000 --num-test 200 --seed 0 \
    --template few_shot_compact --task-kwargs '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' --out "$data"
fi
torchrun --standalone --nproc-per-node 2 -m megatron_dapo.cli train --config examples/smollm2_arith_cpu.yaml "$@"
