"""Generate DAPO-format train/test files from a reasoning-gym task.

Example:
    python tools/data/make_dataset.py --task basic_arithmetic --num-train 2000 --num-test 200 --seed 0 \
        --template dapo --out data/arith --format jsonl --task-kwargs '{"max_terms": 2}'

Writes <out>/train.<fmt>, <out>/test.<fmt> and <out>/manifest.json. The logic lives in megatron_dapo.data.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_dapo.data.files import FORMATS
from megatron_dapo.data.generate import make_dataset
from megatron_dapo.data.reasoning_gym_tasks import SUPPORTED_TASKS
from megatron_dapo.data.reasoning_gym_tasks import task_config_fields
from megatron_dapo.data.templates import TEMPLATES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=SUPPORTED_TASKS)
    p.add_argument("--num-train", type=int)
    p.add_argument("--num-test", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--template", default="dapo", choices=sorted(TEMPLATES))
    p.add_argument("--num-shots", type=int, default=None, help="worked examples for few-shot templates")
    p.add_argument("--out", help="output directory")
    p.add_argument("--format", default="jsonl", choices=[*FORMATS, "both"])
    p.add_argument("--task-kwargs", default="{}", help="JSON dict of reasoning-gym config fields")
    p.add_argument("--list-task-kwargs", action="store_true", help="print the task's kwargs and defaults, exit")
    args = p.parse_args(argv)
    if not args.list_task_kwargs:
        missing = [f"--{k.replace('_', '-')}" for k in ("num_train", "num_test", "out") if getattr(args, k) is None]
        if missing:
            p.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_task_kwargs:
        print(json.dumps(task_config_fields(args.task), default=list, indent=2))
        return 0
    try:
        task_kwargs = json.loads(args.task_kwargs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--task-kwargs is not valid JSON: {e}") from None
    if not isinstance(task_kwargs, dict):
        raise SystemExit("--task-kwargs must be a JSON object")
    formats = list(FORMATS) if args.format == "both" else [args.format]
    try:
        paths = make_dataset(
            args.task,
            num_train=args.num_train,
            num_test=args.num_test,
            out_dir=args.out,
            seed=args.seed,
            template=args.template,
            formats=formats,
            task_kwargs=task_kwargs,
            num_shots=args.num_shots,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    for split in ("train", "test", "manifest"):
        for path in paths[split]:
            print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
