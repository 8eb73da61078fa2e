"""FP8 block-scaled checkpoints (DeepSeek-V3's `quantization_config`): dequantised on load.

Such a checkpoint stores a linear weight W [O, I] as `name.weight` in float8 (e4m3) and
`name.weight_scale_inv` [ceil(O / bo), ceil(I / bi)] in float32, one scale per (bo, bi) block
(weight_block_size, [128, 128] for DeepSeek-V3); the real weight is W_fp8 * scale_inv blockwise.
Norms, the router, embeddings and lm_head stay in bf16. The loader hands every tensor through an
`Fp8Dequantizer`, which pairs each fp8 weight with its scale (in either order, in any shard) and
yields the dequantised weight in the model's dtype; everything else passes through.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf_config) -> Optional[tuple[int, int]]:
    """(bo, bi) of a block-scaled fp8 checkpoint; None when the checkpoint is not quantised."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict):
        q = q.to_dict()
    method = q.get("quant_method")
    if method != "fp8":
        raise NotImplementedError(f"quantization_config quant_method {method!r} is not supported (only 'fp8')")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise NotImplementedError("fp8 checkpoints without a 2-D weight_block_size are not supported")
    return int(block[0]), int(block[1])


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """weight [O, I] fp8, scale_inv [ceil(O / bo), ceil(I / bi)] -> weight * scale blockwise, in dtype
    (the product in float32, one rounding to dtype)."""
    O, I = weight.shape
    bo, bi = block
    want = (-(-O // bo), -(-I // bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not fit weight {(O, I)} in "
                         f"blocks of {block}: expected {want}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:O].repeat_interleave(bi, 1)[:, :I]
    return (weight.float() * scale).to(dtype)


class Fp8Dequantizer:
    """Pairs fp8 weights with their scales across a checkpoint's tensor stream."""

    def __init__(self, block: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.block, self.dtype, self.device = block, dtype, device
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """-> the (name, tensor) pairs ready to load now (possibly none)."""
        if name.endswith(SCALE_SUFFIX):
            base = name[:-len(SCALE_SUFFIX)]
            if base in self._weights:
                return [(base, self._dequant(self._weights.pop(base), tensor, base))]
            self._scales[base] = tensor
            return []
        if tensor.dtype in FP8_DTYPES:
            if name in self._scales:
                return [(name, self._dequant(tensor, self._scales.pop(name), name))]
            self._weights[name] = tensor
            return []
        return [(name, tensor)]

    def _dequant(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
        try:
            return dequant_block_fp8(weight.to(self.device), scale_inv.to(self.device), self.block, self.dtype)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def unpaired(self) -> list[str]:
        """Names left without their partner at the end of the checkpoint (an incomplete checkpoint)."""
        return sorted([f"{n} (no {SCALE_SUFFIX})" for n in self._weights]
                      + [f"{n}{SCALE_SUFFIX} (no fp8 weight)" for n in self._scales])
