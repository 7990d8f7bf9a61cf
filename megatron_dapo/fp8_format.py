"""The block-FP8 weight layout shared by the rollout path (rollout/fp8.py quantizes to it) and the planner (plan.py
sizes it): pure Python, no torch, so `megatron-dapo plan` runs where torch is not installed.

    linear weight W [N, K] --> Q [N, K] float8_e4m3fn (1 byte per element)
                               + scale_inv [ceil(N / 128), ceil(K / 128)] fp32 (one per 128 x 128 block)
"""

from __future__ import annotations

FP8_BLOCK = 128
"""Block edge of the scales (SGLang's quantization_config weight_block_size [128, 128])."""
SCALE_SUFFIX = "_scale_inv"
"""A quantized weight's scale travels as `<name>_scale_inv`."""
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""HF module names whose `.weight` is quantized (Llama / Qwen2 / Mistral attention and MLP projections)."""


def scale_shape(rows: int, cols: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the scale grid of an [rows, cols] weight: (ceil(rows / block), ceil(cols / block))."""
    return (-(-rows // block), -(-cols // block))


def fp8_weight_bytes(rows: int, cols: int) -> int:
    """Bytes of one quantized [rows, cols] weight: 1 per element plus 4 per block scale."""
    r, c = scale_shape(rows, cols)
    return rows * cols + 4 * r * c
