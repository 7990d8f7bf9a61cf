"""Hangs of issue 12 item 4, each bounded by a configurable limit that the test sets low.

- dynamic sampling with the default config stops (max_gen_batches 10) when every group is all-correct or
  all-wrong, and logs each extra generation round; before, the default (0 = unlimited) spun silently forever;
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


class _Uninformative:
    """A generator whose every group is all-wrong; it fails the test instead of letting it spin forever."""

    def __init__(self, limit: int = 1000) -> None:
        self.calls = 0
        self.limit = limit

    def __call__(self, missing: int) -> list[Group]:
        self.calls += 1
        if self.calls > self.limit:
            raise AssertionError(f"dynamic sampling still generating after {self.limit} rounds")
        return [Group(accs=torch.zeros(4, dtype=torch.bool), payload=i) for i in range(missing)]


def test_default_dynamic_sampling_is_bounded_and_logs_each_extra_round():
    cfg = load_config(None, [])
    lines: list[str] = []
    sampler = DynamicSampler.from_config(cfg.algorithm, target_prompts=4, log=lines.append)
    source = _Uninformative()
    with pytest.raises(DynamicSamplingError, match=r"max_gen_batches=10: kept 0 of 4 prompts after sampling 40"):
        sampler.collect(source)
    assert source.calls == 10
    assert len(lines) == 9 and all(f"generation round {k + 2} (of at most 10)" in x for k, x in enumerate(lines))
    assert "0 all-correct, 4 all-wrong groups" in lines[0]


def test_sampler_default_logs_through_logging(caplog):
    source = _Uninformative()
    with caplog.at_level("INFO", logger="megatron_dapo.algorithms.dynamic_sampling"):
        with pytest.raises(DynamicSamplingError):
            DynamicSampler(target_prompts=2, max_gen_batches=3).collect(source)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "generation round 2" in messages[0] and "generation round 3" in messages[1]


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
