"""RMSNorm in float32 and cast back, as the HF reference does, with its mean of squares made exact.

HF takes ``xf.pow(2).mean(-1)`` in float32, whose rounding depends on the order of the sum (CPU, CUDA and
a fused kernel each add in their own order). Here the float32 squares are summed in float64, then
scaled by 1/H and rounded to float32 once: for bf16 / fp16 inputs every square is exact in float32 and
their float64 sum exact (or off by less than 2^-52 of it, which rounding to float32 hides), so the
result no longer depends on the order and the fused kernel (kernels/fused_norm.py) reproduces it bit
for bit. rsqrt is taken in float64 and rounded to float32: torch's float32 rsqrt is an approximation on
CUDA and its float32 sqrt on CPU is off by a hair at near-ties, but float64 roots within an ulp of
float64 round to the same float32 (but for odds of about 2^-28). Against HF's float32 ops: within 1 ulp
of float32. Nine small kernels where HF's takes eight (the fused kernel takes one).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedmoe.parallel.state import all_reduce


def rms_inv(xf: torch.Tensor, eps: float, n: int = 0) -> torch.Tensor:
    """xf float32 [..., N] -> 1 / sqrt(mean(xf^2) + eps) [..., 1] float32, the mean over n (N if 0)
    elements; op for op what the fused kernels compute (fused_norm.rms_inv_tile)."""
    ss = (xf * xf).sum(-1, keepdim=True, dtype=torch.float64)
    return _inv_of_sum(ss, eps, n or xf.shape[-1])


@torch.no_grad()  # out= below (one kernel per step, each casting on its write); the engine never trains
def _inv_of_sum(ss: torch.Tensor, eps: float, n: int) -> torch.Tensor:
    var = torch.empty_like(ss, dtype=torch.float32)
    torch.mul(ss, 1.0 / n, out=var)             # float64 product, rounded to float32
    var_eps = torch.empty_like(ss)
    torch.add(var, eps, out=var_eps)            # float32 sum, widened exactly
    return torch.rsqrt(var_eps, out=var)        # float64 root, rounded to float32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, shards: int = 1) -> None:
        """`shards` > 1: x is one rank's slice of a vector split over that many ranks (OLMoE's norm over all
        q / k heads under tensor parallelism); the mean of squares is summed over the ranks."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.shards = eps, shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        if self.shards > 1:
            ss = all_reduce((xf * xf).sum(-1, keepdim=True, dtype=torch.float64))
            inv = _inv_of_sum(ss, self.eps, xf.shape[-1] * self.shards)
        else:
            inv = rms_inv(xf, self.eps)
        return self.weight * (xf * inv).to(dtype)
