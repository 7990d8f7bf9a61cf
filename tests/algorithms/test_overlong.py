import pytest
import torch

from megatron_dapo.algorithms import overlong_filter_mask
from megatron_dapo.algorithms import soft_overlong_penalty


def test_hand_values():
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    out = soft_overlong_penalty(lengths, max_response_length=20, overlong_buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))


def test_penalty_factor_and_paper_numbers():
    lengths = torch.tensor([16384, 18432, 20480, 20481])
    out = soft_overlong_penalty(lengths, max_response_length=20480, overlong_buffer=4096, penalty_factor=0.5)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.25, -0.5, -0.5]))


@pytest.mark.parametrize("buffer", [0, 20, 25, -1])
def test_invalid_buffer(buffer):
    with pytest.raises(ValueError, match="overlong_buffer"):
        soft_overlong_penalty(torch.tensor([1]), max_response_length=20, overlong_buffer=buffer)


def test_filter_mask():
    mask = overlong_filter_mask(["stop", "length", "stop"])
    torch.testing.assert_close(mask, torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="finish_reason"):
        overlong_filter_mask(["stop", "abort"])
