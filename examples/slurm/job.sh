# The body of a DAPO sbatch file, shared by examples/slurm/*.sbatch (sourced, not run):
#   source "${SLURM_SUBMIT_DIR:-$PWD}/examples/slurm/job.sh" "$@"
# with CONFIG, GPUS_PER_NODE and GPU_MEMORY_GB set; "$@" are config overrides (--section.field=value).
#
# Environment it reads (all optional):
#   DAPO_SOCKET_IFNAME   the network interface for gloo and NCCL (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); the
#                        start-up check fails with one line if the host has no such interface (docs/cluster.md)
#   MASTER_PORT          the rendezvous port (default: derived from the job id)
#   DAPO_SRUN_ARGS       more srun options for the training tasks, e.g. the image of tools/gpu/Dockerfile through
#                        pyxis: "--container-image=/shared/megatron-dapo.sqsh --container-mounts=/shared"
#
# Launch: srun starts the training processes directly (one task per GPU; SLURM_PROCID / SLURM_NTASKS /
# SLURM_LOCALID give rank, world and local rank, megatron_dapo/actor/distributed.py reads them), so there is no
# torchrun agent and no TORCHELASTIC_* variable for SGLang's processes to inherit. Every task sees all GPUs of its
# node (--gpu-bind=none): the colocated engine of local rank r runs on GPUs r .. r + rollout.tensor_parallel - 1.
#
# Time limit and preemption: USR1 reaches this script before the limit (from the timer below, or #SBATCH
# --signal=B:USR1@...). It is forwarded to the trainer processes only (matched by their command line; SGLang's scheduler processes do not handle
# USR1 and would die); they save at the step boundary and exit 0. Slurm's --requeue restarts a job after a node
# failure or a preemption, not after its time limit, so after a signal and a clean exit this script asks the run
# whether it is finished (`megatron-dapo status --requeue`): if not, it requeues the job, and checkpoint.resume=auto
# resumes it from that save. A run that has saved its last step is not requeued.

if [ -n "${DAPO_SOCKET_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME="$DAPO_SOCKET_IFNAME" NCCL_SOCKET_IFNAME="$DAPO_SOCKET_IFNAME"
fi

# Check the config once on the batch node (one `error:` line and exit 2 on a mistake, the network interface included),
# then the pre-flight plan (no GPU needed): stop before the allocation is used if a phase does not fit.
python -m megatron_dapo.cli check --config "$CONFIG" --world-size $((SLURM_NNODES * GPUS_PER_NODE)) "$@"
python -m megatron_dapo.cli plan --config "$CONFIG" --nodes "$SLURM_NNODES" --gpus-per-node "$GPUS_PER_NODE" \
  --gpu-memory-gb "$GPU_MEMORY_GB" "$@"

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 20000))}
export CUDA_DEVICE_MAX_CONNECTIONS=1      # Megatron's TP overlap needs ordered kernel launches
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

# The time-limit signal comes from the planner: USR1 to this script `plan --lead-time` seconds before the job's end
# (the worst-case log-probs + update + sync + evaluation + one save + margin of this config on this layout; docs/
# cluster.md). #SBATCH --signal=B:USR1@N stays as a backstop (a second USR1 changes nothing).
lead=$(python -m megatron_dapo.cli plan --config "$CONFIG" --nodes "$SLURM_NNODES" --gpus-per-node "$GPUS_PER_NODE" \
  --gpu-memory-gb "$GPU_MEMORY_GB" --lead-time "$@")
end=${SLURM_JOB_END_TIME:-$(date -d "$(squeue -h -j "$SLURM_JOB_ID" -o %e)" +%s)}
wait_s=$((end - lead - $(date +%s)))
timer=
if [ "$wait_s" -gt 0 ]; then
  echo "time limit: USR1 to the trainers in ${wait_s} s (${lead} s before the end of the job)"
  (sleep "$wait_s"; kill -USR1 $$) &
  timer=$!
else
  echo "warning: ${lead} s of preemption lead time do not fit in the job's remaining time; only #SBATCH --signal applies"
fi

signalled=0
forward_usr1() {
  signalled=1
  srun --overlap --nodes="$SLURM_NNODES" --ntasks-per-node=1 \
    pkill -USR1 -f '^[^ ]*python[^ ]* -m megatron_dapo[.]cli train' || true
}
trap forward_usr1 USR1

# A failed attempt (a rank's exception, an OOM kill, a dead engine or peer: exit code other than 0 and 2) is run
# again, at most distributed.max_restarts times; each attempt resumes from the last verified checkpoint and rank 0
# prints why the previous one ended (megatron_dapo/restarts.py). Exit 2 (a user error) and a signalled job end the loop.
max_restarts=$(python -m megatron_dapo.cli get --config "$CONFIG" distributed.max_restarts "$@")
attempt=0
while true; do
  export DAPO_RESTART_COUNT=$attempt
  # srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05): pass it, or each task gets one core.
  # shellcheck disable=SC2086  # DAPO_SRUN_ARGS is a list of options
  srun ${DAPO_SRUN_ARGS:-} --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --gpu-bind=none --cpu-bind=cores \
    python -m megatron_dapo.cli train --config "$CONFIG" "$@" &
  step=$!
  # `wait` returns early when a trapped signal arrives: keep waiting until the step itself has exited.
  while true; do
    rc=0; wait "$step" || rc=$?
    kill -0 "$step" 2>/dev/null || break
  done
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 2 ] || [ "$signalled" -eq 1 ] || [ "$attempt" -ge "$max_restarts" ]; then break; fi
  attempt=$((attempt + 1))
  echo "attempt $((attempt - 1)) failed (srun exit code $rc): restart $attempt of $max_restarts (distributed.max_restarts)"
done
if [ -n "$timer" ]; then kill "$timer" 2>/dev/null || true; fi   # the timer, when the job ended before it fired
if [ "$rc" -eq 0 ] && [ "$signalled" -eq 1 ]; then
  python -m megatron_dapo.cli status --config "$CONFIG" --requeue "$@" || true
fi
exit "$rc"
