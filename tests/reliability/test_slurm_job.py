"""The shipped sbatch file run by bash as Slurm would run it, with fake `srun` and `scontrol` on PATH (issue 22, items 2
and 6): the time-limit signal (USR1 to the batch script) is forwarded to the trainer, which saves at the step boundary
and exits 0; the script then asks the run whether it is finished and requeues the job when it is not; the requeued job
resumes and finishes, and a finished run is not requeued. A DAPO_SOCKET_IFNAME naming no interface of the host stops
the job before training with one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_dapo.cli import EXIT_RESUMABLE
from megatron_dapo.dev.tiny import tiny_overrides
from megatron_dapo.net import free_port
from tests.reliability.test_run_faults import _metric_steps
from tests.reliability.test_run_faults import _wait_for

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "dapo_qwen2.5_7b.sbatch"

FAKE_SRUN = """#!/usr/bin/env bash
# srun's options are all --name or --name=value here: drop them, run the command as the one task (with
# FAKE_SRUN_MODULE in place of megatron_dapo.cli when set: the testing hooks' driver).
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
args=()
for a in "$@"; do
  if [ "$a" = megatron_dapo.cli ] && [ -n "${FAKE_SRUN_MODULE:-}" ]; then a=$FAKE_SRUN_MODULE; fi
  args+=("$a")
done
exec "${args[@]}"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in
  show) echo localhost ;;
  requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
"""

FAKE_SQUEUE = """#!/usr/bin/env bash
# squeue -h -j JOB -o %e: the job's end time, a day from now
date -d '+1 day' +%Y-%m-%dT%H:%M:%S
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_dapo.dev.tiny import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("tiny_slurm"), num_train=48, num_test=4)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "GLOO_", "NCCL_"))}
    env.update(
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NNODES="1",
        SLURM_CPUS_PER_TASK="1",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURM_LOCALID="0",
        MASTER_PORT=str(free_port()),
        CONFIG=str(ROOT / "examples" / "tiny_cpu.yaml"),
        **extra,
    )
    return env


def _args(tiny, run_dir: Path, steps: int) -> list[str]:
    return [
        *tiny_overrides(tiny, run_dir),
        f"--trainer.total_steps={steps}",
        "--checkpoint.save_every=1",
        "--trainer.eval_every=0",
        "--logging.console=plain",
        "--logging.plots=false",
        "--algorithm.max_gen_batches=10",
    ]


