import pytest
import torch

from megatron_dapo.algorithms import DynamicSampler
from megatron_dapo.algorithms import DynamicSamplingError
from megatron_dapo.algorithms import Group
from megatron_dapo.algorithms import group_is_informative


def g(*accs, tag=None):
    return Group(accs=torch.tensor(accs, dtype=torch.bool), payload=tag)


class Source:
    """Generation batches from a script: a list of lists of groups; records what was asked."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.calls = []

    def __call__(self, missing):
        self.calls.append(missing)
        return self.batches.pop(0) if self.batches else []


def test_admission_rule():
    assert group_is_informative(torch.tensor([True, False]))
    assert not group_is_informative(torch.tensor([True, True]))
    assert not group_is_informative(torch.tensor([False, False]))
    assert not group_is_informative(torch.tensor([], dtype=torch.bool))


def test_refills_until_target_and_drops_surplus():
    mixed = lambda i: g(1, 0, tag=i)  # noqa: E731
    src = Source(
        [
            [mixed(0), g(1, 1), g(0, 0), g(0, 0)],
            [g(0, 0), mixed(1), g(1, 1), g(0, 0)],
            [mixed(2), mixed(3), mixed(4), g(0, 0)],
        ]
    )
    sampler = DynamicSampler(target_prompts=3)
    batch, m = sampler.collect(src)
    assert [x.payload for x in batch] == [0, 1, 2]
    assert src.calls == [3, 2, 1]
    assert m["sampling/gen_batches"] == 3
    assert m["sampling/prompts_sampled"] == 12
    assert m["sampling/prompts_kept"] == 3
    assert m["sampling/groups_all_correct"] == 2
    assert m["sampling/groups_all_wrong"] == 5
    assert m["sampling/prompts_per_useful"] == pytest.approx(12 / 5)
    assert m["sampling/surplus"] == 2
    # Surplus dropped by default: the next step starts empty.
    batch2, m2 = sampler.collect(Source([[mixed(9), mixed(10), mixed(11)]]))
    assert [x.payload for x in batch2] == [9, 10, 11] and m2["sampling/carried_in"] == 0


def test_keep_surplus_carries_to_next_step_and_checkpoints():
    sampler = DynamicSampler(target_prompts=2, keep_surplus=True)
    batch, m = sampler.collect(Source([[g(1, 0, tag=i) for i in range(5)]]))
    assert [x.payload for x in batch] == [0, 1] and m["sampling/surplus"] == 3
    state = sampler.state_dict()
    restored = DynamicSampler(target_prompts=2, keep_surplus=True)
    restored.load_state_dict(state)
    src = Source([])
    batch2, m2 = restored.collect(src)
    assert [x.payload for x in batch2] == [2, 3] and src.calls == [] and m2["sampling/carried_in"] == 3
    batch3, _ = restored.collect(Source([[g(0, 1, tag=7)]]))
    assert [x.payload for x in batch3] == [4, 7]


def test_max_gen_batches_error_states_counts():
    sampler = DynamicSampler(target_prompts=4, max_gen_batches=2)
    src = Source([[g(1, 0), g(0, 0)], [g(1, 1), g(0, 0)], [g(1, 0)] * 10])
    with pytest.raises(DynamicSamplingError, match=r"max_gen_batches=2: kept 1 of 4 prompts after sampling 4"):
        sampler.collect(src)
    assert len(src.calls) == 2  # stopped, never drew the third batch


def test_max_gen_batches_partial():
    sampler = DynamicSampler(target_prompts=4, max_gen_batches=2, on_max_gen_batches="partial")
    batch, m = sampler.collect(Source([[g(1, 0, tag="a"), g(0, 0)], [g(1, 1), g(0, 1, tag="b")]]))
    assert [x.payload for x in batch] == ["a", "b"] and m["sampling/prompts_kept"] == 2


def test_exhausted_source_and_all_useless_never_hang():
    sampler = DynamicSampler(target_prompts=4)  # unlimited batches
    batch, m = sampler.collect(Source([[g(0, 0)] * 3, [g(1, 1)] * 3]))
    assert batch == [] and m["sampling/gen_batches"] == 2 and m["sampling/prompts_kept"] == 0
    assert m["sampling/prompts_per_useful"] == 6.0  # finite even with nothing useful
    empty, m = DynamicSampler(target_prompts=2).collect(Source([]))
    assert empty == [] and m["sampling/gen_batches"] == 0


def test_disabled_keeps_everything_from_one_batch():
    sampler = DynamicSampler(target_prompts=3, enabled=False)
    src = Source([[g(1, 1, tag=0), g(0, 0, tag=1), g(1, 0, tag=2)], [g(1, 0)]])
    batch, m = sampler.collect(src)
    assert [x.payload for x in batch] == [0, 1, 2] and len(src.calls) == 1


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"target_prompts": 0}, "target_prompts"),
        ({"target_prompts": 1, "max_gen_batches": -1}, "max_gen_batches"),
        ({"target_prompts": 1, "on_max_gen_batches": "x"}, "on_max_gen_batches"),
    ],
)
def test_invalid_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        DynamicSampler(**kwargs)
