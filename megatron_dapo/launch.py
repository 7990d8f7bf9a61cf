"""Start-up and process lifecycle of a training job: checks before any process group, the run-dir lock, exiting
with the launcher.

    megatron-dapo check / train --> preflight(config, world_size)   TP x PP vs world, heads vs TP, model path,
                                                                     engine installed, data files (no collectives)
                      train     --> RunDirLock(run_dir).acquire()   rank 0; one job per run_dir
                                --> exit_with_launcher(...)         torchrun workers stop when torchrun dies

A user error found here is a StartupError: the CLI prints `error: <one line>` on rank 0 only and every rank exits
with code 2 (the config layer's convention), instead of one traceback per rank.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"


class StartupError(Exception):
    """A problem with the run's inputs or environment, found before training starts; the message is one line.
    report_rank: the rank that prints it (0: every rank found the same problem; a rank's own number when the ranks
    cannot agree, e.g. before the process group exists)."""

    def __init__(self, message: str, report_rank: int = 0) -> None:
        super().__init__(message)
        self.report_rank = report_rank


# ------------------------------------------------------------------------------------------------------ preflight
def preflight(config: Any, world_size: int) -> None:
    """Checks that need no process group and give every rank the same answer; raises StartupError.

    Covers: actor.tensor_parallel x pipeline_parallel dividing the world size (the actor's ranks of a split launch,
    rollout.engine_ranks), the model directory and its
    config.json (attention and KV heads divisible by TP, layers by PP), the checkpoint a resume would start from (its
    config compatible with this one), the rollout engine's and the tracker's packages, the data files,
    the network interfaces GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name (`check_socket_ifnames`).
    """
    a, engines = config.actor, config.rollout.engine_ranks
    model_parallel = a.tensor_parallel * a.pipeline_parallel
    ep = getattr(a, "expert_parallel", 1)
    if engines and engines >= world_size:
        raise StartupError(
            f"rollout.engine_ranks {engines} leaves no actor rank of the {world_size} processes launched (the last "
            "engine_ranks ranks only generate)"
        )
    if (world_size - engines) % model_parallel:
        ranks = f"world size {world_size} (processes launched)"
        if engines:
            ranks = f"actor's {world_size - engines} ranks ({world_size} launched, rollout.engine_ranks {engines})"
        raise StartupError(
            f"actor.tensor_parallel {a.tensor_parallel} x actor.pipeline_parallel {a.pipeline_parallel} = "
            f"{model_parallel} does not divide the {ranks}"
        )
    if (world_size - engines) % (model_parallel * ep):
        raise StartupError(
            f"actor.tensor_parallel {a.tensor_parallel} x actor.expert_parallel {ep} x actor.pipeline_parallel "
            f"{a.pipeline_parallel} = {model_parallel * ep} does not divide the actor's {world_size - engines} ranks "
            "(experts are split over data-parallel ranks)"
        )
    text = _check_model(a.model_path, a.tensor_parallel, a.pipeline_parallel, a)
    _check_resume(config, text)
    _check_engine(config.rollout)
    tracker = config.logging.tracker
    if tracker != "none":
        _check_package(tracker, f"logging.tracker={tracker}, but the {tracker} package", f"pip install {tracker}, or "
                       "logging.tracker=none")  # fmt: skip
    check_socket_ifnames(os.environ)
    check_restart_store(os.environ)
    if not config.data.train_files:
        raise StartupError("data.train_files: no data files given")
    for key in ("train_files", "eval_files"):
        for i, path in enumerate(getattr(config.data, key)):
            if not os.path.isfile(path):
                raise StartupError(f"data.{key}[{i}]: {path} does not exist")


# torchrun's c10d rendezvous shares its TCPStore with the workers (torch >= 2.5) and keeps it across restarts: a
# restarted attempt's ranks can read the previous attempt's process-group keys (gloo addresses, NCCL unique ids) and
# fail to connect or hang (pytorch/pytorch#135712, #167288). With sharing off, each attempt's rank 0 hosts a fresh
# store on a fresh port. `megatron-dapo launch` sets it; a plain torchrun with restarts must.
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_restart_store(env: Mapping[str, str]) -> None:
    """Refuse (StartupError, one line) a torchrun launch that can restart its workers on the rendezvous store it
    shares with them (see NO_SHARED_STORE)."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise StartupError(
            f"torchrun --max-restarts={restarts} with the rendezvous store shared with the workers: a restarted "
            f"attempt can read the previous one's addresses and fail or hang (pytorch#135712); export "
            f"{NO_SHARED_STORE}=1 before torchrun, or use megatron-dapo launch"
        )


