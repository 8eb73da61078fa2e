"""Dequantisation of a layer's quantized experts straight into their rows of the compute buffer (Triton).

Shapes: the quantized tier stacks its n experts' weights along output channels (experts/tiers/quantized.py):
R = n * N rows of K input features. Row r is channel r % N of the layer's (r // N)-th quantized expert;
its K values land at out[base[r // N] + (r % N) * K : ... + K], base[i] being that expert's element offset
in the packed [E, stride] buffer (expert id * stride + the weight's offset in the row).
  fp8 / int8  data [R, K] (float8_e4m3fn / int8), scales float32 [R, 1]
  int4        data uint8 [R, ceil(K/2)] (element 2j low nibble, 2j+1 high, stored v + 8),
              scales float32 [R, ceil(K/128)]
Products are taken in float32 and rounded to the buffer's dtype once, as the PyTorch reference
(codecs/quant.py::dequantize) does: the results are bit-identical to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmoe.codecs.quant import INT4_GROUP, QuantizedTensor


@triton.jit
def dequant_kernel(
    data_ptr,  # [R, data_stride]: fp8 / int8 values, or uint8 int4 nibble pairs
    scale_ptr,  # float32 [R, scale_stride]
    base_ptr,  # int64 [n]: element offset of each expert's weight in out
    out_ptr,  # the packed compute buffer, flat
    R,
    N,
    K,
    data_stride,
    scale_stride,
    INT4: tl.constexpr,
    PAIRED: tl.constexpr,  # int4: load each byte once and split it (BLOCK_K a multiple of GROUP)
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < R
    mask = rmask[:, None] & (ks < K)[None, :]
    row_off = rows.to(tl.int64)[:, None]
    if INT4 and PAIRED:
        # one coalesced load of BLOCK_K / 2 bytes, both nibbles interleaved back into K order; one scale
        # per (row, group) broadcast over its GROUP values (the block starts on a group boundary)
        js = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(data_ptr + row_off * data_stride + js[None, :],
                       mask=rmask[:, None] & (js < data_stride)[None, :], other=0)
        q = tl.interleave((byte & 0xF).to(tl.float32) - 8.0, (byte >> 4).to(tl.float32) - 8.0)
        gs = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(scale_ptr + row_off * scale_stride + gs[None, :],
                    mask=rmask[:, None] & (gs < scale_stride)[None, :], other=0.0)
        q = tl.reshape(tl.reshape(q, (BLOCK_R, BLOCK_K // GROUP, GROUP)) * s[:, :, None], (BLOCK_R, BLOCK_K))
        s = 1.0
    elif INT4:
        byte = tl.load(data_ptr + row_off * data_stride + (ks // 2)[None, :], mask=mask, other=0)
        nibble = tl.where((ks % 2 == 0)[None, :], byte & 0xF, byte >> 4)
        q = nibble.to(tl.float32) - 8.0
        s = tl.load(scale_ptr + row_off * scale_stride + (ks // GROUP)[None, :], mask=mask, other=0.0)
    else:
        # no `other`: an int constant does not cast to fp8 when compiled; masked lanes are never stored
        q = tl.load(data_ptr + row_off * data_stride + ks[None, :], mask=mask).to(tl.float32)
        s = tl.load(scale_ptr + rows.to(tl.int64) * scale_stride, mask=rmask, other=0.0)[:, None]
    val = (q * s).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    base = tl.load(base_ptr + rows // N, mask=rmask, other=0)
    dst = base[:, None] + (rows % N).to(tl.int64)[:, None] * K + ks[None, :]
    tl.store(out_ptr + dst, val, mask=mask)


# (BLOCK_R, BLOCK_K, num_warps, paired) per precision: the fastest exact launch shape of
# benchmarks/bench_dequant.py on the H200 (Qwen3-30B-A3B's 128 experts, commit 5e371e3): 0.77 / 0.83 / 0.72 of
# the HBM floor for int8 / fp8 / int4 (16 x 256 unpaired gave int4 0.27 and fp8 0.60).
LAUNCH_SHAPES = {"int8": (16, 256, 4, False), "fp8": (16, 1024, 4, False), "int4": (16, 512, 4, True)}


def dequantize_into(qt: QuantizedTensor, out: torch.Tensor, bases: torch.Tensor, block_r: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None, paired: bool | None = None) -> None:
    """Dequantise qt ([n*N, K] stacked) into `out` (a contiguous packed buffer, any float dtype) at the
    element offsets `bases` (int64 [n], on out's device): one launch, no host sync. The launch shape
    defaults to LAUNCH_SHAPES[precision]; any shape writes the same bits. `paired` (int4, block_k a multiple
    of 128): each byte loaded once and split, one scale load per group."""
    N_total, K = qt.shape
    n = bases.numel()
    if qt.precision not in ("fp8", "int8", "int4"):
        raise ValueError(f"dequantize_into: unknown precision {qt.precision!r}")
    if n == 0 or N_total % n:
        raise ValueError(f"{N_total} rows do not split into {n} experts")
    if not out.is_contiguous() or bases.dtype != torch.int64 or bases.device != out.device:
        raise ValueError("out must be contiguous and bases an int64 tensor on its device")
    if qt.data.device != out.device or not qt.data.is_contiguous() or not qt.scales.is_contiguous():
        raise ValueError("the quantized data and scales must be contiguous, on out's device")
    int4 = qt.precision == "int4"
    shape = LAUNCH_SHAPES[qt.precision]
    block_r, block_k, num_warps, paired = (shape[i] if v is None else v
                                           for i, v in enumerate((block_r, block_k, num_warps, paired)))
    if int4 and qt.data.shape != (N_total, (K + 1) // 2) or int4 and qt.scales.shape[1] != -(-K // INT4_GROUP):
        raise ValueError(f"int4 data {tuple(qt.data.shape)} / scales {tuple(qt.scales.shape)} do not match {qt.shape}")
    if not int4 and (qt.data.shape != (N_total, K) or qt.scales.shape != (N_total, 1)):
        raise ValueError(f"data {tuple(qt.data.shape)} / scales {tuple(qt.scales.shape)} do not match {qt.shape}")
    if paired and block_k % INT4_GROUP:
        raise ValueError(f"paired int4 dequantisation needs block_k a multiple of {INT4_GROUP}, got {block_k}")
    grid = (triton.cdiv(N_total, block_r), triton.cdiv(K, block_k))
    dequant_kernel[grid](qt.data, qt.scales, bases, out, N_total, N_total // n, K, qt.data.shape[1],
                         qt.scales.shape[1], INT4=int4, PAIRED=paired and int4, GROUP=INT4_GROUP, BLOCK_R=block_r,
                         BLOCK_K=block_k,
                         num_warps=num_warps)
