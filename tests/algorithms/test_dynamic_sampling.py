import random

import pytest
import torch

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms import DynamicSamplingError
from megatron_dapo.algorithms import Group
from megatron_dapo.algorithms import group_is_informative
from megatron_dapo.algorithms.dynamic_sampling import sample_step
from megatron_dapo.config import load_config


def g(*accs, tag=None):
    return Group(accs=torch.tensor(accs, dtype=torch.bool), payload=tag)


MIXED, RIGHT, WRONG = (1, 0), (1, 1), (0, 0)


def queue(*kinds):
    return [g(*k, tag=i) for i, k in enumerate(kinds)]


def test_admission_rule():
    assert group_is_informative(torch.tensor([True, False]))
    assert not group_is_informative(torch.tensor([True, True]))
    assert not group_is_informative(torch.tensor([False, False]))
    assert not group_is_informative(torch.tensor([], dtype=torch.bool))


def test_keeps_the_first_useful_groups_in_queue_order_and_counts():
    groups = queue(MIXED, RIGHT, WRONG, WRONG, WRONG, MIXED, RIGHT, MIXED, MIXED, MIXED)
    step = DynamicSampler(target_prompts=3).start()
    for p, grp in enumerate(groups):
        step.offer(p, grp)
    kept, m = step.result()
    assert [x.payload for x in kept] == [0, 5, 7]
    assert step.decided == 8  # the cut: positions 8 and 9 are past it
    assert [p for p, _ in step.undecided()] == [8, 9]
    assert m == {
        "sampling/prompts_sampled": 8.0,
        "sampling/prompts_kept": 3.0,
        "sampling/groups_all_correct": 2.0,
        "sampling/groups_all_wrong": 3.0,
        "sampling/prompts_per_useful": pytest.approx(8 / 3),
        "sampling/prompts_given_up": 0.0,
    }


def test_a_group_given_up_is_decided_but_neither_kept_nor_counted_as_filtered():
    from megatron_dapo.rollout import GroupSummary

    step = DynamicSampler(target_prompts=2).start()
    step.offer(0, GroupSummary.given_up(index=9, position=0, owner=0, key="0:1", prompt_len=3))
    for p, grp in enumerate(queue(MIXED, WRONG, MIXED), start=1):
        step.offer(p, grp)
    kept, m = step.result()
    assert [x.payload for x in kept] == [0, 2] and step.decided == 4
    assert m["sampling/prompts_given_up"] == 1 and m["sampling/groups_all_wrong"] == 1


@pytest.mark.parametrize("seed", range(20))
def test_the_kept_set_does_not_depend_on_completion_order(seed):
    rng = random.Random(seed)
    kinds = [rng.choice([MIXED, RIGHT, WRONG, (0, 1, 1), (1, 1, 0)]) for _ in range(40)]
    groups = queue(*kinds)
    in_order = DynamicSampler(target_prompts=6).start()
    for p, grp in enumerate(groups):
        in_order.offer(p, grp)
    expected = [x.payload for x in in_order.result()[0]]
    shuffled = DynamicSampler(target_prompts=6).start()
    order = list(range(40))
    rng.shuffle(order)
    for p in order:
        if shuffled.done:
            break
        shuffled.offer(p, groups[p])
    assert shuffled.done and [x.payload for x in shuffled.result()[0]] == expected
    assert shuffled.decided == in_order.decided


def test_a_group_is_decided_only_when_every_earlier_one_is():
    step = DynamicSampler(target_prompts=1).start()
    step.offer(1, g(*MIXED, tag="late"))
    assert step.decided == 0 and not step.done  # position 0 may still be useful
    step.offer(0, g(*MIXED, tag="first"))
    assert step.done and [x.payload for x in step.result()[0]] == ["first"]
    assert [x.payload for _, x in step.undecided()] == ["late"]
    with pytest.raises(ValueError, match="offered twice"):
        step.offer(0, g(*MIXED))


def test_cap_error_states_counts_and_partial_trains_on_what_was_kept():
    groups = queue(MIXED, WRONG, RIGHT, WRONG, MIXED, MIXED)
    strict = DynamicSampler(target_prompts=4, max_sampled_prompts=4, cap_name="max_gen_batches=2 x gen=2").start()
    for p in range(4):
        strict.offer(p, groups[p])
    assert strict.done
    with pytest.raises(
        DynamicSamplingError,
        match=r"cap of 4 sampled prompts \(max_gen_batches=2 x gen=2\): kept 1 of 4 prompts after sampling 4 "
        r"\(1 all-correct, 2 all-wrong groups\)",
    ):
        strict.result()
    lenient = DynamicSampler(target_prompts=4, max_sampled_prompts=4, on_cap="partial")
    kept, m = sample_step(lenient, lambda p: groups[p])
    assert [x.payload for x in kept] == [0] and m["sampling/prompts_sampled"] == 4


def test_disabled_keeps_every_group_of_the_first_positions():
    groups = queue(RIGHT, WRONG, MIXED, MIXED)
    kept, m = sample_step(DynamicSampler(target_prompts=3, enabled=False, max_sampled_prompts=10), lambda p: groups[p])
    assert [x.payload for x in kept] == [0, 1, 2] and m["sampling/prompts_sampled"] == 3


def test_from_config_cap_is_the_rounds_bound():
    cfg = load_config(None, ["--algorithm.max_gen_batches=3", "--trainer.gen_prompts_per_batch=8"])
    rule = DynamicSampler.from_config(cfg.algorithm, cfg.trainer)
    assert (rule.target_prompts, rule.max_sampled_prompts, rule.on_cap) == (512, 24, "error")
    assert rule.cap_name == "algorithm.max_gen_batches=3 x trainer.gen_prompts_per_batch=8"


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"target_prompts": 0}, "target_prompts"),
        ({"target_prompts": 1, "max_sampled_prompts": -1}, "max_sampled_prompts"),
        ({"target_prompts": 1, "on_cap": "x"}, "on_cap"),
    ],
)
def test_invalid_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        DynamicSampler(**kwargs)


def test_ahead_is_what_is_still_missing_over_the_keep_ratio():
    step = DynamicSampler(target_prompts=8).start()
    assert step.ahead(1.5, prior_keep=0.5) == 24  # nothing decided: 1.5 x 8 missing / the prior 0.5
    for p, grp in enumerate(queue(MIXED, WRONG, WRONG, WRONG)):
        step.offer(p, grp)
    assert step.ahead(1.5, prior_keep=0.5) == 42  # the step's own keep ratio 1/4: 1.5 x 7 / 0.25
    assert step.ahead(1.0, prior_keep=0.5) == 28
    none_kept = DynamicSampler(target_prompts=2).start()
    for p, grp in enumerate(queue(WRONG, WRONG, WRONG, WRONG)):
        none_kept.offer(p, grp)
    assert none_kept.ahead(1.0, prior_keep=0.5) == 40  # keep floored at 0.05
    plain = DynamicSampler(target_prompts=3, enabled=False).start()
    assert plain.ahead(1.0, prior_keep=0.1) == 3  # without dynamic sampling every group is kept
    for p, grp in enumerate(queue(WRONG, WRONG, WRONG)):
        plain.offer(p, grp)
    assert plain.done and plain.ahead(1.0, prior_keep=0.5) == 0
