"""Engine processes and weight-update groups started from a torchrun worker (launch_env.py).

torchrun --rdzv-backend c10d exports TORCHELASTIC_USE_AGENT_STORE=True to its workers; a process that inherits it
and rendezvouses on tcp://host:port builds a client-only store and times out. mp.spawn tests never see this, so
this one launches a real torchrun. The worker (_torchrun_launch_worker.py) runs two negative controls beside the
checks, so the test fails if the environment stops reproducing the bug.

Verified by hand (2026-12-01): with the scrubbed_environ() around sglang.Engine removed from SGLangEngine, "engine"
fails with "RuntimeError: scheduler died: DistNetworkError: The client socket has timed out"; with
init_weight_update_group back on dist.rendezvous, "server_group" fails with the same DistNetworkError.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from megatron_dapo.launch_env import is_launcher_var
from megatron_dapo.launch_env import rendezvous_store
from megatron_dapo.launch_env import scrubbed_env
from megatron_dapo.launch_env import scrubbed_environ
from megatron_dapo.net import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_torchrun_launch_worker.py")

TORCHRUN_ENV = {
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "ROLE_NAME": "default",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
KEPT = {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_NVLS_ENABLE": "0", "SLURM_PROCID": "3", "PATH": "/usr/bin"}


def test_scrubbed_env_removes_launcher_variables_only():
    env = {**TORCHRUN_ENV, **KEPT}
    assert scrubbed_env(env) == KEPT
    assert env == {**TORCHRUN_ENV, **KEPT}  # the input is not modified
    assert is_launcher_var("TORCHELASTIC_SOMETHING_NEW") and not is_launcher_var("RANKING")


def test_scrubbed_environ_restores_removed_values_and_keeps_other_changes(monkeypatch):
    for k, v in {**TORCHRUN_ENV, **KEPT}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SGLANG_TEST_MARKER", raising=False)
    with scrubbed_environ() as removed:
        assert removed == TORCHRUN_ENV
        assert not any(k in os.environ for k in TORCHRUN_ENV)
        assert all(os.environ[k] == v for k, v in KEPT.items())
        os.environ["SGLANG_TEST_MARKER"] = "1"  # a library setting its own variable in the parent
        os.environ["MASTER_PORT"] = "1"  # ... or one of ours: the worker's value comes back
    assert all(os.environ[k] == v for k, v in {**TORCHRUN_ENV, **KEPT}.items())
    assert os.environ["SGLANG_TEST_MARKER"] == "1"


def test_rendezvous_store_ignores_the_agent_store_variable(monkeypatch):
    """The old code (dist.rendezvous) under this variable makes rank 0 a client: it would time out here."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    store = rendezvous_store("127.0.0.1", free_port(), 0, 1, timedelta(seconds=3))
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_engine_and_weight_group_start_under_torchrun(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for k in list(env):
        if k.startswith("TORCHELASTIC_"):
            env.pop(k)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "0"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(WORKER), str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        _, err = proc.communicate()
        pytest.fail(f"torchrun launch timed out; stderr tail:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out.read_text())
    assert report["agent_store"] == "True"  # torchrun's c10d backend really exported it
    # Negative controls: the environment reproduces the hang (else this test would prove nothing).
    assert not report["control_engine"]["ok"] and "DistNetworkError" in report["control_engine"]["error"]
    assert not report["control_group"]["ok"] and "DistNetworkError" in report["control_group"]["error"]
    # Through our code: SGLangEngine's scheduler child and the server-mode weight group start.
    assert report["engine"]["ok"], report["engine"]
    assert report["engine"]["env"] == {"TORCHELASTIC_USE_AGENT_STORE": None, "RANK": None, "MASTER_PORT": None}
    assert report["agent_store_after"] == "True"  # the worker's own environment is restored
    assert report["server_group"]["ok"], report["server_group"]
