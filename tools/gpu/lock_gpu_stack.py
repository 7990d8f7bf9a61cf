"""Pin the GPU stack (requirements/gpu.in) into requirements/gpu.lock and check that the lock resolves.

The target is a cluster image, not this machine: CPython 3.12 on linux x86_64 (glibc up to 2.39, Ubuntu 24.04, the
base of tools/gpu/Dockerfile). pip's own resolver decides, run as

    pip install --dry-run --ignore-installed --report R --target T --python-version 3.12 --implementation cp
        --only-binary=:all: --platform manylinux_2_39_x86_64 ... --platform linux_x86_64 --use-feature=fast-deps

so nothing is installed and, where the index allows HTTP range requests (PyPI does), only the metadata of each wheel
is read, not its payload (pip falls back to a whole download for some small wheels). `--isolated` keeps this
machine's pip configuration (local wheel folders, the torch cap) out of the answer.

    python tools/gpu/lock_gpu_stack.py                     # resolve gpu.in, write gpu.lock
    python tools/gpu/lock_gpu_stack.py --check             # resolve gpu.lock itself: the set must resolve as it is
    python tools/gpu/lock_gpu_stack.py --compare-installed # this interpreter's versions vs the lock (device_check.sh)

`--check` fails (exit 1, one line) when the lock does not resolve, when the resolver would add or change a package
(the lock is incomplete or inconsistent) or when a pin of gpu.in is not what the lock holds (gpu.in was edited and
the lock not rewritten). It needs PyPI; ~2-3 minutes, mostly waiting on the network.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from megatron_dapo.dev import REPO_ROOT

GPU_IN = REPO_ROOT / "requirements" / "gpu.in"
GPU_LOCK = REPO_ROOT / "requirements" / "gpu.lock"
PYTHON_VERSION = "3.12"
MAX_GLIBC_MINOR = 39  # Ubuntu 24.04 (tools/gpu/Dockerfile's base)
RESOLVE_TIMEOUT_S = 1200


def platform_tags(max_glibc_minor: int = MAX_GLIBC_MINOR) -> list[str]:
    """Every linux x86_64 wheel tag a glibc-2.<max> system takes: pip's --platform does not expand manylinux ranges
    (a torch 2.14.1 dependency ships manylinux_2_18 wheels only)."""
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(max_glibc_minor, 4, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def read_requirements(path: Path) -> list[Requirement]:
    """The requirement lines of a requirements file (comments and blank lines skipped); a bad line is named."""
    requirements = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            requirements.append(Requirement(line))
        except ValueError as err:
            raise SystemExit(f"error: {path}:{number}: not a requirement: {line!r} ({err})") from None
    return requirements


def resolve(requirements_file: Path) -> dict[str, str]:
    """pip's resolution of a requirements file for the target platform: {canonical name: version}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--dry-run",
               "--ignore-installed", "--quiet", "--report", str(report), "--target", str(Path(tmp) / "target"),
               "--python-version", PYTHON_VERSION, "--implementation", "cp", "--only-binary=:all:",
               "--use-feature=fast-deps", "-r", str(requirements_file)]  # fmt: skip
        for tag in platform_tags():
            cmd += ["--platform", tag]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)
        if proc.returncode != 0:
            errors = [x for x in proc.stderr.splitlines() if x.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
            raise SystemExit(f"error: {requirements_file.name} does not resolve for CPython {PYTHON_VERSION} linux "
                             f"x86_64: {' | '.join(errors)}")  # fmt: skip
        installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(x["metadata"]["name"]): x["metadata"]["version"] for x in installs}


def read_lock(path: Path = GPU_LOCK) -> dict[str, str]:
    """{canonical name: version} of a lock file (every line `name==version`)."""
    pins = {}
    for req in read_requirements(path):
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            raise SystemExit(f"error: {path}: {req} is not pinned with ==")
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def write_lock(resolved: dict[str, str], path: Path = GPU_LOCK) -> None:
    header = [
        f"# The resolved GPU stack: CPython {PYTHON_VERSION}, linux x86_64 (glibc <= 2.{MAX_GLIBC_MINOR}), CUDA 13.",
        f"# Written by `python tools/gpu/lock_gpu_stack.py` from {GPU_IN.name}; do not edit by hand.",
        "# Installed with `pip install --no-deps -r requirements/gpu.lock` (tools/gpu/Dockerfile).",
    ]
    path.write_text("\n".join(header + [f"{name}=={version}" for name, version in sorted(resolved.items())]) + "\n")


def mismatches(top_level: list[Requirement], lock: dict[str, str]) -> list[str]:
    """gpu.in's pins that the lock does not satisfy (absent, or a version outside the pin)."""
    problems = []
    for req in top_level:
        name = canonicalize_name(req.name)
        if name not in lock:
            problems.append(f"{req.name} is not in the lock")
        elif not req.specifier.contains(lock[name], prereleases=True):
            problems.append(f"{req.name}: the lock has {lock[name]}, gpu.in asks {req.specifier}")
    return problems


def check() -> str:
    """Resolve the lock as it is; return the one-line verdict or raise SystemExit with it."""
    lock = read_lock()
    problems = mismatches(read_requirements(GPU_IN), lock)
    if problems:
        raise SystemExit(f"error: {GPU_LOCK.name} is stale against {GPU_IN.name}: {'; '.join(problems)} "
                         "(rerun python tools/gpu/lock_gpu_stack.py)")  # fmt: skip
    resolved = resolve(GPU_LOCK)
    added = sorted(set(resolved) - set(lock))
    changed = sorted(n for n in set(resolved) & set(lock) if resolved[n] != lock[n])
    unused = sorted(set(lock) - set(resolved))
    if added or changed or unused:
        raise SystemExit(f"error: {GPU_LOCK.name} is not a closed set: the resolver adds {added}, changes {changed}, "
                         f"drops {unused}")  # fmt: skip
    return f"{GPU_LOCK.name}: {len(lock)} pins resolve for CPython {PYTHON_VERSION} linux x86_64"


def compare_installed() -> int:
    """Print gpu.in's packages as this interpreter has them beside the lock's versions; 1 when any differs."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    lock, differ = read_lock(), 0
    print(f"{'package':28} {'pinned':14} installed")
    for req in read_requirements(GPU_IN):
        name = canonicalize_name(req.name)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            have = "-"
        pinned = lock.get(name, "-")
        differ |= have.split("+")[0] != pinned
        print(f"{req.name:28} {pinned:14} {have}{'' if have.split('+')[0] == pinned else '   (differs)'}")
    return int(differ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="resolve gpu.lock as it is (CI)")
    mode.add_argument("--compare-installed", action="store_true", help="this interpreter's versions vs the lock")
    args = parser.parse_args(argv)
    if args.compare_installed:
        return compare_installed()
    if args.check:
        print(check())
        return 0
    resolved = resolve(GPU_IN)
    write_lock(resolved)
    print(f"wrote {GPU_LOCK} ({len(resolved)} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
