"""`megatron-dapo` (or `python -m megatron_dapo.cli`): train, eval, plot, convert.

megatron-dapo train --config examples/tiny_cpu.yaml [--section.field=value ...]     (under torchrun or srun)
megatron-dapo launch --nproc-per-node N --config X.yaml [...]                      (checks once, then torchrun)
megatron-dapo check --config X.yaml [--world-size N] [...]                         (start-up checks only)
megatron-dapo eval --config X.yaml [--model HF_DIR] [--section.field=value ...]     (one process, engine only)
megatron-dapo plot RUN_DIR
megatron-dapo convert --config X.yaml --to megatron --out DIR                     (HF actor.model_path -> dist ckpt)
megatron-dapo convert --config X.yaml --to hf --checkpoint DIR --out DIR          (dist ckpt -> HF safetensors)
megatron-dapo plan --config X.yaml --nodes N [--gpus-per-node 8] [--gpu-memory-gb 80] [--assume NAME=VALUE ...]
                                     (per-GPU memory by phase and step time; exit 2 when a phase does not fit)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_dapo.config import ConfigError
from megatron_dapo.config import load_config
from megatron_dapo.errors import JobError
from megatron_dapo.errors import rank_notice
from megatron_dapo.launch import NO_SHARED_STORE
from megatron_dapo.launch import StartupError
from megatron_dapo.launch import exit_with_launcher
from megatron_dapo.launch import preflight
from megatron_dapo.launch_env import launch_rank_world

if TYPE_CHECKING:
    from megatron_dapo.engine_rank import EngineRank
    from megatron_dapo.trainer import DAPOTrainer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo", description="DAPO on Megatron-Core")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run DAPO training")
    train.add_argument("--config", required=True)
    ev = sub.add_parser("eval", help="avg@k / pass@k / cons@k of a HF checkpoint on data.eval_files")
    ev.add_argument("--config", required=True)
    ev.add_argument("--model", default=None, help="HF checkpoint directory (default: actor.model_path)")
    launch = sub.add_parser("launch", help="start-up checks once, then torchrun with the preemption grace period")
    launch.add_argument("--config", required=True)
    launch.add_argument("--nproc-per-node", type=int, required=True)
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--rdzv-endpoint", default=None, help="host:port of node 0 (needed when --nnodes > 1)")
    launch.add_argument("--module", default="megatron_dapo.cli", help="workers run `python -m MODULE train ...`")
    check = sub.add_parser("check", help="the start-up checks of train, without starting anything")
    check.add_argument("--config", required=True)
    check.add_argument("--world-size", type=int, default=None, help="processes the job will run (default: env)")
    status = sub.add_parser(
        "status", help=f"exit 0 when the run has saved trainer.total_steps, {EXIT_RESUMABLE} when it can resume"
    )
    status.add_argument("--config", required=True)
    status.add_argument(
        "--requeue", action="store_true", help="when resumable inside a Slurm job, `scontrol requeue` it (sbatch files)"
    )
    get = sub.add_parser("get", help="print one field of the config (section.field), after overrides (sbatch files)")
    get.add_argument("--config", required=True)
    get.add_argument("field")
    plot = sub.add_parser("plot", help="draw PNG curves of a run")
    plot.add_argument("run_dir")
    conv = sub.add_parser("convert", help="HF <-> Megatron dist checkpoint")
    conv.add_argument("--config", required=True)
    conv.add_argument("--to", choices=("megatron", "hf"), required=True)
    conv.add_argument("--checkpoint", default=None, help="actor checkpoint dir (for --to hf)")
    conv.add_argument("--out", required=True)
    plan = sub.add_parser("plan", help="pre-flight check: per-GPU peak memory by phase and a step-time model")
    plan.add_argument("--config", required=True)
    plan.add_argument("--nodes", type=int, required=True)
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU in GiB (H100 80GB: 79.6)")
    plan.add_argument(
        "--assume", action="append", default=[], metavar="NAME=VALUE", help="override a planner assumption"
    )
    plan.add_argument(
        "--lead-time", action="store_true", help="print only the preemption lead time in whole seconds (job.sh)"
    )
    return parser


EXIT_RESUMABLE = 3
"""`megatron-dapo status`: the run has not saved its last step; resuming continues it (the sbatch files requeue)."""


def run_status(config, requeue: bool = False) -> int:
    """One line on the checkpoint a resume would start from; 0 when it is at trainer.total_steps, else EXIT_RESUMABLE.

    The checkpoint is chosen as train chooses it (CheckpointManager.find_resumable: the newest that verifies, with the
    same manifest and checkpoint.allow_unverified rules), its tensor files hashed whole since status loads nothing (a
    read of the newest checkpoint). Its pickles are not checked (that needs torch, which status does not import):
    a checkpoint holding a pickle that would run code was written by someone, and train refuses it with its own
    one-line error (exit 2) instead of falling back, so it decides nothing here. No usable checkpoint where some
    exist: one line, exit 2.
    requeue: when resumable and SLURM_JOB_ID is set, requeue the job (`scontrol requeue`; checkpoint.resume=auto then
    resumes it). The sbatch files call this after a time-limit or preemption signal and a clean exit: Slurm's own
    --requeue covers node failure and preemption, not the time limit."""
    from megatron_dapo.checkpoint import CheckpointError
    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.checkpoint import checkpoint_root
    from megatron_dapo.checkpoint import step_of

    total = config.trainer.total_steps
    chooser = CheckpointManager(
        checkpoint_root(config.trainer.run_dir), 0, log=rank_notice,
        allow_unverified=config.checkpoint.allow_unverified, deep=True,
    )  # fmt: skip
    try:
        newest = chooser.find_resumable()
    except CheckpointError as err:
        print(f"error: {str(err).splitlines()[0]}")
        return 2
    step = step_of(newest) if newest is not None else 0
    where = newest if newest is not None else f"no checkpoint under {config.trainer.run_dir}"
    if step >= total:
        print(f"finished: step {step} of {total} ({where})")
        return 0
    print(f"resumable: step {step} of {total} ({where})")
    job = os.environ.get("SLURM_JOB_ID")
    if requeue and job:
        try:
            proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        except OSError as err:  # no scontrol on PATH
            print(f"error: scontrol requeue {job}: {err.strerror or err}")
            return 1
        if proc.returncode != 0:
            print(f"error: scontrol requeue {job} failed ({proc.returncode}): {proc.stderr.strip()[:300]}")
            return 1
        print(f"requeued: Slurm job {job} (resumes from step {step})")
    return EXIT_RESUMABLE


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done (also after a preemption save), 2 a user error (one `error:` line, printed by rank 0), 1 a
    failure a restart may get past (a traceback, or one `error:` line for a stalled or dead peer); `status`: 0
    finished, EXIT_RESUMABLE not yet; `get`: 2 for a field the config does not have."""
    args, overrides = _parser().parse_known_args(argv)
    rank, world = launch_rank_world()
    try:
        if args.command == "plot":
            from megatron_dapo.metrics import plot_run

            for path in plot_run(args.run_dir):
                print(path)
            return 0
        config = load_config(args.config, overrides)
        if args.command == "launch":
            world = args.nproc_per_node * args.nnodes
        elif args.command == "check" and args.world_size is not None:
            world = args.world_size
        if args.command in ("train", "launch", "check"):
            preflight(config, world)
    except (ConfigError, StartupError, ValueError, FileNotFoundError) as err:
        return _user_error(err, rank)
    if args.command == "status":
        return run_status(config, requeue=args.requeue)
    if args.command == "get":
        section, _, field = args.field.partition(".")
        part = getattr(config, section, None) if section in type(config).__dataclass_fields__ else None
        if part is None or field not in getattr(type(part), "__dataclass_fields__", {}):
            return _user_error(ValueError(f"get: the config has no field {args.field!r}"), rank)
        print(getattr(part, field))
        return 0
    if args.command == "plan":
        return run_plan(config, args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.assume, args.lead_time)
    if args.command == "check":
        a = config.actor
        print(f"ok: {world} processes = TP {a.tensor_parallel} x PP {a.pipeline_parallel} x DP "
              f"{world // (a.tensor_parallel * a.pipeline_parallel)}")  # fmt: skip
    elif args.command == "launch":
        return launch(args, overrides, config)
    elif args.command == "train":
        if (code := plan_preflight(config)) != 0:
            return code
        return train(config, rank)
    elif args.command == "eval":
        try:
            print(json.dumps(run_eval(config, args.model), indent=1))
        except (ValueError, OSError) as err:  # a prompt that does not fit, a missing file: one line
            return _user_error(err, rank)
    elif args.command == "convert":
        from megatron_dapo.checkpoint import CheckpointError

        try:
            convert(config, args.to, args.checkpoint, args.out)
        except CheckpointError as err:  # no checkpoint, or one that does not verify: one line
            return _user_error(err, rank)
    return 0


