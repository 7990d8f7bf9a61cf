"""The launcher's environment, read in one module (megatron_dapo/launch_env.py): torchrun, srun, a single process."""

from megatron_dapo.launch_env import launch_env
from megatron_dapo.launch_env import launch_rank_world
from megatron_dapo.launch_env import local_rank
from megatron_dapo.launch_env import num_nodes
from megatron_dapo.launch_env import ranks_per_node

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
