"""Process groups for the actor, from torchrun or srun environments.

API:
    init_distributed(tensor_parallel, pipeline_parallel, *, expert_parallel=1, backend=None, timeout_s=1800,
                     seed=1234) -> ParallelGroups
    destroy_distributed() -> None
    ParallelGroups: tp_group / pp_group / dp_group / mp_group (+ embd_group) / ep_group / etp_group, rank,
        world_size, local_rank, tp_rank/tp_size, pp_rank/pp_size, dp_rank/dp_size, ep_rank/ep_size, pp_ranks,
        mp_ranks, device, is_first_stage / is_last_stage

World and rank come from torchrun's or srun's variables, or a single process (rank 0 of 1) on a free port: read in
one place, megatron_dapo/launch_env.py (launch_env).
Backend: NCCL when CUDA is available (device = cuda:LOCAL_RANK), gloo otherwise; on gloo without CUDA the
megatron-core CPU shims (cpu_compat.apply_cpu_compat) are applied here, explicitly, before any megatron call.
Rank order inside megatron is "tp-cp-ep-dp-pp": TP ranks are adjacent, PP stages are world / pp apart.
Expert parallel (MoE) is carved out of data parallel: the dense layers see dp = world / (tp * pp) replicas, the
experts are split over ep of them (the ranks of ep_group, same TP rank and stage), with expert tensor parallel =
tp (megatron's default; etp_group has the same ranks as tp_group).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.launch_env import launch_env
from megatron_dapo.launch_env import launch_store
from megatron_dapo.launch_env import local_rank as launch_local_rank


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's view of the actor's process groups (megatron parallel_state is initialised to match)."""

    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    """Model-parallel group: the tp_size * pp_size ranks that together hold one model replica."""
    embd_group: dist.ProcessGroup | None
    """First and last pipeline stage (tied embedding gradient all-reduce); None when pp_size == 1."""
    world_group: dist.ProcessGroup
    """Every rank of the job (rollout gathers, barriers, preemption agreement in the trainer)."""
    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    pp_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline group, stage 0 first."""
    mp_ranks: tuple[int, ...]
    """Global ranks of this rank's model-parallel group, in group-rank order."""
    device: torch.device
    ep_group: dist.ProcessGroup | None = None
    """Expert-parallel group (MoE): the ranks that split the experts of this stage; None when ep_size == 1."""
    etp_group: dist.ProcessGroup | None = None
    """Expert tensor-parallel group (MoE): the ranks that split each expert's matrices (same ranks as tp_group)."""
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def world_barrier(self) -> None:
        """A barrier over every rank of the job."""
        if self.world_size > 1:
            dist.barrier(group=self.world_group)

    def max_over_job(self, t: torch.Tensor) -> torch.Tensor:
        """t all-reduced in place with MAX over every rank of the job (one decision on every rank); returns t."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world_group)
        return t


def init_distributed(
    tensor_parallel: int,
    pipeline_parallel: int,
    *,
    expert_parallel: int = 1,
    backend: str | None = None,
    timeout_s: float = 1800.0,
    seed: int = 1234,
) -> ParallelGroups:
    """Initialise torch.distributed (unless already done), megatron parallel_state and the model-parallel seeds.

    Calling it again in the same processes (torch.distributed already up) rebuilds parallel_state with the new
    layout: tests use this to check several TP/PP layouts in one launch.

    Args:
        tensor_parallel: TP size; pipeline_parallel: PP size. world_size must be a multiple of their product;
            data parallel is world_size / (tensor_parallel * pipeline_parallel).
        expert_parallel: EP size of a mixture-of-experts model (1 for dense models): world_size must also be a
            multiple of tensor_parallel * expert_parallel * pipeline_parallel.
        backend: "nccl" or "gloo"; None picks NCCL with CUDA, gloo without.
        timeout_s: collective timeout of the default group and of megatron's groups (config:
            distributed.timeout_minutes): a rank that stops answering fails its peers' next collective after this.
        seed: base seed for megatron's RNG tracker (data-parallel seed = seed, TP seed = seed + 2718 + tp_rank).
    Returns:
        ParallelGroups for this rank.
    """
    from megatron.core import parallel_state as ps

    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if not dist.is_initialized():
        rank, world, local_rank, addr, port = launch_env()
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = launch_local_rank(rank)
    _check_layout(world, tensor_parallel, pipeline_parallel, expert_parallel)
    device = _device(backend, use_cuda, local_rank)
    if not dist.is_initialized():
        _init_process_group(backend, addr, port, rank, world, timeout_s)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=tensor_parallel,
        distributed_timeout_minutes=timeout_s / 60.0,  # timedelta(minutes=...): fractions are kept
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    return _groups(rank, world, local_rank, device, tensor_parallel, pipeline_parallel, expert_parallel)


def _check_layout(world: int, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int) -> None:
    """ValueError (one line) for a layout the world cannot hold."""
    if min(tensor_parallel, pipeline_parallel, expert_parallel) < 1:
        raise ValueError(
            f"init_distributed: tensor_parallel, pipeline_parallel and expert_parallel must be >= 1, "
            f"got {tensor_parallel}, {pipeline_parallel} and {expert_parallel}"
        )
    model_parallel = tensor_parallel * pipeline_parallel
    if world % model_parallel != 0:
        raise ValueError(
            f"init_distributed: world_size {world} is not divisible by tensor_parallel {tensor_parallel} "
            f"x pipeline_parallel {pipeline_parallel} = {model_parallel}"
        )
    if world % (model_parallel * expert_parallel) != 0:
        raise ValueError(
            f"init_distributed: world_size {world} is not divisible by tensor_parallel {tensor_parallel} "
            f"x expert_parallel {expert_parallel} x pipeline_parallel {pipeline_parallel} = "
            f"{model_parallel * expert_parallel} (experts are split over data-parallel ranks)"
        )


def _device(backend: str, use_cuda: bool, local_rank: int) -> torch.device:
    """This rank's device for `backend` (NCCL: its GPU, set current; gloo: the CPU, with the CPU shims applied)."""
    if backend == "nccl":
        if not use_cuda:
            raise RuntimeError("init_distributed: backend 'nccl' needs CUDA; use 'gloo' on CPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if not use_cuda:
        from megatron_dapo.actor.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    return torch.device("cpu")


def _init_process_group(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    """The default process group over the launcher's rendezvous; a rendezvous that fails is one StartupError line
    naming the address (a dead or unreachable host, a rank that never started)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        # The store torch's tcp:// method would build (and its "default_pg" prefix), rank 0 listening on the job's
        # interface only instead of every interface (launch_env.launch_store).
        store = dist.PrefixStore("default_pg", launch_store(addr, port, rank, world, timeout))
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except (dist.DistError, OSError) as err:  # OSError: rank 0 cannot listen on the port (in use)
        from megatron_dapo.launch import StartupError

        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StartupError(
            f"rank {rank} of {world}: no rendezvous at {addr}:{port} within distributed.timeout_minutes="
            f"{timeout_s / 60:g} ({first}); is MASTER_ADDR node 0's address and reachable from this node "
            "(docs/cluster.md), the port free, and every rank started?",
            report_rank=rank,
        ) from None


def _groups(
    rank: int, world: int, local_rank: int, device: torch.device, tensor_parallel: int, pipeline_parallel: int,
    expert_parallel: int,
) -> ParallelGroups:  # fmt: skip
    """ParallelGroups read from megatron's parallel_state once it is initialised."""
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    mp_group = ps.get_model_parallel_group()
    return ParallelGroups(
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        dp_group=ps.get_data_parallel_group(),
        mp_group=mp_group,
        embd_group=ps.get_embedding_group() if pipeline_parallel > 1 else None,
        world_group=dist.group.WORLD,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tensor_parallel,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pipeline_parallel,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=world // (tensor_parallel * pipeline_parallel),
        pp_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        mp_ranks=tuple(dist.get_process_group_ranks(mp_group)),
        device=device,
        ep_group=ps.get_expert_model_parallel_group() if expert_parallel > 1 else None,
        etp_group=ps.get_expert_tensor_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=expert_parallel,
    )


def destroy_distributed() -> None:
    """Tear down megatron parallel_state and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
