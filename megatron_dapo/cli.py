"""`megatron-dapo` (or `python -m megatron_dapo.cli`): train, eval, plot, convert.

megatron-dapo train --config examples/tiny_cpu.yaml [--section.field=value ...]     (under torchrun or srun)
megatron-dapo eval --config X.yaml [--model HF_DIR] [--section.field=value ...]     (one process, engine only)
megatron-dapo plot RUN_DIR
megatron-dapo convert --config X.yaml --to megatron --out DIR                     (HF actor.model_path -> dist ckpt)
megatron-dapo convert --config X.yaml --to hf --checkpoint DIR --out DIR          (dist ckpt -> HF safetensors)
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
    if args.command == "train":
        from megatron_dapo.trainer import DAPOTrainer  # noqa: PLC0415

        DAPOTrainer(config).fit()
    elif args.command == "eval":
        print(json.dumps(run_eval(config, args.model), indent=1))
    elif args.command == "convert":
        convert(config, args.to, args.checkpoint, args.out)
    return 0


def run_eval(config, model_dir: str | None) -> dict[str, float]:
    """Evaluate a HF checkpoint with the rollout engine alone (no actor, one process)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from megatron_dapo.data import PromptDataset  # noqa: PLC0415
    from megatron_dapo.data.dataset import prompt_token_ids  # noqa: PLC0415
    from megatron_dapo.evaluate import evaluate  # noqa: PLC0415
    from megatron_dapo.reward import Verifier  # noqa: PLC0415
    from megatron_dapo.rollout import make_engine  # noqa: PLC0415

    model_dir = model_dir or config.actor.model_path
    t = config.trainer
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = PromptDataset(config.data.eval_files).examples[: t.eval_max_prompts or None]
    engine = make_engine(config.rollout, model_dir, seed=t.seed)
    prompts = [prompt_token_ids(tok, ex.prompt_messages) for ex in examples]
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
