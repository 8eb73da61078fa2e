"""RMSNorm computed in float32 and cast back, as the HF reference does."""
from __future__ import annotations

import torch
from torch import nn

from pagedmoe.parallel.state import all_reduce


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
            var = all_reduce(xf.pow(2).sum(-1, keepdim=True)) / (xf.shape[-1] * self.shards)
        else:
            var = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(var + self.eps)
        return self.weight * xf.to(dtype)
