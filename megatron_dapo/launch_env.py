"""The launcher's environment, read in this one module: who this rank is (torchrun or srun variables, or a single
process), how many nodes and ranks per node, and a clean environment for processes and rendezvous started from a
torchrun / srun worker.

    launch_env()              (rank, world_size, local_rank, master_addr, master_port): RANK, WORLD_SIZE, LOCAL_RANK,
                              MASTER_ADDR, MASTER_PORT under torchrun; SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and
                              MASTER_ADDR (else SLURM_LAUNCH_NODE_IPADDR, else the nodelist's first host), MASTER_PORT
                              (else derived from SLURM_JOB_ID) under srun; rank 0 of 1 on a free port otherwise
    launch_rank_world()       (rank, world_size) alone (no address or port is looked up); local_rank(default)
    ranks_per_node(world)     LOCAL_WORLD_SIZE (torchrun), else world / SLURM_NNODES, else None; num_nodes(world)

    torchrun agent --env: TORCHELASTIC_USE_AGENT_STORE=True, RANK, MASTER_ADDR, ...--> trainer rank
        trainer rank --scrubbed_environ()--> sglang.Engine / vllm.LLM --spawn--> scheduler / worker processes
                                                                            init_process_group("tcp://127.0.0.1:p")
        trainer rank --rendezvous_store()--> weight-update group store (rank 0 hosts it; env never read)
        trainer rank --launch_store()-->     the launcher's store (torchrun's agent store, else rank 0 hosts it)

Every store rank 0 of ours hosts listens on the job's interface only (`store_bind_address`), not on every interface
as torch's own do: loopback on one node, the interface of DAPO_SOCKET_IFNAME (GLOO_SOCKET_IFNAME) across nodes.

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
import re
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

    Rank 0 hosts a TCPStore on port, listening on `host`'s address only (`store_bind_address`), and waits for
    world_size - 1 clients; the other ranks connect to host:port. Same arguments as torch's _create_c10d_store without
    the agent store, so it meets SGLang's receiver, which rendezvouses with dist.rendezvous("tcp://host:port", rank >=
    1, ...). It never reads TORCHELASTIC_USE_AGENT_STORE and never touches os.environ (HTTP threads run beside it).
    Returns a torch.distributed.TCPStore.
    """
    if not 0 < port < 2**16:
        raise ValueError(f"rendezvous_store: port must be in 1..65535, got {port}")
    bind = store_bind_address(host, nodes=1) if rank == 0 else None  # the servers dial `host`, which is local
    return hosted_store(host, port, rank, world_size, timeout, bind=bind)


def launch_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta, env: Mapping[str, str] | None = None
):
    """The launcher's rendezvous store at host:port (MASTER_ADDR:MASTER_PORT), as torch's tcp:// rendezvous builds it
    (_create_c10d_store) except where rank 0 listens: under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True)
    every rank is a client of the store torchrun hosts; otherwise (srun, a single process) rank 0 hosts it on the
    job's interface only (`store_bind_address`; torch listens on every interface). Returns a TCPStore."""
    from torch.distributed import TCPStore

    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return TCPStore(host_name=host, port=port, world_size=world_size, is_master=False, timeout=timeout)
    bind = store_bind_address(host, nodes=num_nodes(world_size, env), env=env) if rank == 0 else None
    return hosted_store(host, port, rank, world_size, timeout, bind=bind)