def check_socket_ifnames(env: Mapping[str, str], available: list[str] | None = None) -> None:
    """The interfaces GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name must exist on this host (the sbatch files set
    both from DAPO_SOCKET_IFNAME; docs/cluster.md says how to pick one). A wrong name otherwise fails much later: gloo
    raises in the first new_group, NCCL hangs or falls back to another network. Gloo: a comma-separated list of exact
    names, each must exist. NCCL: comma-separated prefixes ("eth" matches eth0), "=name" for an exact name, a leading
    "^" excludes the list instead; some interface must match an including list. Raises StartupError (one line)."""
    names = available if available is not None else [name for _, name in socket.if_nameindex()]
    from megatron_dapo.launch_env import gloo_interfaces

    gloo = gloo_interfaces(env)
    missing = [n for n in gloo if n not in names]
    if missing:
        raise StartupError(
            f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}: no interface {', '.join(missing)} on this host "
            f"(it has {', '.join(names)}); set DAPO_SOCKET_IFNAME to one of them (docs/cluster.md)"
        )
    nccl = env.get("NCCL_SOCKET_IFNAME", "").strip()
    if nccl and not nccl.startswith("^"):
        exact = nccl.startswith("=")
        wanted = [w.strip() for w in nccl.lstrip("=").split(",") if w.strip()]
        if not any(n == w if exact else n.startswith(w) for n in names for w in wanted):
            raise StartupError(
                f"NCCL_SOCKET_IFNAME={nccl}: no interface on this host matches (it has {', '.join(names)}); set "
                "DAPO_SOCKET_IFNAME to one of them (docs/cluster.md)"
            )


def _check_engine(rollout: Any) -> None:
    """The in-process engine's package must import (rollout/engines.py: the embedded engine needs none, server mode
    talks HTTP and needs none here)."""
    from megatron_dapo.rollout.engines import engine_kind

    engine = rollout.engine
    package = engine_kind(engine).needs_package(rollout.mode)
    hint = f"pip install -e .[{engine}], or rollout.engine=transformers"
    _check_package(package, f"rollout.engine={engine}, but the {engine} package", hint)


def _check_package(package: str | None, what: str, hint: str) -> None:
    """StartupError "<what> is not installed / cannot be imported (...); <hint>" unless `package` imports."""
    if package is None:
        return
    if importlib.util.find_spec(package) is None:
        problem = "is not installed"
    else:
        try:
            importlib.import_module(package)
            return
        except Exception as err:  # a broken install raises anything from its imports
            problem = f"cannot be imported ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    raise StartupError(f"{what} {problem}; {hint}")


