#!/usr/bin/env bash
# Make SGLang 0.5.23's model code importable on this CPU machine, for checks that use it as an oracle (its own
# models and weight loaders: tools/sglang_cpu/sglang_loader_check.py). SGLang itself is installed by
# tools/setup/install.sh (source only, --no-deps); what its model modules import beyond the project's environment
# goes --no-deps into a separate folder (tools/sglang_cpu/requirements.txt), so nothing of the project's own
# environment (torch, transformers) is touched. Two imports that cannot be satisfied on CPU (torchvision for this
# torch, vLLM's rotary kernel) come from import-only stubs (tools/sglang_cpu/stubs). Use:
#     PYTHONPATH=$SGLANG_CPU_PATH:tools/sglang_cpu/stubs python ...
# Usage: bash tools/sglang_cpu/setup_sglang_cpu.sh     # into $SGLANG_CPU_PATH (default .cache/sglang_cpu)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
TARGET="${SGLANG_CPU_PATH:-$REPO/.cache/sglang_cpu}"
python -m pip install --disable-pip-version-check -q --no-deps --upgrade --target "$TARGET" \
  -r "$REPO/tools/sglang_cpu/requirements.txt"
# --target brings no torch: check that SGLang's model code now imports against the project's torch.
PYTHONPATH="$TARGET:$REPO/tools/sglang_cpu/stubs" python - <<'PY'
import torch
import sglang.srt.models.qwen2  # noqa: F401
import sglang.srt.layers.quantization.fp8  # noqa: F401  (its FusedMoE import needs einops)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"sglang model code importable on torch {torch.__version__}")
PY