def run_plan(
    config, nodes: int, gpus_per_node: int, gpu_memory_gb: float, assume: list[str], lead_time: bool = False
) -> int:
    """Print the plan of `config` on the layout; 0 when every phase fits, 2 otherwise (or on a bad layout).
    lead_time: print only the preemption lead time in whole seconds (rounded up), exit 0 unless the layout is bad."""
    from megatron_dapo.plan import PlanError
    from megatron_dapo.plan import make_plan
    from megatron_dapo.plan import parse_assumptions

    try:
        plan = make_plan(
            config,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu_memory_gb=gpu_memory_gb,
            assumptions=parse_assumptions(assume),
        )
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if lead_time:
        print(math.ceil(plan.preempt_lead_s))
        return 0
    print(plan.report())
    return plan.exit_code


def plan_preflight(config) -> int:
    """`train`'s memory check on CUDA (skipped by trainer.preflight=false): plan the run on this job's layout
    (WORLD_SIZE / LOCAL_WORLD_SIZE under torchrun, SLURM_NTASKS / SLURM_NNODES under srun; the GPU's memory). Every
    rank gets the same answer; rank 0 prints the plan when a phase does not fit and every rank returns 2."""
    import torch

    if not config.trainer.preflight or not torch.cuda.is_available():
        return 0
    from megatron_dapo.launch_env import ranks_per_node
    from megatron_dapo.plan import GiB
    from megatron_dapo.plan import PlanError
    from megatron_dapo.plan import make_plan

    rank, world = launch_rank_world()
    per_node = ranks_per_node(world) or min(world, torch.cuda.device_count())
    memory = torch.cuda.get_device_properties(0).total_memory / GiB
    try:
        plan = make_plan(config, nodes=max(1, world // per_node), gpus_per_node=per_node, gpu_memory_gb=memory)
    except PlanError as err:
        print(f"preflight: cannot plan this run ({err}); set --trainer.preflight=false to skip", file=sys.stderr)
        return 0
    if plan.exit_code and rank == 0:
        print(plan.report(), file=sys.stderr)
        print("preflight: a phase does not fit or outlasts its timeout (see above); set --trainer.preflight=false to "
              "skip", file=sys.stderr)  # fmt: skip
    return plan.exit_code


def _user_error(err: BaseException, rank: int, report_rank: int = 0) -> int:
    """Print `error: ...` on `report_rank` (rank 0 unless that one cannot); the other ranks (which found the same
    error) exit a moment later, so that a launcher stopping the job at the first exit cannot cut the line off."""
    if rank == report_rank:
        print(f"error: {err}", file=sys.stderr, flush=True)
    else:
        import time

        time.sleep(3.0)
    return 2


def _build_program(config) -> DAPOTrainer | EngineRank:
    """This rank's program: the trainer, or on an engine rank of a split launch (rollout.engine_ranks > 0) an
    EngineRank (engine_rank.py), a program of its own. Both have fit() and step."""
    from megatron_dapo.trainer import DAPOTrainer

    if not config.rollout.engine_ranks:
        return DAPOTrainer(config)
    from megatron_dapo.placement import init_role

    placement, store = init_role(config.rollout.engine_ranks, config.distributed.timeout_s)
    if placement.is_engine:
        from megatron_dapo.engine_rank import EngineRank

        return EngineRank.launch(config, placement, store)
    return DAPOTrainer(config, placement, store)


def train(config, rank: int) -> int:
    """One attempt of the job (megatron_dapo/restarts.py): after a failed attempt, rank 0 says why and the job
    resumes from its last verified checkpoint, unless the failure was an error a restart repeats (exit 2 at once). An
    exception is recorded for the next attempt, then raised as before (traceback, exit 1)."""
    from megatron_dapo import restarts
    from megatron_dapo.actor.cpu_compat import import_megatron_core

    import_megatron_core()  # first, so that on CPU megatron's fusions are not torch.compile'd (seconds per rank)
    from megatron_dapo.actor.ckpt_writer import install_writer_queue

    install_writer_queue()  # forked now, before any socket, lock or thread exists (actor/ckpt_writer.py)
    run_dir, attempt = config.trainer.run_dir, restarts.attempt_number()
    if attempt > 0:
        previous = restarts.previous_attempt(run_dir, attempt, config.distributed.max_restarts)
        if rank == 0 and previous.line:
            rank_notice(previous.line)
        if not previous.retry:
            restarts.carry_refusal(run_dir, attempt, rank, previous)
            return 2
    if rank == 0:
        restarts.record_start(run_dir, attempt, launch_rank_world()[1])
    exit_with_launcher(config.checkpoint.preempt_grace_s)
    trainer = None
    try:
        trainer = _build_program(config)
        trainer.fit()
    except (StartupError, JobError) as err:  # one line; a JobError is found while training (sampling bound, peer)
        restarts.record_failure(run_dir, attempt, rank, trainer and trainer.step, err, restarts.is_retryable(err))
        if trainer is None:
            _destroy_process_group()
        code = _user_error(err, rank, report_rank=err.report_rank)
        return 1 if restarts.is_retryable(err) else code
    except Exception as err:
        restarts.record_failure(run_dir, attempt, rank, trainer and trainer.step, err, restarts.is_retryable(err))
        raise
    return 0


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def launch(args: argparse.Namespace, overrides: list[str], config) -> int:
    """torchrun in this process, with checkpoint.preempt_grace_s as its SIGTERM -> SIGKILL window and SIGUSR1/2
    forwarded to the workers (Slurm's --signal); returns 0, the workers' exit code, or 128 + a signal's number."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run

    grace = int(math.ceil(config.checkpoint.preempt_grace_s))
    torchrun = [
        f"--nproc-per-node={args.nproc_per_node}",
        f"--shutdown-timeout={grace}",
        f"--max-restarts={config.distributed.max_restarts}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
    ]
    if args.nnodes == 1:
        torchrun.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            return _user_error(StartupError("launch --nnodes > 1 needs --rdzv-endpoint HOST:PORT"), 0)
        wait = int(math.ceil(config.distributed.timeout_s))  # how long the nodes wait for each other at start
        torchrun += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={args.rdzv_endpoint}",
                     f"--rdzv-conf=join_timeout={wait},read_timeout={wait}"]  # fmt: skip
    torchrun += ["-m", args.module, "train", "--config", args.config, *overrides]
    os.environ[NO_SHARED_STORE] = "1"  # each restarted attempt gets a fresh store (megatron_dapo/launch.py)
    try:
        run(get_args_parser().parse_args(torchrun))
    except RendezvousError as err:  # node 0 dead or unreachable, or a node that never started
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: launch node {args.node_rank} of {args.nnodes}: no rendezvous at {args.rdzv_endpoint} within "
              f"distributed.timeout_minutes={config.distributed.timeout_minutes:g} ({detail}); is the endpoint node "
              "0's address and reachable from this node (docs/cluster.md), and did every node start?",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    except SignalException as sig:
        print(f"megatron-dapo launch: {sig.sigval.name}: workers had checkpoint.preempt_grace_s={grace} s to save "
              f"and exit", file=sys.stderr, flush=True)  # fmt: skip
        return 128 + int(sig.sigval)
    except ChildFailedError as failed:
        if user_error_exit(f.exitcode for f in failed.failures.values()):
            return 2  # a user error, printed once by the lowest live rank (torchrun then stopped the other ranks)
        ranks = ", ".join(f"rank {r}: exit code {f.exitcode}" for r, f in sorted(failed.failures.items()))
        print(f"error: workers failed ({ranks}); their output is above", file=sys.stderr, flush=True)
        return 1
    return 0


def user_error_exit(exit_codes: Iterable[int]) -> bool:
    """The workers ended on a user error (the job's exit 2): some rank exited 2 and every other failed rank was
    stopped by torchrun's SIGTERM after it. Which rank exits first is a race: rank 0 may be the one stopped (was:
    only rank 0's exit 2 counted, so the same error ended the launcher with 1 about half the time)."""
    codes = list(exit_codes)
    return 2 in codes and all(code in (2, -signal.SIGTERM) for code in codes)


def run_eval(config, model_dir: str | None) -> dict[str, float]:
    """Evaluate a HF checkpoint with the rollout engine alone (no actor, one process): the model verified first
    (checkpoint.verified_hf_model: an export of this package against its manifest), the prompts read with the
    trainer's checks (inputs.prompt_settings), sampled and scored by the trainer's evaluation driver."""
    from transformers import AutoConfig
    from transformers import AutoTokenizer

    from megatron_dapo.checkpoint import verified_hf_model
    from megatron_dapo.data import PromptDataset
    from megatron_dapo.data.dataset import prompt_token_ids
    from megatron_dapo.envs.base import environment_for_run
    from megatron_dapo.envs.base import prompt_record
    from megatron_dapo.evaluate import evaluate
    from megatron_dapo.inputs import prompt_settings
    from megatron_dapo.reward import Verifier
    from megatron_dapo.rollout import make_engine
    from megatron_dapo.rollout.factory import sampling_params

    model_dir = str(verified_hf_model(model_dir or config.actor.model_path, log=rank_notice))
    t = config.trainer
    tok = AutoTokenizer.from_pretrained(model_dir)
    settings = prompt_settings(
        config, tok, AutoConfig.from_pretrained(model_dir), lambda line: print(line, file=sys.stderr)
    )
    examples = PromptDataset(config.data.eval_files, **settings).examples[: t.eval_max_prompts or None]
    engine = make_engine(config.rollout, model_dir, seed=t.seed)
    prompts = [prompt_token_ids(tok, ex.prompt_messages) for ex in examples]
    params = sampling_params(
        config.rollout, t.eval_samples, seed=t.seed, stop_token_ids=[tok.eos_token_id], temperature=t.eval_temperature,
        top_p=t.eval_top_p, return_logprobs=False,
    )  # fmt: skip
    truths = [ex.ground_truth for ex in examples]
    verifier = Verifier.from_config(config.reward)
    env = environment_for_run(config.reward, tokenizer=tok, verifier=verifier, max_tokens=params.max_new_tokens)
    records = [prompt_record(ex) for ex in examples]
    return evaluate(engine, prompts, truths, verifier, params, tokenizer=tok, environment=env, records=records)


def convert(config, to: str, checkpoint: str | None, out: str) -> None:
    """HF -> Megatron dist checkpoint (sealed: a MANIFEST.json and a COMPLETE marker, so it verifies like a run's), or
    back from one verified as a resume would (checkpoint.verified_actor_checkpoint: the manifest, the restricted
    unpicklers, each tensor item's hash as it loads), checked before any process group starts. Every rank of a
    torchrun job calls this."""
    from megatron_dapo.actor.checkpointing import check_checkpoint
    from megatron_dapo.checkpoint import CheckpointError
    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.checkpoint import verified_actor_checkpoint

    if to == "hf":  # verified before megatron is imported: a bad checkpoint is a one-line error in about a second
        if checkpoint is None:
            raise CheckpointError("convert --to hf needs --checkpoint DIR")
        rank0 = launch_rank_world()[0] == 0
        actor_dir, items = verified_actor_checkpoint(
            checkpoint, allow_unverified=config.checkpoint.allow_unverified,
            log=rank_notice if rank0 else None,
            check_pickles=check_checkpoint,
        )  # fmt: skip
    import torch.distributed as dist

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.distributed import init_distributed

    groups = init_distributed(
        config.actor.tensor_parallel,
        config.actor.pipeline_parallel,
        expert_parallel=config.actor.expert_parallel,
        timeout_s=config.distributed.timeout_s,
    )
    if to == "megatron":
        MegatronActor(config, groups, hf_dir=config.actor.model_path).save_checkpoint(out)
        sealer = CheckpointManager(
            Path(out).parent, 0, groups.rank, dist.barrier, world_size=groups.world_size,
            layout=MegatronActor.checkpoint_items,
        )  # fmt: skip
        sealer.seal(out)
        return
    actor = MegatronActor(config, groups)
    actor.load_checkpoint(str(actor_dir), load_optimizer=False, items=items)
    actor.save_hf(out, tokenizer=_tokenizer_or_none(config.actor.model_path))


def _tokenizer_or_none(model_path: str):
    """The tokenizer of actor.model_path for a converted checkpoint, or None when that folder has none (the export
    then holds weights and config only, as before)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
