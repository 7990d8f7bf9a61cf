"""Build the CUDA C++ twins (csrc/*.cu) into one shared library loaded by megatron_dapo/ops/_cuda_twins.py.

The library has a plain C ABI (raw pointers, sizes, cudaStream_t), so it needs nvcc only: no torch headers and no
CUDA build of torch at build time.

Two entry points:
- `python csrc/build.py --out DIR [--arch 90 --arch 100]` writes DIR/libmegatron_dapo_cuda.so; point
  MEGATRON_DAPO_CUDA_LIB at it.
- `MEGATRON_DAPO_BUILD_CUDA=1 pip install -e .`: setup.py calls `cuda_extension()`, whose build_ext compiles the
  same sources into megatron_dapo/ops/_megatron_dapo_cuda*.so, where the loader finds it without any variable.

Target architectures: --arch, else env MEGATRON_DAPO_CUDA_ARCHS ("80;90"), else 90. Each gets SASS plus PTX of the
highest one for forward compatibility.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent
SOURCES = ("logprob_entropy.cu", "pg_loss.cu")
LIB_NAME = "libmegatron_dapo_cuda.so"
EXT_NAME = "megatron_dapo.ops._megatron_dapo_cuda"
EXPORTED_SYMBOLS = (
    "mdapo_logprob_entropy_fwd",
    "mdapo_logprob_entropy_bwd",
    "mdapo_pg_loss_workspace_rows",
    "mdapo_pg_loss_fwd",
    "mdapo_pg_loss_bwd",
    "mdapo_seq_log_ratio",
    "mdapo_error_string",
    "mdapo_abi_version",
)
DEFAULT_ARCHS = ("90",)


def find_nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin/nvcc, else the one on PATH, else None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def parse_archs(archs: list[str] | tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Compute capabilities as strings like "90" (accepts "9.0", "sm_90", "90")."""
    if not archs:
        env = os.environ.get("MEGATRON_DAPO_CUDA_ARCHS", "")
        archs = [a for a in env.replace(",", ";").split(";") if a.strip()] or list(DEFAULT_ARCHS)
    out = []
    for a in archs:
        a = a.strip().lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not a.isdigit():
            raise ValueError(f"csrc/build.py: bad CUDA arch {a!r}; use e.g. 90 or 9.0")
        out.append(a)
    return tuple(dict.fromkeys(out))


def nvcc_command(
    nvcc: str, sources: list[Path], output: Path, archs: tuple[str, ...], mode: str = "shared"
) -> list[str]:
    """The nvcc command line. mode "shared" links a .so; "object" compiles one source with -c."""
    cmd = [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-I", str(CSRC_DIR)]
    for a in archs:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    if mode == "shared":
        cmd += ["-shared", "-o", str(output), *map(str, sources)]
    elif mode == "object":
        cmd += ["-c", "-o", str(output), *map(str, sources)]
    else:
        raise ValueError(f"csrc/build.py: unknown mode {mode!r}")
    return cmd


def build_library(output: Path, archs: list[str] | tuple[str, ...] | None = None, verbose: bool = False) -> Path:
    """Compile csrc/*.cu into the shared library `output`; raises RuntimeError with nvcc's stderr on failure."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("csrc/build.py: nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    cmd = nvcc_command(nvcc, [CSRC_DIR / s for s in SOURCES], output, parse_archs(archs))
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"csrc/build.py: nvcc failed ({proc.returncode}):\n{proc.stderr}")
    return output


def cuda_extension():
    """(ext_modules, cmdclass) for setup.py: one pseudo-extension whose build_ext runs nvcc, not the C compiler."""
    from setuptools import Extension
    from setuptools.command.build_ext import build_ext

    class NvccBuildExt(build_ext):
        def build_extension(self, ext):
            if ext.name != EXT_NAME:
                return super().build_extension(ext)
            build_library(Path(self.get_ext_fullpath(ext.name)), verbose=True)
            return None

    sources = [str(Path("csrc") / s) for s in SOURCES]
    return [Extension(EXT_NAME, sources=sources)], {"build_ext": NvccBuildExt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory for " + LIB_NAME)
    parser.add_argument("--arch", action="append", help="compute capability, repeatable (default 90)")
    args = parser.parse_args(argv)
    path = build_library(Path(args.out) / LIB_NAME, args.arch, verbose=True)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
