#!/usr/bin/env bash
# Single-node launch: bash examples/torchrun.sh CONFIG.yaml NPROC [--section.field=value ...]
# On CPU the ranks talk over gloo; on GPU over NCCL (chosen from torch.cuda.is_available()).
set -euo pipefail
config=${1:?usage: torchrun.sh CONFIG.yaml NPROC [overrides]}
nproc=${2:-2}
shift 2 || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --standalone --nproc-per-node "$nproc" -m megatron_dapo.cli train --config "$config" "$@"
