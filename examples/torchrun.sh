#!/usr/bin/env bash
# Single-node launch: bash examples/torchrun.sh CONFIG.yaml NPROC [--section.field=value ...]
# On CPU the ranks talk over gloo; on GPU over NCCL (chosen from torch.cuda.is_available()).
# `megatron-dapo launch` checks the config once (a mistake is one `error:` line, exit 2), then runs torchrun with
# checkpoint.preempt_grace_s as its SIGTERM -> SIGKILL window, so a SIGTERM mid-step still saves that step.
set -euo pipefail
config=${1:?usage: torchrun.sh CONFIG.yaml NPROC [overrides]}
nproc=${2:-2}
shift 2 || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m megatron_dapo.cli launch --nproc-per-node "$nproc" --config "$config" "$@"
