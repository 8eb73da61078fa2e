"""Triton fused residual-add + RMSNorm: one read of x and the residual, one write of each output.

The unfused decoder layer runs ``h = h + x`` (one kernel, rounded to the model dtype) and then
RMSNorm (layers/norm.py: ``xf = h.float()``, the float32 squares summed in float64, times 1/H, rounded to
float32, plus eps, 1 / sqrt in float64 rounded to float32, ``xf * inv`` cast to the model dtype, times
the weight in the model dtype).
This kernel does the same ops in the same precisions (``rms_inv_tile``), so both outputs are bit-exact:
the float64 sum of the squares of bf16 / fp16 values is exact, hence the same in any order (for float32
inputs it is off by < 2^-52 relative, which the rounding to float32 hides but for odds of about 2^-28 a
row). fp fusion is off: no FMA may merge a product with a sum the torch ops round apart.
Reference: ``fused_add_rmsnorm_ref``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._attention_checks import check_float, check_same_device, next_pow2
from .pdl import launch_args, pdl_enter

MAX_HIDDEN = 16384  # one row in one tile of registers


@triton.jit
def rms_inv_tile(sum_sq, n, eps):
    """sum_sq: float64 sum of the float32 squares; n: float64 count -> float32 1 / sqrt(sum_sq / n + eps),
    rounded where layers/norm.py's rms_inv rounds: the variance and eps in float32, the root in float64
    (correctly rounded here; torch's float64 rsqrt is within an ulp, which the float32 rounding hides)."""
    var = (sum_sq * (1.0 / n)).to(tl.float32)
    return (1.0 / tl.sqrt((var + eps).to(tl.float64))).to(tl.float32)


@triton.jit
def fused_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    hidden, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # One program per row (token): the whole hidden vector in one tile.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the model dtype before the norm reads it, as torch's `h + x` is.
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, s, mask=mask)
        x = s.to(tl.float32)
    inv = rms_inv_tile(tl.sum((x * x).to(tl.float64), axis=0), tl.full([], hidden, tl.float64), eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * inv).to(dt).to(tl.float32)  # RMSNorm casts back to the model dtype before the weight
    tl.store(out_ptr + row * stride_out + offs, (w * y).to(dt), mask=mask)


def _check_rows(t: torch.Tensor, name: str, shape) -> None:
    check_float(t, name, 2)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [T, H] (+ residual [T, H]) -> (RMSNorm(x + residual) * weight [T, H], x + residual [T, H]).

    residual None: plain RMSNorm, returns (normed, None). ``out`` / ``residual_out`` may alias x /
    residual (each program reads its row whole before writing it): the decoder passes them to update in
    place. Dtypes: x, residual and the outputs share the model dtype; weight any float dtype of [H].
    """
    check_float(x, "x", 2)
    T, H = x.shape
    if not 0 < H <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {H}")
    if weight.dim() != 1 or weight.shape[0] != H or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{H}] tensor, got shape {tuple(weight.shape)}")
    out = torch.empty_like(x) if out is None else out
    _check_rows(out, "out", (T, H))
    tensors = dict(x=x, weight=weight, out=out)
    if residual is not None:
        _check_rows(residual, "residual", (T, H))
        residual_out = torch.empty_like(residual) if residual_out is None else residual_out
        _check_rows(residual_out, "residual_out", (T, H))
        if residual.dtype != x.dtype or residual_out.dtype != x.dtype or out.dtype != x.dtype:
            raise ValueError(f"x, residual and the outputs must share one dtype, got {x.dtype}, {residual.dtype}, "
                             f"{out.dtype}, {residual_out.dtype}")
        tensors.update(residual=residual, residual_out=residual_out)
    elif residual_out is not None:
        raise ValueError("residual_out given without a residual")
    check_same_device(**tensors)
    if T == 0:
        return out, residual_out
    res, res_out = (residual, residual_out) if residual is not None else (x, out)  # unread when not HAS_RESIDUAL
    block = next_pow2(H)
    fused_add_rmsnorm_kernel[(T,)](
        x, res, weight, out, res_out,
        H, float(eps),
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_H=block,
        num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False, **launch_args(x.device),
    )
    return out, residual_out


def fused_add_rmsnorm_ref(x, residual, weight, eps):
    """The unfused path (layers/norm.py's ops after the decoder's residual add); kernels import no models,
    so it is written out here and tests/kernels/test_fused_ops.py checks it against RMSNorm itself."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    ss = (xf * xf).sum(-1, keepdim=True, dtype=torch.float64)
    inv = torch.rsqrt(((ss * (1.0 / x.shape[-1])).float() + eps).double()).float()
    return weight * (xf * inv).to(x.dtype), residual
