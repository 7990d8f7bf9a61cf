"""Create the tiny random model and one-digit-sum data that examples/tiny_cpu.yaml trains on.

python tools/data/make_tiny_run.py --out runs/tiny
"""

from __future__ import annotations

import argparse

from megatron_dapo.dev.tiny import make_tiny_run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for key, path in make_tiny_run(args.out, seed=args.seed).items():
        print(f"{key}: {path}")