def hosted_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta, *, bind: str | None):
    """A multi-tenant TCPStore at host:port: rank 0 hosts it listening on `bind` only (None: every interface), the
    other ranks connect to host:port. A second store of this process on the same port shares rank 0's server, as
    torch's own rendezvous stores do."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(host_name=host, port=port, world_size=world_size, is_master=False, timeout=timeout)
    fd, port = listening_fd(bind, port)
    return TCPStore(
        host_name=host, port=port, world_size=world_size, is_master=True, timeout=timeout, multi_tenant=True,
        master_listen_fd=fd,
    )  # fmt: skip


def store_bind_address(host: str, *, nodes: int, env: Mapping[str, str] | None = None) -> str | None:
    """The address a store that others dial at `host` listens on: the interface GLOO_SOCKET_IFNAME names when the job
    spans nodes (job.sh sets it from DAPO_SOCKET_IFNAME); else the local address `host` resolves to, unless it is
    loopback while the job spans nodes (a /etc/hosts entry such as 127.0.1.1 for the host's own name: the other
    nodes resolve the name elsewhere); None (every interface) when neither holds, e.g. `host` names an address this
    host cannot bind (a forwarded or virtual one)."""
    env = os.environ if env is None else env
    if nodes > 1 and (address := job_interface_address(env)) is not None:
        return address
    try:
        resolved = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None
    if is_loopback(resolved) and nodes > 1:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((resolved, 0))
    except OSError:  # not an address of this host
        return None
    return resolved


def gloo_interfaces(env: Mapping[str, str]) -> list[str]:
    """The interface names GLOO_SOCKET_IFNAME lists (comma-separated; job.sh sets it from DAPO_SOCKET_IFNAME)."""
    return [n.strip() for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]


def job_interface_address(env: Mapping[str, str]) -> str | None:
    """The IPv4 address of the one interface GLOO_SOCKET_IFNAME names (the network the job's nodes reach each other
    on), or None: unset, several names, or an interface without an address."""
    names = gloo_interfaces(env)
    return interface_address(names[0]) if len(names) == 1 else None


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux SIOCGIFADDR), or None (no such interface, or none)."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])


# ------------------------------------------------------------------------------------------ who this rank is
def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: "gpu[003-005,9],cpu1" -> "gpu003"; "a1,a2" -> "a1"."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"SLURM_JOB_NODELIST: cannot parse {nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_rank_world(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world_size) from torchrun (RANK, WORLD_SIZE) or srun (SLURM_PROCID, SLURM_NTASKS); (0, 1) otherwise."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return 0, 1


def launch_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int, str, int]:
    """(rank, world_size, local_rank, master_addr, master_port) from torchrun, srun or a single process (the module
    docstring says which variables)."""
    from megatron_dapo.net import free_port

    env = os.environ if env is None else env
    rank, world = launch_rank_world(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        local = int(env.get("LOCAL_RANK", rank))
        return rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        local = int(env.get("SLURM_LOCALID", 0))
        addr = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
        if not addr:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise RuntimeError("srun launch: set MASTER_ADDR (no SLURM_LAUNCH_NODE_IPADDR or SLURM_JOB_NODELIST)")
            addr = first_slurm_host(nodelist)
        port = int(env.get("MASTER_PORT") or 15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return rank, world, local, addr, port
    return 0, 1, 0, "127.0.0.1", free_port()


def local_rank(default: int, env: Mapping[str, str] | None = None) -> int:
    """This rank's index on its node: LOCAL_RANK (torchrun), else SLURM_LOCALID (srun), else `default`."""
    env = os.environ if env is None else env
    return int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", default)))


def ranks_per_node(world_size: int, env: Mapping[str, str] | None = None) -> int | None:
    """Ranks on each node when the launcher says: torchrun's LOCAL_WORLD_SIZE, else world / Slurm's SLURM_NNODES;
    None when neither is set."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE")
    if local and int(local) > 0:
        return int(local)
    slurm = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    return max(1, world_size // int(slurm)) if slurm and int(slurm) > 0 else None


# ------------------------------------------------------------------------------ a routable address for servers


def num_nodes(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """Nodes in this job: world / `ranks_per_node`, else 1."""
    per_node = ranks_per_node(world_size, env)
    return max(1, world_size // per_node) if per_node else 1


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


def listening_fd(host: str | None, port: int = 0) -> tuple[int, int]:
    """A TCP socket listening on `host` only (None: every interface, IPv6 and IPv4 where the host has IPv6) at `port`
    (0: a free one), handed over as (file descriptor, port) for TCPStore(master_listen_fd=...): the store then
    accepts connections on the job's interface, not on every interface of the host (loopback on a single node)."""
    if host is None:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            host = "::"
        except OSError:  # no IPv6 on this host
            sock, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    return sock.detach(), port  # the store owns the descriptor from here on


def job_store_host(world_size: int, env: Mapping[str, str] | None = None) -> str:
    """The address rank 0's job store listens on: loopback when the job is on one node, else the address of the
    interface GLOO_SOCKET_IFNAME names (DAPO_SOCKET_IFNAME), else this host's address toward MASTER_ADDR (the
    interface the launcher's rendezvous uses)."""
    env = os.environ if env is None else env
    if num_nodes(world_size, env) == 1:
        return "127.0.0.1"
    return job_interface_address(env) or local_address(env.get("MASTER_ADDR"))


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
