"""Triton skinny GEMM for the decode step's backbone linears: y = x @ W^T (+ bias) for M <= 16 tokens.

At decode sizes a linear layer is a read of its weight: x [M, K] is a few KB, W [N, K] is MBs (Qwen3-30B-A3B's
lm_head 622 MB). cuBLAS's M=1 kernels reach about 35% of the H200's HBM bandwidth on these shapes
(profile_step.py, issue 25); what decides the speed is keeping enough weight bytes in flight on every SM.
Each program streams a [BLOCK_N, K / SPLIT_K] slab of W (rows contiguous in K: coalesced 16-byte loads,
software-pipelined over num_stages) and multiplies it by the whole x, padded to BLOCK_M = 16 rows (the
smallest tile tl.dot takes; the padding costs tensor-core work, not bytes). Narrow N (o_proj: N 2048,
K 4096) gives too few column tiles to fill 132 SMs, so K is split: each split writes its float32 partial
sums to a workspace and a second kernel adds them in split order (no atomics: the output is the same
bits on every run, as CUDA-graph replays of one batch must be). Accumulation is float32 for every dtype;
float32 inputs multiply in IEEE float32 (no TF32), as torch's default matmul does.

No host sync, no autotuning (a first-call benchmark would run inside CUDA-graph capture): the tiles come
from `small_gemm_config`, a rule over (N, K) and the SM count. Reference: ``small_gemm_ref``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ._attention_checks import check_float, check_same_device, next_pow2
from .device_info import sm_count
from .pdl import launch_args, pdl_enter

MAX_M = 16  # decode batches up to this many tokens; larger ones are compute-shaped and cuBLAS's
BLOCK_M = 16


@dataclass(frozen=True)
class SmallGemmConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def small_gemm_config(N: int, K: int, num_sms: int = 132) -> SmallGemmConfig:
    """Tiles for W [N, K]. Enough programs to cover every SM about twice (a program's loads in flight are
    what hides HBM latency), each split at least four BLOCK_K steps deep so the pipeline has a body and the
    workspace traffic stays small against W's. Qwen3-30B-A3B: qkv (5120, 2048) -> 80 tiles x split 4;
    o (2048, 4096) -> 32 x 8; router (128, 2048) -> 8 x 4 at block_n 16; lm_head (151936, 2048) -> 2374 x 1."""
    block_n = 16 if N <= 256 else 32 if N <= 1024 else 64
    block_k = max(16, min(128, next_pow2(K)))
    n_tiles = -(-N // block_n)
    k_steps = -(-K // block_k)
    split = next_pow2(max(1, -(-2 * num_sms // n_tiles)))
    split = max(1, min(split, 16, k_steps // 4))
    split = 1 << (split.bit_length() - 1)  # a power of two after the cap as well
    return SmallGemmConfig(block_n, block_k, split)


@triton.jit
def small_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # Program (n tile, k split): out[:, n tile] (PARTIAL: workspace[split, :, n tile]) = x[:, ks] @ W[n tile, ks]^T
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # int64: a vocabulary x hidden can pass 2^31
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:  # k_per_split is a multiple of BLOCK_K and K of k_per_split: no K masks
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            in_k = offs_k < k_hi
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & in_k[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def small_gemm_reduce_kernel(
    ws_ptr, b_ptr, out_ptr, M, N, stride_ws, stride_wm, stride_om,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # The second reduction: out[:, n tile] = sum over splits 0, 1, ... in that order (+ bias), one rounding.
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    ptrs = ws_ptr + offs_m[:, None] * stride_wm + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * stride_ws, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               config: Optional[SmallGemmConfig] = None) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K] (nn.Linear's layout), bias [N] or None -> [M, N] in x's dtype.

    x and weight share a float dtype (float16, bfloat16, float32) and take any row stride with unit stride
    along K (a row slice of a larger weight works); bias any float dtype. `config` overrides the tile rule
    (benchmarks/bench_small_gemm.py sweeps it)."""
    check_float(x, "x", 2)
    check_float(weight, "weight", 2)
    M, K = x.shape
    N = weight.shape[0]
    if not 0 < M <= MAX_M:
        raise ValueError(f"small_gemm takes 1..{MAX_M} rows, got x of shape {tuple(x.shape)}")
    if weight.shape[1] != K:
        raise ValueError(f"weight must be [N, {K}] (x is [{M}, {K}]), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    tensors = dict(x=x, weight=weight)
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != N or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous [{N}] tensor, got shape {tuple(bias.shape)}")
        tensors["bias"] = bias
    check_same_device(**tensors)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if N == 0 or K == 0:  # nothing to read: x @ W^T is zeros
        out.zero_()
        return out if bias is None else out.add_(bias)
    cfg = config or small_gemm_config(N, K, sm_count(x.device))
    k_per_split = -(-K // (cfg.split_k * cfg.block_k)) * cfg.block_k
    split = -(-K // k_per_split)  # splits that hold any K (a config's split may exceed what K fills)
    even_k = K % k_per_split == 0
    n_tiles = triton.cdiv(N, cfg.block_n)
    b = bias if bias is not None else x  # unread when not HAS_BIAS
    meta = dict(FP32_DOT=x.dtype == torch.float32, EVEN_K=even_k, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_args(x.device))
    if split == 1:
        small_gemm_kernel[(n_tiles, 1)](x, weight, b, out, M, N, K, k_per_split, x.stride(0), weight.stride(0),
                                        out.stride(0), 0, HAS_BIAS=bias is not None, PARTIAL=False, **meta)
        return out
    # NOTE: a fresh workspace per call: under CUDA-graph capture it comes from the graph's private pool
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    small_gemm_kernel[(n_tiles, split)](x, weight, b, ws, M, N, K, k_per_split, x.stride(0), weight.stride(0),
                                        ws.stride(1), ws.stride(0), HAS_BIAS=False, PARTIAL=True, **meta)
    reduce_n = 128
    small_gemm_reduce_kernel[(triton.cdiv(N, reduce_n),)](
        ws, b, out, M, N, ws.stride(0), ws.stride(1), out.stride(0),
        SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=reduce_n, num_warps=4,
        **launch_args(x.device))
    return out


def small_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 reference of x @ W^T + bias (the tests' yardstick; the kernel's float32 sums sit within it)."""
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y
