"""A clean launch environment for processes and rendezvous started from a torchrun / srun worker.

    torchrun agent --env: TORCHELASTIC_USE_AGENT_STORE=True, RANK, MASTER_ADDR, ...--> trainer rank
        trainer rank --scrubbed_environ()--> sglang.Engine / vllm.LLM --spawn--> scheduler / worker processes
                                                                            init_process_group("tcp://127.0.0.1:p")
        trainer rank --rendezvous_store()--> weight-update group store (rank 0 hosts it; env never read)

Why: torch's tcp:// and env:// rendezvous (torch/distributed/rendezvous.py, torch 2.13) call _create_c10d_store,
which reads TORCHELASTIC_USE_AGENT_STORE. When it is "True" every rank, rank 0 included, builds a TCPStore
*client* (is_master=False), on the assumption that torchrun's agent already hosts the store at hostname:port. That
holds for the trainer's own world group (MASTER_ADDR:MASTER_PORT is the agent's store) and for nothing else: an
SGLang scheduler that inherits the variable and rendezvouses on tcp://127.0.0.1:<its own port> waits for a server
nobody starts and fails after its timeout with DistNetworkError ("client socket has timed out"). The same happens
to a weight-update group whose rank 0 lives in a torchrun worker.

Variables removed (LAUNCHER_VARS and every name starting with TORCHELASTIC_), and who reads them:
    TORCHELASTIC_USE_AGENT_STORE   torch rendezvous._create_c10d_store: client-only store (the hang)
    TORCHELASTIC_*                 RUN_ID, RESTART_COUNT, MAX_RESTARTS, ERROR_FILE (a child's @record would write
                                   the worker's error file), TIMER_FILE / ENABLE_FILE_TIMER (the agent's watchdog),
                                   HEALTH_CHECK_PORT: the agent's state, meaningless in another process tree
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                                   torch env:// rendezvous; SGLang's _set_shm_master_env (setdefault, so the
                                   trainer's values would win) and its global TCPStore (MASTER_ADDR); SGLang's
                                   checkpoint_engine (RANK, WORLD_SIZE)
    LOCAL_RANK                     torch get_node_local_rank, SGLang init_distributed_environment with env://
    LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE
                                   the rest of torchrun's per-worker set (local_elastic_agent._start_workers)
Kept: CUDA_VISIBLE_DEVICES, NCCL_* / TORCH_NCCL_* settings, OMP_NUM_THREADS, SLURM_* (torch and SGLang read no
SLURM variable; under a bare srun launch our init_distributed reads SLURM_PROCID & co. but exports nothing, so the
children see only the MASTER_ADDR / MASTER_PORT an sbatch script exports, which are removed).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import timedelta

from megatron_dapo.net import is_loopback
from megatron_dapo.net import url_host

LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
"""Every variable with one of these prefixes is removed."""
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""torchrun's per-worker identity and rendezvous endpoint (plus the MASTER_* an sbatch script exports)."""


def is_launcher_var(name: str) -> bool:
    """True for a variable that describes the launching worker's place in its job (removed for children)."""
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def scrubbed_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of env (default os.environ) without the launcher variables: pass it as env= to subprocess calls."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if not is_launcher_var(k)}


@contextmanager
def scrubbed_environ() -> Iterator[dict[str, str]]:
    """Remove the launcher variables from os.environ for the duration of the block, then put them back.

    For libraries that spawn their processes with the parent's environment and take no env argument (SGLang's
    Engine and vLLM's LLM start their schedulers / workers with multiprocessing "spawn", which inherits the C
    environ that os.environ writes through to). Yields the removed {name: value}. On exit each removed variable
    gets its old value back (whatever the block set it to); other changes made inside the block (SGLang sets
    NCCL_CUMEM_ENABLE, CUDA_DEVICE_MAX_CONNECTIONS, ... in its parent) are left alone.

    os.environ is process-wide: use it where no other thread reads the environment (engine construction runs on
    the main thread before any of ours start).
    """
    removed = {k: v for k, v in os.environ.items() if is_launcher_var(k)}
    for name in removed:
        del os.environ[name]
    try:
        yield removed
    finally:
        os.environ.update(removed)


def rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta):
    """The c10d store torch's tcp:// rendezvous builds outside torchelastic, whatever the environment says.

    Rank 0 hosts a TCPStore on port (listening on every interface) and waits for world_size - 1 clients; the other
    ranks connect to host:port. Same arguments as torch's _create_c10d_store without the agent store, so it meets
    SGLang's receiver, which rendezvouses with dist.rendezvous("tcp://host:port", rank >= 1, ...). It never reads
    TORCHELASTIC_USE_AGENT_STORE and never touches os.environ (HTTP threads run beside it).
    Returns a torch.distributed.TCPStore.
    """
    from torch.distributed import TCPStore

    if not 0 < port < 2**16:
        raise ValueError(f"rendezvous_store: port must be in 1..65535, got {port}")
    return TCPStore(
        host_name=host,
        port=port,
        world_size=world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )


# ------------------------------------------------------------------------------ a routable address for servers


def num_nodes(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """Nodes in this job: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else Slurm's SLURM_NNODES, else 1."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE")
    if local and int(local) > 0:
        return max(1, world_size // int(local))
    slurm = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    return int(slurm) if slurm else 1


def local_address(toward: str | None = None) -> str:
    """This host's address as others see it.

    With toward (a peer host), the source address the kernel picks to reach it (a UDP connect sends nothing);
    otherwise, or if that fails, the address socket.getfqdn() resolves to (may be loopback on hosts whose
    /etc/hosts maps the hostname to 127.0.1.1: callers validate).
    """
    if toward and not is_loopback(toward):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((toward, 9))
                return sock.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"


def weight_sync_master_address(configured: str, server_urls: Sequence[str], nodes: int) -> str:
    """The address SGLang servers connect to for the weight-update group (this trainer rank hosts its store).

    configured: rollout.weight_sync_master_address. "" = detect: the local address that routes to the first remote
    server; 127.0.0.1 when every server is local and the job has one node; else the host's resolved name.
    A loopback address is refused when the job spans nodes or any server URL is not local: servers would dial
    themselves and the group would hang until its timeout. Raises ValueError (one line naming the field).
    """
    remote = [url_host(u) for u in server_urls if not is_loopback(url_host(u))]
    if configured:
        address = configured
    elif remote or nodes > 1:
        address = local_address(remote[0] if remote else None)
    else:
        address = "127.0.0.1"
    if is_loopback(address) and (nodes > 1 or remote):
        why = f"server {remote[0]} is not local" if remote else f"the job spans {nodes} nodes"
        raise ValueError(
            f"rollout.weight_sync_master_address: {address!r} is a loopback address but {why}; "
            "set it to an address of the trainer's rank-0 host that the servers can reach"
        )
    return address
