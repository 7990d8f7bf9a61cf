"""Simulate DAPO's dynamic sampling on a synthetic policy and print prompts sampled per useful prompt per step.

python tools/experiments/simulate_dapo.py [--steps 12 --prompts 32 --group-size 16 --seed 0]
"""

from __future__ import annotations

import argparse

from megatron_dapo.dev.simulate import SimConfig
from megatron_dapo.dev.simulate import format_table
from megatron_dapo.dev.simulate import simulate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per training batch")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = SimConfig(
        steps=args.steps,
        prompts_per_step=args.prompts,
        gen_prompts_per_batch=args.prompts,
        group_size=args.group_size,
        seed=args.seed,
    )
    rows = simulate(cfg)
    print(format_table(rows))
    print(
        "\nper_useful = prompts sampled / prompts admitted (0 < group accuracy < 1). It is high both when the policy "
        "is weak (all-wrong groups) and strong (all-correct groups): the cost of dynamic sampling varies per step."
    )


if __name__ == "__main__":
    main()
