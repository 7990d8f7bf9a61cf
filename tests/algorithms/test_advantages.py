import math

import pytest
import torch

from megatron_dapo.algorithms import group_normalized_advantages


def test_hand_values():
    # Group 1: rewards +1, -1, -1, +1 -> mean 0, unbiased std sqrt(4/3).
    # Group 2: all equal -> advantages 0.
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    adv = group_normalized_advantages(rewards, group_size=4, eps=0.0 + 1e-6)
    s = math.sqrt(4.0 / 3.0)
    expected = [1 / (s + 1e-6), -1 / (s + 1e-6), -1 / (s + 1e-6), 1 / (s + 1e-6), 0, 0, 0, 0]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)


def test_matches_float64_formula():
    rewards = torch.randn(6 * 5, dtype=torch.float64)
    adv = group_normalized_advantages(rewards.float(), group_size=5, eps=1e-6)
    expected = []
    for g in range(6):
        r = rewards[g * 5 : (g + 1) * 5].tolist()
        mean = sum(r) / 5
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 4)
        expected += [(x - mean) / (std + 1e-6) for x in r]
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_one_correct_of_sixteen():
    rewards = torch.full((16,), -1.0)
    rewards[3] = 1.0
    adv = group_normalized_advantages(rewards, group_size=16)
    mean = -14 / 16
    std = math.sqrt((1 - mean) ** 2 / 15 + 15 * (-1 - mean) ** 2 / 15)
    assert adv[3].item() == pytest.approx((1 - mean) / (std + 1e-6), rel=1e-5)
    assert adv[0].item() == pytest.approx((-1 - mean) / (std + 1e-6), rel=1e-5)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize(
    "rewards,group_size,msg",
    [(torch.zeros(5), 2, "not a multiple"), (torch.zeros(4), 1, "group_size"), (torch.zeros(2, 2), 2, "1-D")],
)
def test_errors(rewards, group_size, msg):
    with pytest.raises(ValueError, match=msg):
        group_normalized_advantages(rewards, group_size)
