"""Hangs of issue 12 item 4, each bounded by a configurable limit that the test sets low.

- dynamic sampling with the default config stops at its cap of sampled prompts (max_gen_batches 10 x
  gen_prompts_per_batch) when every group is all-correct or all-wrong, with the counts; before, the default
  (0 = unlimited) spun silently forever.
The verifier's time limit (reward.verify_timeout_s, on any thread) is in test_verifier_faults.py; the stopped-rank
case (distributed.timeout_minutes) is in test_actor_faults.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms.dynamic_sampling import DynamicSamplingError
from megatron_dapo.algorithms.dynamic_sampling import Group
from megatron_dapo.config import load_config


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
