"""Overlong reward shaping (DAPO section 3.4): soft length penalty and overlong filtering."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def soft_overlong_penalty(
    lengths: Tensor, *, max_response_length: int, overlong_buffer: int, penalty_factor: float = 1.0
) -> Tensor:
    """Length-aware penalty added to the reward.

    0 if L <= max - buffer; -(L - (max - buffer)) / buffer * factor inside the buffer; -factor if L > max.
    Lengths count generated tokens including EOS.

    Args:
        lengths: [N] int or float, response lengths.
    Returns:
        [N] float32 penalties (<= 0).
    """
    if not 0 < overlong_buffer < max_response_length:
        raise ValueError(
            f"overlong_buffer must satisfy 0 < overlong_buffer < max_response_length, got {overlong_buffer} and "
            f"{max_response_length}"
        )
    lengths = lengths.to(torch.float32)
    expected = max_response_length - overlong_buffer
    penalty = -(lengths - expected).clamp_min(0.0) / overlong_buffer * penalty_factor
    return torch.where(lengths > max_response_length, torch.full_like(lengths, -penalty_factor), penalty)


def overlong_filter_mask(finish_reasons: Sequence[str]) -> Tensor:
    """1.0 for responses that finished on their own, 0.0 for those cut at the length cap ("length").

    Multiply the loss mask [N, T] by mask[:, None] to drop truncated responses from the loss (overlong filtering).
    They still count in the group statistics (their reward is computed as usual).

    Returns:
        [N] float32.
    """
    bad = [r for r in finish_reasons if r not in ("stop", "length")]
    if bad:
        raise ValueError(f"finish_reason must be 'stop' or 'length', got {bad[0]!r}")
    return torch.tensor([0.0 if r == "length" else 1.0 for r in finish_reasons], dtype=torch.float32)
