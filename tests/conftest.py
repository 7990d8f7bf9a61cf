import os
import random
import subprocess
import tempfile
from typing import IO

# Triton switches to the interpreter when @triton.jit runs, so this must precede any kernel import.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch

from megatron_dapo.actor.cpu_compat import import_megatron_core

import_megatron_core()  # before any test imports it: on CPU, megatron's fusions are not torch.compile'd (~5 s)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny CPU job's model and data (megatron_dapo.dev.tiny) for the trainer's end-to-end tests (a module that
    needs other ones defines its own `tiny`)."""
    from megatron_dapo.dev.tiny import make_tiny_run

    return make_tiny_run(tmp_path_factory.mktemp("tiny"), num_train=48, num_test=8)


@pytest.fixture(scope="session")
def straight(tiny, tmp_path_factory):
    """4 DAPO steps straight under torchrun (TP=2, tests/test_trainer_e2e.py's `_train`): the oracle of the
    interrupted and offloaded runs (one run per session)."""
    from tests.test_trainer_e2e import _train

    run_dir = tmp_path_factory.mktemp("straight") / "run"
    _train(tiny, run_dir, "--trainer.total_steps=4", "--logging.plots=true")
    return run_dir


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    num_gpus = torch.cuda.device_count() if has_cuda else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)


# Tests marked early_subprocess(argv): the command starts when collection ends and runs beside the other tests, at the
# lowest CPU priority (pip's resolver in tests/test_gpu_stack.py: ~2 min on the network, but also ~95 s of CPU, which
# at normal priority slowed the suite's first minutes on a 2-core machine; niced, it takes the cores' idle moments);
# the test itself runs last and takes the finished process from the `early_subprocess` fixture.
_EARLY: dict[str, tuple[subprocess.Popen, IO[str]]] = {}


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    early = [item for item in session.items if item.get_closest_marker("early_subprocess")]
    for item in early:
        output = tempfile.TemporaryFile(mode="w+")
        argv = item.get_closest_marker("early_subprocess").args[0]
        proc = subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(19)
        )
        _EARLY[item.nodeid] = proc, output
    session.items[:] = [item for item in session.items if item not in early] + early


def pytest_sessionfinish(session, exitstatus):
    for proc, output in _EARLY.values():
        if proc.poll() is None:
            proc.kill()
        output.close()


@pytest.fixture
def early_subprocess(request) -> tuple[int, str]:
    """(exit code, output) of the test's early_subprocess command, waiting for it to end."""
    proc, output = _EARLY[request.node.nodeid]
    code = proc.wait()
    output.seek(0)
    return code, output.read()
