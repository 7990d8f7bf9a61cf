"""megatron_dapo: DAPO reinforcement learning on Megatron-Core.

Install torch first (``pip install torch==2.13.0`` on CPU machines, your cluster's CUDA build on GPU nodes):
the requirements below only name ranges that an installed torch already satisfies, so pip never replaces it.
"""

import os
import re

from setuptools import find_packages
from setuptools import setup


def _gpu_pins() -> dict[str, str]:
    """requirements/gpu.in's requirement lines by project name: the GPU stack's versions are written there once."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "requirements", "gpu.in")) as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return {re.split(r"[\[=<>!~; ]", line, maxsplit=1)[0].lower(): line for line in lines if line}


GPU_PINS = _gpu_pins()
TE_VERSION = GPU_PINS["transformer-engine"].split("==")[1]

INSTALL_REQUIRES = [
    "torch>=2.4",
    "numpy",
    "pyyaml",
    "safetensors",
    "transformers>=5",
    "triton>=3.2",
    "megatron-core>=0.13,<0.17",
    "psutil",  # megatron dist_checkpointing, undeclared by megatron-core
    "tqdm",
    "rich",
    "pyarrow",
]

EXTRAS = {
    "test": [
        "pytest>=8",
        "hypothesis>=6",
        "ruff",
        "reasoning-gym==0.1.25",
        "math-verify==0.9.0",
        "gguf",
        "accelerate",
        "tensorboard",
        "matplotlib",
        "trl==1.16.0",  # tests/test_side_by_side_tools.py runs the TRL arm of tools/experiments/compare_trl.py
    ],
    # SGLang has no CPU wheel; on GPU nodes install the pinned version (see docs/rollout.md). The GPU extras' pins
    # come from requirements/gpu.in; requirements/gpu.lock is the whole resolved stack.
    "sglang": [GPU_PINS["sglang"]],
    "vllm": ["vllm>=0.10"],
    # TE's PyTorch extension is source only: it compiles against the installed torch (tools/gpu/Dockerfile does the
    # same from the lock). No apex extra: the PyPI project named apex is another package (the Dockerfile builds it).
    "te": [f"transformer-engine[pytorch,core-cu13]=={TE_VERSION}"],
    "modelopt": [GPU_PINS["nvidia-modelopt"]],
    "data": ["reasoning-gym==0.1.25"],
    "smollm2": ["gguf", "accelerate"],
    # Comparison providers: Liger in tools/bench/logprob_kernels.py, TRL's GRPOTrainer in
    # tools/experiments/compare_trl.py (install torch first so pip keeps it).
    "bench": ["liger-kernel==0.8.5", "trl==1.16.0"],
}


def _ext_modules():
    """CUDA C++ twins of the fused ops, built only when MEGATRON_DAPO_BUILD_CUDA=1 (see csrc/README.md)."""
    if os.environ.get("MEGATRON_DAPO_BUILD_CUDA", "0") != "1":
        return [], {}
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # build_meta does not put the project on sys.path
    from csrc.build import cuda_extension

    return cuda_extension()


ext_modules, cmdclass = _ext_modules()

setup(
    name="megatron_dapo",
    version="0.1.0",
    description="DAPO (arXiv 2503.14476) on Megatron-Core with fused kernels and SGLang rollouts",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["megatron-dapo=megatron_dapo.cli:main"]},
)
