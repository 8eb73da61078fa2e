"""Lossy expert formats: fp8 e4m3, int8 and int4 weight quantisation, and a PyTorch reference dequantiser.

Shapes: one expert weight W [N, K] as F.linear reads it: N output channels, K input features
(w13 [2I, H]: N = 2I, K = H; w2 [H, I]: N = H, K = I).
  fp8   data float8_e4m3fn [N, K], scales float32 [N, 1]        W ~= data * scale (per output channel)
  int8  data int8 [N, K] in [-127, 127], scales float32 [N, 1]  symmetric, per output channel
  int4  data uint8 [N, ceil(K/2)], scales float32 [N, G]         G = ceil(K / 128) groups along K, symmetric
        values in [-7, 7] stored as nibble v + 8; element 2j in the low nibble, 2j+1 in the high one;
        an odd K pads one zero nibble; the last group may be shorter than 128 (its scale covers only its
        own elements), so nothing is padded to a full group.
"bf16" and "lossless" are the exact rungs: `fake_quantize` returns the weight unchanged for them.
The GPU dequantisation kernel (kernels/dequant.py) is checked bit for bit against `dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 128
FP8_MAX = 448.0          # largest finite float8_e4m3fn
SCALE_BYTES = 4          # float32 scales
LOSSY_PRECISIONS = ("fp8", "int8", "int4")
EXACT_PRECISIONS = ("bf16", "lossless")


@dataclass(frozen=True)
class QuantizedTensor:
    precision: str
    shape: tuple[int, int]     # [N, K] of the original weight
    data: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


@dataclass(frozen=True)
class QuantizedExpert:
    w13: QuantizedTensor       # of [2I, H]
    w2: QuantizedTensor        # of [H, I]

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def bytes_of(precision: str, shape: tuple[int, int]) -> int:
    """Bytes one weight of `shape` [N, K] takes at `precision`, scales included. Pure arithmetic, so
    slot sizes can be planned before any weight is quantised. 'lossless' is data dependent: not here
    (the planner takes a measured or assumed ratio)."""
    n, k = shape
    if precision == "bf16":
        return 2 * n * k
    if precision in ("fp8", "int8"):
        return n * k + SCALE_BYTES * n
    if precision == "int4":
        return n * ((k + 1) // 2) + SCALE_BYTES * n * (-(-k // INT4_GROUP))
    raise ValueError(f"bytes_of: unknown or data-dependent precision {precision!r}")


def expert_bytes(precision: str, hidden: int, inter: int) -> int:
    """Bytes of one expert (w13 [2I, H] + w2 [H, I]) at `precision`."""
    return bytes_of(precision, (2 * inter, hidden)) + bytes_of(precision, (hidden, inter))


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero channel or group has scale 0; divide by 1 instead (it quantises to zeros either way).
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [-8, 7] -> uint8 [N, ceil(K/2)]: element 2j low nibble, 2j+1 high nibble."""
    n, k = q.shape
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if k % 2:
        u = torch.cat([u, torch.full((n, 1), 8, dtype=torch.uint8, device=q.device)], dim=1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, ceil(K/2)] -> int8 [N, K] in [-8, 7]."""
    lo = (packed & 0xF).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)[:, :k]


def _groups(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """w [N, K] float32 -> [N, G, 128] zero-padded along K, and G."""
    n, k = w.shape
    g = -(-k // INT4_GROUP)
    pad = g * INT4_GROUP - k
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.view(n, g, INT4_GROUP), g


def quantize(w: torch.Tensor, precision: str) -> QuantizedTensor:
    """Quantise one weight [N, K] (any float dtype; computed in float32)."""
    if w.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    wf = w.float()
    if precision in ("fp8", "int8"):
        amax = wf.abs().amax(dim=1, keepdim=True)                       # [N, 1]
        qmax = FP8_MAX if precision == "fp8" else 127.0
        scale = amax / qmax
        x = wf / _safe(scale)
        if precision == "fp8":
            data = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        else:
            data = torch.round(x).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor(precision, (n, k), data, scale)
    if precision == "int4":
        grouped, g = _groups(wf)
        scale = grouped.abs().amax(dim=2) / 7.0                          # [N, G]
        q = torch.round(grouped / _safe(scale)[:, :, None]).clamp(-7, 7)
        data = pack_int4(q.reshape(n, g * INT4_GROUP)[:, :k].to(torch.int8))
        return QuantizedTensor(precision, (n, k), data, scale)
    raise ValueError(f"quantize: unknown lossy precision {precision!r} (expected one of {LOSSY_PRECISIONS})")


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantiser: QuantizedTensor -> [N, K] in `dtype` (products taken in float32)."""
    n, k = qt.shape
    if qt.precision in ("fp8", "int8"):
        return (qt.data.float() * qt.scales).to(dtype)
    if qt.precision == "int4":
        q = unpack_int4(qt.data, k).float()
        grouped, g = _groups(q)
        return (grouped * qt.scales[:, :, None]).reshape(n, g * INT4_GROUP)[:, :k].to(dtype)
    raise ValueError(f"dequantize: unknown precision {qt.precision!r}")


def quantize_expert(w13: torch.Tensor, w2: torch.Tensor, precision: str) -> QuantizedExpert:
    return QuantizedExpert(quantize(w13, precision), quantize(w2, precision))


def dequantize_expert(qe: QuantizedExpert, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(qe.w13, dtype), dequantize(qe.w2, dtype)


def fake_quantize(w: torch.Tensor, precision: str) -> torch.Tensor:
    """quantise -> dequantise, in w's dtype; the exact rungs return w itself."""
    if precision in EXACT_PRECISIONS:
        return w
    return dequantize(quantize(w, precision), w.dtype)
