import os
import random

# Triton switches to the interpreter when @triton.jit runs, so this must precede any kernel import.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch

from megatron_dapo.actor.cpu_compat import import_megatron_core

import_megatron_core()  # before any test imports it: on CPU, megatron's fusions are not torch.compile'd (~5 s)


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