def _check_model(model_path: str, tp: int, pp: int, actor: Any = None) -> dict[str, Any]:
    """The model directory's config.json against the layout; returns its text model's fields."""
    if not model_path:
        raise StartupError("actor.model_path: not set")
    config_file = Path(model_path) / "config.json"
    if not Path(model_path).is_dir():
        raise StartupError(f"actor.model_path: {model_path} does not exist (or is not a directory)")
    if not config_file.is_file():
        raise StartupError(f"actor.model_path: {model_path} has no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(config_file.read_text())
    except ValueError as err:
        raise StartupError(f"{config_file}: not valid JSON ({err})") from None
    text = hf.get("text_config", hf) if isinstance(hf, dict) else {}
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    layers = text.get("num_hidden_layers")
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(value, int) and value % tp:
            raise StartupError(f"actor.tensor_parallel {tp} must divide the model's {name} {value} ({config_file})")
    if isinstance(layers, int) and layers % pp:
        raise StartupError(
            f"actor.pipeline_parallel {pp} must divide the model's num_hidden_layers {layers} ({config_file})"
        )
    if actor is not None and isinstance(text, dict):
        _check_experts(text, actor, config_file)
    return text if isinstance(text, dict) else {}


def _check_resume(config: Any, text: dict[str, Any]) -> None:
    """The checkpoint train would resume from against this config (checkpoint.check_compatible, the check train makes
    after verifying it): for checkpoint.resume=auto the newest complete one whose config.yaml matches its manifest
    (train falls back past one that does not), or the one checkpoint.resume names. Only config.yaml is hashed here;
    train verifies the rest."""
    import json
    import types

    from megatron_dapo.actor.arch import is_moe
    from megatron_dapo.checkpoint import MANIFEST
    from megatron_dapo.checkpoint import CheckpointError
    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.checkpoint import check_files
    from megatron_dapo.checkpoint import checkpoint_root
    from megatron_dapo.checkpoint import list_checkpoints
    from megatron_dapo.checkpoint import manifest_files

    resume = config.checkpoint.resume
    if resume == "never":
        return
    candidates = list_checkpoints(checkpoint_root(config.trainer.run_dir)) if resume == "auto" else [Path(resume)]
    for path in reversed(candidates):
        try:
            intact = not check_files(path, manifest_files(json.loads((path / MANIFEST).read_text())), ["config.yaml"])
        except (OSError, ValueError, KeyError):
            intact = False
        if not intact:
            continue  # damaged or unverifiable: train falls back past it, or refuses it with its own line
        try:
            CheckpointManager(path.parent, keep_last=0).check_config(
                path, config.to_dict(), moe=is_moe(types.SimpleNamespace(**text))
            )
        except CheckpointError as err:
            raise StartupError(str(err).splitlines()[0]) from None
        return


def _check_experts(text: dict[str, Any], actor: Any, config_file: Path) -> None:
    """The actor's mixture-of-experts settings against the model (actor.model.check_moe, the check the actor's build
    makes, here before any process starts): expert_parallel or routing_replay on a dense model, expert_parallel not
    dividing the experts. An architecture the actor does not support is refused here (one line naming what is
    missing for the families in arch.UNSUPPORTED_WHY); a config.json naming neither architectures nor model_type is
    left to the build."""
    import types

    from megatron_dapo.actor.arch import check_moe
    from megatron_dapo.actor.arch import model_arch

    hf = types.SimpleNamespace(**text)
    try:
        model_arch(hf)
    except ValueError as err:
        if text.get("architectures") or text.get("model_type"):
            raise StartupError(f"{str(err).splitlines()[0]} ({config_file})") from None
        return
    try:
        check_moe(hf, actor)
    except (ValueError, TypeError, AttributeError) as err:
        raise StartupError(f"{str(err).splitlines()[0]} ({config_file})") from None


# ------------------------------------------------------------------------------------------------------ run-dir lock
class RunDirLock:
    """An exclusive lock on a run directory: flock on the directory itself and on run_dir/.lock, which records the
    holder's host and pid.

    A second job on the same run_dir fails with the holder's host and pid. The directory's lock cannot be bypassed by
    deleting a file (the probe deleted .lock during a run and a second job wrote the same run dir); .lock names the
    holder, and where directories cannot be flocked (some network filesystems) it is the lock, re-checked before each
    save (`check`). The kernel drops a flock when its process dies, so a lock left by a dead job is simply taken over
    (logged). Where the filesystem has no flock at all, the recorded pid decides: a dead pid on this host is taken
    over, a live one or another host's is an error.
    """

    def __init__(self, run_dir: str | Path, log: Callable[[str], None] = print) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.log = log
        self._fd: int | None = None
        self._dir_fd: int | None = None
        """The run directory's own descriptor, flocked; None where the filesystem cannot flock a directory."""

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._dir_fd = self._lock_directory()
        try:
            self._fd = self._lock_file()
        except BaseException:
            self._unlock_directory()
            raise
        self._write(self._fd)

    def _lock_directory(self) -> int | None:
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(self._in_use(self._holder())) from None
        except OSError as err:  # NFS emulates flock with byte-range locks, which a read-only descriptor cannot take
            os.close(fd)
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
                raise
            return None
        return fd

    def _unlock_directory(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # closing drops the flock
            self._dir_fd = None

    def _lock_file(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(self._in_use(self._holder())) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            self._acquire_without_flock(fd)
        else:
            previous = self._holder()
            if previous and previous.get("pid") != os.getpid():
                self.log(
                    f"{self.path}: taking over the lock left by host {previous.get('host')} pid {previous.get('pid')} "
                    f"(that process no longer holds it)"
                )
        return fd

    def check(self) -> str | None:
        """Before a save (rank 0): None when this job still holds the run dir, else the one line to stop on. A .lock
        deleted or replaced during the run is re-created (logged) while the directory's own lock is held, since no
        other job can then hold the run dir; without that lock, another job may have taken the new file, so the run
        must not write over its files."""
        if self._fd is None:
            return None
        held = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
            same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            return None
        if self._dir_fd is None:
            return (
                f"{self.path} was deleted or replaced during the run, and this filesystem cannot lock the directory "
                f"itself: another job may now hold {self.path.parent}; stopping before the save so as not to write "
                "over its files"
            )
        os.close(self._fd)
        self._fd = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a file someone put there: no job can hold it while the directory is locked
        self._fd = self._lock_file()
        self._write(self._fd)
        self.log(f"{self.path} was deleted or replaced during the run; re-created (the run directory stays locked)")
        return None

    def _acquire_without_flock(self, fd: int) -> None:
        holder = self._holder()
        if holder:
            same_host = holder.get("host") == socket.gethostname()
            if not same_host or _alive(int(holder.get("pid", -1))):
                os.close(fd)
                raise StartupError(self._in_use(holder) + " (no flock on this filesystem: delete the file if stale)")
            self.log(f"{self.path}: taking over the stale lock of pid {holder.get('pid')} on this host (it is dead)")

    def _in_use(self, holder: dict[str, Any]) -> str:
        who = f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"
        if not holder:
            who = f"the directory is locked; its {LOCK_NAME}, which names the holder, is missing or empty"
        return f"{self.path.parent} is in use by another job ({who}; lock {self.path})"

    def _holder(self) -> dict[str, Any]:
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _write(self, fd: int) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        self._unlock_directory()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------------------------ launcher death
def exit_with_launcher(grace_s: float, poll_s: float = 1.0) -> threading.Thread | None:
    """Under torchrun, stop this worker when its launcher dies (e.g. kill -9 of torchrun, which starts workers in
    their own session, so they would train on alone).

    A daemon thread polls os.getppid(): once the parent is gone it sends this process SIGTERM (the trainer's
    preemption flag: save at the step boundary, exit) and, if the process still runs grace_s later (a peer gone, a
    collective stuck), SIGKILL. Polling is used rather than prctl(PR_SET_PDEATHSIG), which fires when the parent
    *thread* that forked us exits. Returns the thread, or None outside torchrun (a plain or nohup run keeps going).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="exit_with_launcher", daemon=True)
    thread.start()
    return thread
