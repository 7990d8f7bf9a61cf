"""The launcher's environment, read in one module (megatron_dapo/launch_env.py): torchrun, srun, a single process;
and where the stores rank 0 hosts listen."""

import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

from megatron_dapo.launch_env import hosted_store
from megatron_dapo.launch_env import interface_address
from megatron_dapo.launch_env import job_store_host
from megatron_dapo.launch_env import launch_env
from megatron_dapo.launch_env import launch_rank_world
from megatron_dapo.launch_env import launch_store
from megatron_dapo.launch_env import local_rank
from megatron_dapo.launch_env import num_nodes
from megatron_dapo.launch_env import ranks_per_node
from megatron_dapo.launch_env import rendezvous_store
from megatron_dapo.launch_env import store_bind_address
from megatron_dapo.net import free_port

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "n0",
            "MASTER_PORT": "1234"}  # fmt: skip
SRUN = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "77"}  # fmt: skip


def test_torchrun_srun_and_a_single_process():
    assert launch_env(TORCHRUN) == (5, 16, 1, "n0", 1234)
    assert launch_env(SRUN) == (9, 16, 1, "gpu003", 15000 + 77)  # address from the nodelist, port from the job id
    assert launch_env({**SRUN, "MASTER_ADDR": "h", "MASTER_PORT": "99"})[3:] == ("h", 99)
    rank, world, local, addr, port = launch_env({})
    assert (rank, world, local, addr) == (0, 1, 0, "127.0.0.1") and port > 0
    assert (
        launch_rank_world(TORCHRUN) == (5, 16)
        and launch_rank_world(SRUN) == (9, 16)
        and launch_rank_world({}) == (0, 1)
    )
    assert launch_env({**SRUN, **TORCHRUN})[:2] == (5, 16)  # torchrun's variables win


def test_nodes_and_local_ranks():
    assert ranks_per_node(16, TORCHRUN) == 8 and num_nodes(16, TORCHRUN) == 2
    assert ranks_per_node(16, SRUN) == 8 and num_nodes(16, SRUN) == 2
    assert ranks_per_node(4, {}) is None and num_nodes(4, {}) == 1
    assert local_rank(3, TORCHRUN) == 1 and local_rank(3, SRUN) == 1 and local_rank(3, {}) == 3


# ------------------------------------------------------------------------ where the stores we host listen (issue 38)
def _listening(port: int) -> set[str]:
    """Addresses listening on `port` (IPv4 dotted, IPv6 as '::' for the any-address), from /proc/net/tcp and tcp6."""
    import ipaddress

    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc writes each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.add(str(ipaddress.ip_address(raw)) if width == 8 else str(ipaddress.IPv6Address(raw)))
    return out


def test_the_bind_address_of_a_store_others_dial():
    assert store_bind_address("127.0.0.1", nodes=1, env={}) == "127.0.0.1"
    assert store_bind_address("localhost", nodes=1, env={}) == "127.0.0.1"
    # Across nodes a name that resolves to loopback here (an /etc/hosts 127.0.1.1 entry) resolves elsewhere there.
    assert store_bind_address("localhost", nodes=2, env={}) is None
    assert store_bind_address("192.0.2.7", nodes=1, env={}) is None  # not an address of this host (TEST-NET-1)
    assert store_bind_address("no-such-host.invalid", nodes=1, env={}) is None
    # DAPO_SOCKET_IFNAME (job.sh's GLOO_SOCKET_IFNAME) names the interface across nodes.
    assert store_bind_address("192.0.2.7", nodes=2, env={"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert store_bind_address("192.0.2.7", nodes=2, env={"GLOO_SOCKET_IFNAME": "nope0"}) is None
    assert interface_address("lo") == "127.0.0.1" and interface_address("nope0") is None
    assert (
        job_store_host(4, {"SLURM_NNODES": "2", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "192.0.2.7"}) == "127.0.0.1"
    )


_S = timedelta(seconds=10)


def test_the_launch_store_rank_0_hosts_listens_on_the_jobs_interface_only(monkeypatch):
    """Without torchrun's agent store (srun, a single process) rank 0 hosts the launcher's store: on MASTER_ADDR's
    interface only, where torch's own rendezvous listens on every interface. Under torchrun every rank is a client of
    the agent's store."""
    port = free_port()
    clients = []  # rank 1 connects while rank 0 waits for it
    joiner = threading.Thread(target=lambda: clients.append(launch_store("127.0.0.1", port, 1, 2, _S, env={})))
    joiner.start()
    store = launch_store("127.0.0.1", port, 0, 2, _S, env={})
    joiner.join()
    assert _listening(port) == {"127.0.0.1"}
    clients[0].set("k", b"v")
    assert store.get("k") == b"v"
    agent = launch_store("127.0.0.1", port, 0, 2, _S, env={"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent.get("k") == b"v" and _listening(port) == {"127.0.0.1"}  # a client: no second server
    other = free_port()
    weights = rendezvous_store("127.0.0.1", other, 0, 1, _S)  # SGLang's weight-update group
    assert _listening(other) == {"127.0.0.1"} and weights.add("n", 1) == 1
    wide = hosted_store("127.0.0.1", free_port(), 0, 1, _S, bind=None)
    assert _listening(wide.port) & {"::", "0.0.0.0"}  # None: every interface (a host that cannot bind the name)


_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
from megatron_dapo.actor.distributed import _init_process_group
rank = int(sys.argv[1])
_init_process_group("gloo", "127.0.0.1", int(sys.argv[2]), rank, 2, 30.0)
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
if rank == 0:
    import importlib
    t = importlib.import_module("tests.test_launch_env")
    print("LISTEN", sorted(t._listening(int(sys.argv[2]))), "SUM", x.item(), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_the_default_group_over_a_store_rank_0_hosts_on_loopback():
    """The world group's rendezvous outside torchrun (two processes as srun starts them): they meet, reduce, and rank
    0's store listens on 127.0.0.1 only."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_RANKS, str(r), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "LISTEN ['127.0.0.1'] SUM 3.0" in outs[0], outs[0][-2000:]
