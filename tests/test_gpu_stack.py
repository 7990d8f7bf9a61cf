"""The GPU stack (requirements/gpu.in -> gpu.lock -> tools/gpu/Dockerfile): the lock resolves with pip's resolver for
CPython 3.12 on linux x86_64, it holds gpu.in's pins, and everything else that names a GPU-stack version takes it from
there (setup.py's extras, install.sh's SGLang source, the Dockerfile's TE build, the SGLang adapter's version list).
The image itself is not built here (no Docker daemon, no registry but PyPI)."""

import importlib.util
import re
import subprocess
import sys
from importlib.metadata import requires
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from megatron_dapo.dev import REPO_ROOT
from megatron_dapo.rollout.sglang_api import SGLANG_VERSIONS

LOCK_TOOL = REPO_ROOT / "tools" / "gpu" / "lock_gpu_stack.py"
_spec = importlib.util.spec_from_file_location("lock_gpu_stack", LOCK_TOOL)
stack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stack)

DOCKERFILE = (REPO_ROOT / "tools" / "gpu" / "Dockerfile").read_text()


def _gpu_in() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in stack.read_requirements(stack.GPU_IN)}


def _pinned(name: str) -> str:
    (spec,) = _gpu_in()[canonicalize_name(name)].specifier
    assert spec.operator == "==", f"gpu.in must pin {name} with =="
    return spec.version


@pytest.mark.early_subprocess([sys.executable, str(LOCK_TOOL), "--check"])
def test_the_lock_resolves_with_pip_for_python_3_12_linux_x86_64(early_subprocess):
    """pip's resolver, dry run with a report, target CPython 3.12 manylinux x86_64, wheels' metadata only: the lock
    resolves to itself (nothing added, changed or dropped) and holds gpu.in's pins."""
    code, out = early_subprocess
    assert code == 0, out[-3000:]
    assert re.search(r"gpu\.lock: \d+ pins resolve for CPython 3\.12 linux x86_64", out), out[-3000:]


def test_the_lock_holds_every_pin_of_gpu_in_and_the_package_requirements():
    lock = stack.read_lock()
    assert stack.mismatches(list(_gpu_in().values()), lock) == []
    for name, expected in {"torch": "2.14.1", "sglang": "0.5.23", "megatron-core": "0.16.1"}.items():
        assert lock[name] == expected  # the stack issue 22 names; a deliberate upgrade edits this line too
    ours = [Requirement(r) for r in requires("megatron_dapo") if "extra ==" not in r]
    for req in ours:
        name = canonicalize_name(req.name)
        assert name in lock, f"megatron_dapo requires {req.name}, which the GPU lock lacks"
        assert req.specifier.contains(lock[name], prereleases=True), f"{req} does not admit the lock's {lock[name]}"


def test_the_lock_check_names_what_is_stale():
    requirements = list(_gpu_in().values())
    lock = dict(stack.read_lock())
    lock["sglang"] = "0.5.15"
    del lock["megatron-core"]
    assert stack.mismatches(requirements, lock) == [
        "sglang: the lock has 0.5.15, gpu.in asks ==0.5.23",
        "megatron-core is not in the lock",
    ]


def test_platform_tags_cover_every_manylinux_of_the_image_glibc():
    """pip's --platform does not expand manylinux ranges: each glibc minor is listed, none newer than the image's."""
    tags = stack.platform_tags(39)
    assert {"manylinux_2_18_x86_64", "manylinux_2_28_x86_64", "manylinux_2_39_x86_64", "manylinux2014_x86_64"} <= set(
        tags
    )
    assert "manylinux_2_40_x86_64" not in tags and tags[-1] == "linux_x86_64"


def test_extras_and_the_sglang_source_take_their_pins_from_gpu_in():
    extras = {}
    for line in requires("megatron_dapo"):
        req = Requirement(line)
        extra = re.search(r'extra == "([^"]+)"', line)
        if extra:
            extras.setdefault(extra.group(1), []).append(req)
    assert [str(r.specifier) for r in extras["sglang"]] == [f"=={_pinned('sglang')}"]
    (te,) = extras["te"]
    assert str(te.specifier) == f"=={_pinned('transformer-engine')}" and {"pytorch", "core-cu13"} <= te.extras
    assert [str(r.specifier) for r in extras["modelopt"]] == [f"=={_pinned('nvidia-modelopt')}"]
    assert "apex" not in extras  # PyPI's apex is an unrelated project
    # install.sh installs SGLang's source at gpu.in's pin, and the adapter was checked against that version
    install_sh = (REPO_ROOT / "tools" / "setup" / "install.sh").read_text()
    assert "sglang==0" not in install_sh and "'^sglang==' requirements/gpu.in" in install_sh
    assert version("sglang") == _pinned("sglang") == SGLANG_VERSIONS[-1]


def test_the_dockerfile_installs_the_lock_and_builds_te_and_apex_against_it():
    lock = stack.read_lock()
    assert "pip install --no-deps -r requirements/gpu.lock && pip check" in DOCKERFILE
    # TE's PyTorch extension at the lock's TE version, read from the lock by this sed
    sed = re.search(r"sed -n 's/\^(transformer-engine)==//p' requirements/gpu.lock", DOCKERFILE)
    assert sed and lock[sed.group(1)] == _pinned("transformer-engine")
    assert 'pip install --no-build-isolation --no-deps "transformer_engine_torch==${TE_VERSION}"' in DOCKERFILE
    # apex from a pinned commit of NVIDIA/apex with both extension sets
    commit = re.search(r"^ARG APEX_COMMIT=([0-9a-f]+)$", DOCKERFILE, re.M)
    assert commit and len(commit.group(1)) == 40
    assert "APEX_CPP_EXT=1 APEX_CUDA_EXT=1" in DOCKERFILE and "NVIDIA/apex.git@${APEX_COMMIT}" in DOCKERFILE
    # the image's CUDA major and Python are the ones the lock was resolved for; Hopper is built
    image = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-devel-ubuntu(\d+)\.04$", DOCKERFILE, re.M)
    assert image and image.group(1) == lock["nvidia-cuda-runtime"].split(".")[0] == "13"
    assert image.group(2) == "24"  # Ubuntu 24.04: glibc 2.39 = stack.MAX_GLIBC_MINOR, python3.12
    assert stack.MAX_GLIBC_MINOR == 39 and f"python{stack.PYTHON_VERSION}" in DOCKERFILE
    assert re.search(r'^ARG TORCH_CUDA_ARCH_LIST="[^"]*9\.0', DOCKERFILE, re.M)
    assert "MEGATRON_DAPO_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e ." in DOCKERFILE


def test_compare_installed_reports_this_machine_against_the_lock():
    """This CPU machine has torch 2.13.0, not the lock's 2.14.1: the report says so and exits 1 (device_check.sh
    keeps it as a report)."""
    proc = subprocess.run([sys.executable, str(LOCK_TOOL), "--compare-installed"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    torch_line = next(x for x in proc.stdout.splitlines() if x.startswith("torch "))
    assert torch_line.split()[1:3] == ["2.14.1", version("torch")] and "(differs)" in torch_line
    sglang_line = next(x for x in proc.stdout.splitlines() if x.startswith("sglang "))
    assert "(differs)" not in sglang_line
