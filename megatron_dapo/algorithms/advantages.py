"""Group-relative advantages (GRPO / DAPO)."""

from __future__ import annotations

import torch
from torch import Tensor


def group_normalized_advantages(
    rewards: Tensor, group_size: int, eps: float = 1e-6, std_normalize: bool = True
) -> Tensor:
    """A_i = (R_i - mean_g) / (std_g + eps) within each group of `group_size` contiguous responses; with
    std_normalize=False (Dr. GRPO) A_i = R_i - mean_g.

    std is the unbiased (Bessel-corrected) standard deviation, as in DAPO's reference implementation. A group whose
    rewards are all equal gets A = 0 (std = 0). The advantage is per response; broadcast it over the response's
    tokens for the loss.

    Args:
        rewards: [N] float, N a multiple of group_size, groups contiguous.
    Returns:
        [N] float32.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group standard deviation, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"number of rewards {rewards.numel()} is not a multiple of group_size {group_size}")
    grouped = rewards.to(torch.float32).view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    if not std_normalize:
        return (grouped - mean).view(-1)
    std = grouped.std(dim=1, keepdim=True, unbiased=True)
    return ((grouped - mean) / (std + eps)).view(-1)
