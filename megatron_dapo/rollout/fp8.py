"""FP8 rollout weights: block-wise e4m3 quantization of the linear layers on the way into the engine.

    export_hf_weights --(name, W [N, K])--> quantize_named_tensors (rollout.weight_dtype "fp8")
        linear weight  --> (name, Q [N, K] float8_e4m3fn), (name + "_scale_inv", S [ceil(N/128), ceil(K/128)] fp32)
        anything else  --> (name, W) unchanged (embeddings, norms, lm_head, biases)

One scale per 128 x 128 block b: S_b = amax_b / 448 (448 = the largest finite e4m3fn value), Q = round(W / S_b)
saturated to +-448, and W is read back as Q * S_b. That is the layout of block-wise FP8 checkpoints
(DeepSeek-V3 style) that SGLang 0.5.23 loads with quantization_config {"quant_method": "fp8", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}: its Fp8LinearMethod registers `weight` as float8_e4m3fn [N, K] and
`weight_scale_inv` as float32 [(N + 127) // 128, (K + 127) // 128] and dequantizes as Q.float() * S repeated over
each block (fp8_utils.block_quant_dequant); tests/rollout/test_fp8_weights.py checks these against its source.

Error per element (round to nearest in e4m3: 3 mantissa bits, subnormal spacing 2^-9): |W - Q S| <=
max(2^-4 |W|, 2^-10 S) up to fp32 rounding; in particular <= 16 S, half the spacing of the top binade [256, 448].

Why torch and not nvidia-modelopt (docs/rollout_correction.md): modelopt 0.47's FP8QTensor.quantize does the same
arithmetic in pure torch (block_sizes {-1: 128, -2: 128}, scale amax / 448), but an all-zero block gets scale 0 and
0 / 0 = NaN weights, and importing modelopt.torch.quantization pulls omegaconf, pulp, scipy, nvidia-ml-py at import
time for what is a few tensor ops here.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator

import torch
from torch import Tensor

from megatron_dapo.fp8_format import FP8_BLOCK
from megatron_dapo.fp8_format import LINEAR_MODULES
from megatron_dapo.fp8_format import SCALE_SUFFIX
from megatron_dapo.fp8_format import scale_shape

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
WEIGHT_DTYPES = ("auto", "fp8")
# Smallest positive scale: keeps an all-zero block finite (its Q is 0, its S this tiny number).
_MIN_SCALE = torch.finfo(torch.float32).tiny

SGLANG_FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
"""The `quantization_config` SGLang must see in the served config.json (SGLangEngine passes it through
json_model_override_args) for it to create FP8 parameters that accept `<name>` + `<name>_scale_inv`."""


def is_fp8_linear(name: str, tensor: Tensor) -> bool:
    """True for the 2-D `.weight` of a projection in LINEAR_MODULES (not embeddings, norms, lm_head or biases)."""
    parts = name.split(".")
    return tensor.dim() == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_MODULES


def _blocks(x: Tensor, block: int) -> tuple[Tensor, int, int]:
    """x [N, K] zero-padded to block multiples and viewed as [N / b, b, K / b, b]."""
    n, k = x.shape
    nb, kb = scale_shape(n, k, block)
    padded = torch.nn.functional.pad(x, (0, kb * block - k, 0, nb * block - n))
    return padded.view(nb, block, kb, block), n, k


@torch.no_grad()
def quantize_block_fp8(weight: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """Block-wise e4m3 quantization of a 2-D weight.

    Args:
        weight: [N, K] float (any float dtype; computed in fp32).
        block: block edge (128 for SGLang's weight_block_size [128, 128]).
    Returns:
        (q, scale_inv): q [N, K] torch.float8_e4m3fn, scale_inv [ceil(N / block), ceil(K / block)] fp32 with
        weight ~= q.float() * scale_inv repeated over each block (`dequantize_block_fp8`).
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_block_fp8: expected a 2-D weight, got shape {tuple(weight.shape)}")
    blocks, n, k = _blocks(weight.detach().to(torch.float32), block)
    amax = blocks.abs().amax(dim=(1, 3))  # [N / b, K / b]
    scale_inv = (amax / E4M3_MAX).clamp_min(_MIN_SCALE)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(blocks.shape[0] * block, blocks.shape[2] * block)[:n, :k].contiguous()
    return q, scale_inv.contiguous()


def dequantize_block_fp8(
    q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> Tensor:
    """q [N, K] float8 * scale_inv [ceil(N/b), ceil(K/b)] fp32 repeated over each b x b block, as `dtype` [N, K]."""
    n, k = q.shape
    if tuple(scale_inv.shape) != scale_shape(n, k, block):
        raise ValueError(
            f"dequantize_block_fp8: scale_inv {tuple(scale_inv.shape)} does not match weight {(n, k)} in {block}-blocks"
        )
    full = scale_inv.to(torch.float32).repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:n, :k]
    return (q.to(torch.float32) * full).to(dtype)


def quantize_named_tensors(
    named_tensors: Iterable[tuple[str, Tensor]], block: int = FP8_BLOCK
) -> Iterator[tuple[str, Tensor]]:
    """The FP8 stream of an HF weight stream: each linear weight becomes (name, q) then (name + "_scale_inv",
    scale_inv); every other tensor passes through unchanged. Lazy: one tensor at a time."""
    for name, tensor in named_tensors:
        if is_fp8_linear(name, tensor):
            q, scale_inv = quantize_block_fp8(tensor, block)
            yield name, q
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor
