"""`megatron-dapo` (or `python -m megatron_dapo.cli`): train, eval, plot, convert.

megatron-dapo train --config examples/tiny_cpu.yaml [--section.field=value ...]     (under torchrun or srun)
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
import sys

from megatron_dapo.config import ConfigError
from megatron_dapo.config import load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dapo", description="DAPO on Megatron-Core")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run DAPO training")
    train.add_argument("--config", required=True)
    ev = sub.add_parser("eval", help="avg@k / pass@k / cons@k of a HF checkpoint on data.eval_files")
    ev.add_argument("--config", required=True)
    ev.add_argument("--model", default=None, help="HF checkpoint directory (default: actor.model_path)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        if args.command == "plot":
            from megatron_dapo.metrics import plot_run  # noqa: PLC0415

            for path in plot_run(args.run_dir):
                print(path)
            return 0
        config = load_config(args.config, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "plan":
        return run_plan(config, args.nodes, args.gpus_per_node, args.gpu_memory_gb, args.assume)
    if args.command == "train":
        if (code := preflight(config)) != 0:
            return code
        from megatron_dapo.trainer import DAPOTrainer  # noqa: PLC0415

        DAPOTrainer(config).fit()
    elif args.command == "eval":
        print(json.dumps(run_eval(config, args.model), indent=1))
    elif args.command == "convert":
        convert(config, args.to, args.checkpoint, args.out)
    return 0


def run_plan(config, nodes: int, gpus_per_node: int, gpu_memory_gb: float, assume: list[str]) -> int:
    """Print the plan of `config` on the layout; 0 when every phase fits, 2 otherwise (or on a bad layout)."""
    from megatron_dapo.plan import PlanError  # noqa: PLC0415
    from megatron_dapo.plan import make_plan  # noqa: PLC0415
    from megatron_dapo.plan import parse_assumptions  # noqa: PLC0415

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
    print(plan.report())
    return plan.exit_code


def preflight(config) -> int:
    """`train`'s start check on CUDA (skipped by trainer.preflight=false): plan the run on this job's layout
    (WORLD_SIZE / LOCAL_WORLD_SIZE under torchrun, SLURM_NTASKS / SLURM_NNODES under srun; the GPU's memory). Every
    rank gets the same answer; rank 0 prints the plan when a phase does not fit and every rank returns 2."""
    import os  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if not config.trainer.preflight or not torch.cuda.is_available():
        return 0
    from megatron_dapo.plan import GiB  # noqa: PLC0415
    from megatron_dapo.plan import PlanError  # noqa: PLC0415
    from megatron_dapo.plan import make_plan  # noqa: PLC0415

    env = os.environ
    world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
    nodes = int(env.get("SLURM_NNODES") or 0)
    per_node = int(env.get("LOCAL_WORLD_SIZE") or (world // nodes if nodes else min(world, torch.cuda.device_count())))
    memory = torch.cuda.get_device_properties(0).total_memory / GiB
    try:
        plan = make_plan(config, nodes=max(1, world // per_node), gpus_per_node=per_node, gpu_memory_gb=memory)
    except PlanError as err:
        print(f"preflight: cannot plan this run ({err}); set --trainer.preflight=false to skip", file=sys.stderr)
        return 0
    if plan.exit_code and (env.get("RANK") or env.get("SLURM_PROCID") or "0") == "0":
        print(plan.report(), file=sys.stderr)
        print("preflight: a phase does not fit (see above); set --trainer.preflight=false to skip", file=sys.stderr)
    return plan.exit_code


def run_eval(config, model_dir: str | None) -> dict[str, float]:
    """Evaluate a HF checkpoint with the rollout engine alone (no actor, one process)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from megatron_dapo.data import PromptDataset  # noqa: PLC0415
    from megatron_dapo.evaluate import evaluate  # noqa: PLC0415
    from megatron_dapo.reward import Verifier  # noqa: PLC0415
    from megatron_dapo.rollout import make_engine  # noqa: PLC0415

    model_dir = model_dir or config.actor.model_path
    t = config.trainer
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = PromptDataset(config.data.eval_files).examples[: t.eval_max_prompts or None]
    engine = make_engine(config.rollout, model_dir, seed=t.seed)
    prompts = []
    for ex in examples:
        ids = tok.apply_chat_template(ex.prompt_messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return evaluate(
        engine,
        prompts,
        [ex.ground_truth for ex in examples],
        Verifier.from_config(config.reward),
        k=t.eval_samples,
        temperature=t.eval_temperature,
        top_p=t.eval_top_p,
        max_new_tokens=config.rollout.max_response_length,
        stop_token_ids=[tok.eos_token_id],
        tokenizer=tok,
        seed=t.seed,
    )


def convert(config, to: str, checkpoint: str | None, out: str) -> None:
    """HF -> Megatron dist checkpoint, or back (every rank of a torchrun job calls this)."""
    from megatron_dapo.actor.actor import MegatronActor  # noqa: PLC0415
    from megatron_dapo.actor.distributed import init_distributed  # noqa: PLC0415

    groups = init_distributed(
        config.actor.tensor_parallel, config.actor.pipeline_parallel, timeout_s=config.distributed.timeout_s
    )
    if to == "megatron":
        MegatronActor(config, groups, hf_dir=config.actor.model_path).save_checkpoint(out)
        return
    if checkpoint is None:
        raise SystemExit("error: convert --to hf needs --checkpoint DIR")
    from pathlib import Path  # noqa: PLC0415

    from safetensors.torch import save_file  # noqa: PLC0415

    actor = MegatronActor(config, groups)
    actor.load_checkpoint(checkpoint, load_optimizer=False)
    tensors = {name: t.detach().cpu().contiguous() for name, t in actor.export_hf_weights()}
    if groups.rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
        actor.hf_config.save_pretrained(out)


if __name__ == "__main__":
    sys.exit(main())
