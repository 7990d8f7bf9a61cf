"""Hangs of issue 12 item 4, each bounded by a configurable limit that the test sets low.

- dynamic sampling with the default config stops at its cap of sampled prompts (max_gen_batches 10 x
  gen_prompts_per_batch) when every group is all-correct or all-wrong, with the counts; before, the default
  (0 = unlimited) spun silently forever;
- the verifier's time limit applies off the main thread (before: no limit there at all).
The stopped-rank case (distributed.timeout_minutes) is in test_actor_faults.py.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms.dynamic_sampling import DynamicSamplingError
from megatron_dapo.algorithms.dynamic_sampling import Group
from megatron_dapo.config import load_config
from megatron_dapo.reward import dapo_math


def test_default_dynamic_sampling_is_bounded_and_says_by_what():
    """Every group all-wrong: the step stops at the cap of sampled prompts (max_gen_batches x
    gen_prompts_per_batch, the default 10 batches) with the counts, instead of sampling forever."""
    overrides = ["--trainer.gen_prompts_per_batch=4", "--trainer.prompts_per_step=4", "--trainer.mini_batch_prompts=4"]
    cfg = load_config(None, overrides)
    step = DynamicSampler.from_config(cfg.algorithm, cfg.trainer).start()
    offered = 0
    while not step.done:
        assert offered < 1000, "dynamic sampling still undecided after 1000 prompts"
        step.offer(offered, Group(accs=torch.zeros(4, dtype=torch.bool), payload=offered))
        offered += 1
    assert offered == 40
    with pytest.raises(
        DynamicSamplingError,
        match=r"cap of 40 sampled prompts \(algorithm.max_gen_batches=10 x trainer.gen_prompts_per_batch=4\): "
        r"kept 0 of 4 prompts after sampling 40 \(0 all-correct, 40 all-wrong groups\)",
    ):
        step.result()


@pytest.fixture
def stuck_math_verify(monkeypatch):
    """A math-verify whose comparison never returns on its own (a pathological expression)."""
    release = threading.Event()
    fake = types.SimpleNamespace(
        parse=lambda text, parsing_timeout=None: [text],
        verify=lambda gold, pred, timeout_seconds=None: release.wait(60) and False,
    )
    monkeypatch.setattr(dapo_math, "_math_verify", lambda: fake)
    yield
    release.set()


def test_verifier_time_limit_applies_off_the_main_thread(stuck_math_verify):
    cfg = load_config(None, ["--reward.verify_timeout_s=0.5"])
    verifier = dapo_math.Verifier.from_config(cfg.reward)
    out: dict = {}

    def score() -> None:
        start = time.monotonic()
        out["result"] = verifier("so the answer is\nAnswer: \\frac{1}{2}", "\\frac{1}{2}")
        out["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=score, daemon=True)
    worker.start()
    worker.join(20)
    assert "seconds" in out, "the verifier did not return within 20 s off the main thread"
    assert 0.4 < out["seconds"] < 5.0, out["seconds"]
    assert out["result"]["acc"] is False and out["result"]["score"] == -1.0