def _sbatch(env: dict[str, str], args: list[str], signal_after: str | None = None) -> tuple[int, str]:
    """Run the sbatch file with bash; with signal_after, send USR1 to the script (Slurm's --signal=B:USR1) once a
    line containing it appears. Returns (exit code, output)."""
    proc = subprocess.Popen(["bash", str(SBATCH), *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        if signal_after is not None:
            _wait_for(lambda: any(signal_after in x for x in lines), 240, repr(signal_after))
            proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    return proc.returncode, "".join(lines)


@pytest.mark.slow
def test_time_limit_signal_saves_requeues_and_the_requeued_job_finishes(tiny, tmp_path):
    run_dir = tmp_path / "run"
    env, args = _env(tmp_path), _args(tiny, run_dir, steps=4)
    log = tmp_path / "slurm.log"

    code, out = _sbatch(env, args, signal_after="step 1 |")
    assert code == 0, out[-4000:]
    assert "resumable: step" in out and "requeued: Slurm job 4242" in out, out[-3000:]
    assert "time limit: USR1 to the trainers in 86" in out  # the timer, armed from squeue's end time, had not fired
    assert log.read_text() == "requeue 4242\n"
    saved = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    assert 1 <= saved < 4

    # The requeued job: resumes from that save, finishes, and is not requeued (no signal, and finished).
    code, out = _sbatch(env, args)
    assert code == 0, out[-4000:]
    assert "step 4 |" in out and log.read_text() == "requeue 4242\n", out[-3000:]
    status = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "status", "--config", env["CONFIG"],
                             "--requeue", *args], env=env, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert status.returncode == 0 and status.stdout.startswith("finished: step 4 of 4"), status.stdout
    assert log.read_text() == "requeue 4242\n"  # a finished run is never requeued


def test_status_of_a_run_without_a_checkpoint_is_resumable_and_requeues(tiny, tmp_path):
    env = _env(tmp_path)
    args = _args(tiny, tmp_path / "none", steps=2)
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "status", "--config", env["CONFIG"], *args]
    plain = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert plain.returncode == EXIT_RESUMABLE and plain.stdout.startswith("resumable: step 0 of 2"), plain.stdout
    assert not (tmp_path / "slurm.log").exists()
    requeue = subprocess.run([*cmd, "--requeue"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert requeue.returncode == EXIT_RESUMABLE and (tmp_path / "slurm.log").read_text() == "requeue 4242\n"


def test_a_socket_interface_the_host_lacks_stops_the_job_with_one_line(tiny, tmp_path):
    env = _env(tmp_path, DAPO_SOCKET_IFNAME="nosuchif0")
    code, out = _sbatch(env, _args(tiny, tmp_path / "run", steps=1))
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, out[-3000:]
    assert "GLOO_SOCKET_IFNAME=nosuchif0: no interface nosuchif0 on this host" in errors[0]
    assert not (tmp_path / "run").exists()  # stopped at the batch node's check, before any training process


@pytest.mark.parametrize(
    "env, error",
    [
        ({"GLOO_SOCKET_IFNAME": "ib0"}, None),
        ({"GLOO_SOCKET_IFNAME": "ib0,eth0"}, None),
        ({"GLOO_SOCKET_IFNAME": "ib0,ib1"}, "GLOO_SOCKET_IFNAME=ib0,ib1: no interface ib1 on this host"),
        ({"NCCL_SOCKET_IFNAME": "ib"}, None),  # NCCL: a prefix
        ({"NCCL_SOCKET_IFNAME": "=ib"}, "NCCL_SOCKET_IFNAME==ib: no interface on this host matches"),  # exact
        ({"NCCL_SOCKET_IFNAME": "=ib0"}, None),
        ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, None),  # exclusions only
        ({"NCCL_SOCKET_IFNAME": "bond"}, "NCCL_SOCKET_IFNAME=bond: no interface on this host matches"),
        ({}, None),
    ],
)
def test_socket_interface_names_follow_gloo_and_nccl_rules(env, error):
    from megatron_dapo.launch import StartupError
    from megatron_dapo.launch import check_socket_ifnames

    available = ["lo", "eth0", "ib0", "docker0"]
    if error is None:
        check_socket_ifnames(env, available)
    else:
        with pytest.raises(StartupError, match="^" + error.replace("^", "\\^")) as err:
            check_socket_ifnames(env, available)
        assert "\n" not in str(err.value) and "it has lo, eth0, ib0, docker0" in str(err.value)


FAKE_CLI = """
import os, signal, sys, time
command = sys.argv[1]
log = open(os.environ["FAKE_CLI_LOG"], "a")
print(" ".join(sys.argv[1:3] + [a for a in sys.argv[3:] if a in ("--lead-time", "--requeue")]), file=log, flush=True)
if command == "plan" and "--lead-time" in sys.argv:
    print(os.environ["FAKE_LEAD_S"])
elif command == "train":
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(time.time()))
    deadline = time.time() + 60
    while not got and time.time() < deadline:
        time.sleep(0.05)
    t0 = float(os.environ["FAKE_T0"])
    print(f"train got USR1 after {got[0] - t0:.1f} s" if got else "train: no signal", file=log)
elif command == "status":
    sys.exit(3)
"""


def test_the_planner_lead_time_arms_the_time_limit_signal(tmp_path):
    """job.sh alone, with a stand-in megatron_dapo CLI: the lead time comes from `plan --lead-time`, USR1 reaches the
    trainer process at the job's end minus that lead, and a signalled clean exit asks `status --requeue`."""
    import time

    fake = tmp_path / "fake_pkg" / "megatron_dapo"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text(FAKE_CLI)
    t0 = time.time()
    lead, wanted = 1000, 4  # the signal should come 4 s after the start: end = start + 4 + lead
    env = _env(tmp_path, FAKE_CLI_LOG=str(tmp_path / "cli.log"), FAKE_LEAD_S=str(lead), FAKE_T0=str(t0),
               SLURM_JOB_END_TIME=str(int(t0) + wanted + lead))  # fmt: skip
    env["PYTHONPATH"] = str(tmp_path / "fake_pkg")
    # run from tmp_path: `python -m megatron_dapo.cli` must find the stand-in, not the repository's package
    proc = subprocess.run(["bash", str(SBATCH)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "time limit: USR1 to the trainers in" in proc.stdout
    calls = (tmp_path / "cli.log").read_text().splitlines()
    assert calls[:3] == ["check --config", "plan --config", "plan --config --lead-time"], calls
    got = next(line for line in calls if line.startswith("train got USR1"))
    assert wanted - 2 <= float(got.split()[-2]) <= wanted + 3, got
    assert calls[-1] == "status --config --requeue", calls


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rendezvous_that_never_completes_is_one_line_per_rank(tiny, tmp_path, rank):
    """Rank 1 with nobody listening at MASTER_ADDR:MASTER_PORT (a dead node 0), or rank 0 whose peer never starts:
    after distributed.timeout_minutes, one `error:` line naming the rank, the address and the timeout, exit 2, no
    traceback (was: torch's DistNetworkError / DistStoreError traceback, docs/reliability.md row 54)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
           *_args(tiny, tmp_path / "run", steps=1), "--distributed.timeout_minutes=0.1"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"rank {rank} of 2: no rendezvous at 127.0.0.1:{port} within distributed.timeout_minutes=0.1" in errors[0]
    assert "Traceback" not in proc.stderr


def test_launch_on_a_node_that_never_meets_node_0_is_one_line(tiny, tmp_path):
    """`megatron-dapo launch --nnodes 2` on node 1 while node 0 never starts: torchrun's c10d rendezvous gives up after
    distributed.timeout_minutes (passed as its join/read timeouts) and launch prints one line, exit 2 (was: torchrun's
    RendezvousTimeoutError traceback after its own 600 s default)."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "launch", "--nproc-per-node=1", "--nnodes=2", "--node-rank=1",
           f"--rdzv-endpoint={endpoint}", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
           *_args(tiny, tmp_path / "run", steps=1), "--distributed.timeout_minutes=0.1"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"launch node 1 of 2: no rendezvous at {endpoint} within distributed.timeout_minutes=0.1" in errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_failed_attempt_runs_again_and_resumes_from_its_last_checkpoint(tiny, tmp_path):
    """A rank's exception in step 2 (after step 1's save): the sbatch body runs srun again (distributed.max_restarts,
    DAPO_RESTART_COUNT=1), the trainer says why the first attempt ended, resumes from step 1 and finishes; nothing
    is requeued (issue 22, item 3)."""
    run_dir = tmp_path / "run"
    env = _env(tmp_path, FAKE_SRUN_MODULE="tests._hooks_driver", MEGATRON_DAPO_CRASH="step_end:2:0:raise")
    code, out = _sbatch(env, _args(tiny, run_dir, steps=3))
    assert code == 0, out[-4000:]
    assert out.count("attempt 0 failed (srun exit code 1): restart 1 of 2 (distributed.max_restarts)") == 1, out[-4000:]
    why = (
        f"restart 1 of 2 (distributed.max_restarts): attempt 0 ended: rank 0 (host {socket.gethostname()}) at step "
        "2: RuntimeError: test hook: rank 0 fails at step_end of step 2; resuming from the last verified checkpoint"
    )
    assert why in out, out[-4000:]
    assert "resumed from" in out and "(step 1 of 3)" in out, out[-4000:]
    assert _metric_steps(run_dir) == [1, 2, 3]
    assert not (tmp_path / "slurm.log").exists()
