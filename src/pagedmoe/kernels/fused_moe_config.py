"""Tiles and argument checks of the fused MoE kernels (kernels/fused_moe.py): the tile table by problem
size and the shape/dtype/device checks every launcher runs before it launches. Never reads device data.

Shapes: T tokens, A experts per token, E experts, H hidden, I expert intermediate size.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from ._attention_checks import check_float, check_index, check_same_device

__all__ = ["FusedMoEConfig", "expected_blocks", "choose_split_k", "default_config", "check_moe_args"]


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tiles of the two GEMMs. block_n/block_k/num_* : w13 GEMM (columns of I); *2: w2 GEMM (columns of H)."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    block_n2: int = 64
    block_k2: int = 128
    num_warps2: int = 4
    num_stages2: int = 4
    split_k: int = 0        # partitions of I in the w2 GEMM; 0: chosen by occupancy (choose_split_k)
    swap_ab: bool = False   # dot(w, a^T): the weight tile on the MMA's M side (both GEMMs)
    # w2 split boundaries (and choose_split_k's lengths) in multiples of this many K; 0: block_k2. Lets a
    # kernel take narrower K steps than another yet split K where it does, so the partial sums are the same.
    split_step: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "block_n2", "block_k2"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {v}")
        for name in ("num_warps", "num_warps2"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"{name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)}")
        if self.num_stages < 1 or self.num_stages2 < 1 or not 0 <= self.split_k <= 64:
            raise ValueError(f"bad stages/split_k in {self}")
        if self.split_step < 0 or self.split_step % self.block_k2:
            raise ValueError(f"split_step must be 0 or a multiple of block_k2 {self.block_k2}, got {self.split_step}")


def expected_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> float:
    """Blocks a uniform routing fills: touched experts, or slots / block_m when blocks are full."""
    touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
    return max(touched, num_tokens * top_k / block_m, 1.0)


def choose_split_k(num_programs: float, k: int, block_k: int, num_sms: int) -> int:
    """w2 GEMM splits: ~4 programs per SM, each split at least 4 BLOCK_K steps long."""
    by_occupancy = math.ceil(4 * num_sms / max(num_programs, 1.0))
    by_length = max(1, k // (4 * block_k))
    return max(1, min(by_occupancy, by_length, 16))


def default_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                   dtype: torch.dtype, num_sms: int = 132) -> FusedMoEConfig:
    """The tile table by problem size (H200 defaults; benchmarks/bench_fused_moe.py sweeps them)."""
    if dtype == torch.float32:  # exact fp32 dots run on FMA units (and in the interpreter): small tiles
        return FusedMoEConfig(block_m=16, block_n=64, block_k=64, num_stages=2,
                              block_n2=64, block_k2=64, num_stages2=2, split_k=0)
    rows = num_tokens * top_k / num_experts  # mean slots per expert
    # One block per expert when the mean allows (each weight tile read by one program); the padding
    # rows cost MMA work only, which decode sizes have to spare.
    block_m = 16 if rows <= 12 else 32 if rows <= 24 else 64
    blocks = expected_blocks(num_tokens, top_k, num_experts, block_m)
    # Narrow column slices when few blocks are in play: ~2 programs per SM or more. The w2 GEMM
    # counts its K splits first (long I: Mixtral at T=1 splits 14336 five ways rather than narrowing).
    block_n = next((b for b in (64, 32) if blocks * triton.cdiv(inter, b) >= 2 * num_sms), 16)
    max_splits = choose_split_k(0.0, inter, 128, num_sms)
    block_n2 = next((b for b in (64, 32) if blocks * triton.cdiv(hidden, b) * max_splits >= 2 * num_sms), 16)
    return FusedMoEConfig(block_m=block_m, block_n=block_n, block_k=64, num_warps=4, num_stages=4,
                          block_n2=block_n2, block_k2=128, num_warps2=4, num_stages2=4, split_k=0)


def check_moe_args(x, w13, w2, topk_weights, topk_ids) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes, unit last strides, one device; never reads device data. -> (T, A, E, H, I)."""
    check_float(x, "x", 2)
    check_float(w13, "w13", 3)
    check_float(w2, "w2", 3)
    check_float(topk_weights, "topk_weights", 2)
    check_index(topk_ids, "topk_ids", 2, (torch.int32, torch.int64))
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13, w2 dtypes differ: {x.dtype}, {w13.dtype}, {w2.dtype}")
    E, two_i, H = w13.shape
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13 must be [E, 2I, H] with I >= 1, got {tuple(w13.shape)}")
    I = two_i // 2
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 must be [E, H, I] = {(E, H, I)} to match w13 {tuple(w13.shape)}, got {tuple(w2.shape)}")
    T = x.shape[0]
    if x.shape[1] != H:
        raise ValueError(f"x hidden size {x.shape[1]} differs from the experts' {H}")
    if topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={T}, A]")
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused_moe runs on CUDA (or under TRITON_INTERPRET=1), got {x.device}")
    return T, topk_ids.shape[1], E, H, I
