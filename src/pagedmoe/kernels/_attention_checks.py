"""Argument checks shared by the paged-attention launchers (kv_write, paged_decode, paged_prefill).

Every check raises ValueError with the argument's name, the expected and the found value. None of
them reads a device tensor's contents (no host sync): only shapes, dtypes, strides and devices.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_float(t: torch.Tensor, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
    # NOTE: the kernels index the last dim with unit stride (vector loads); other dims take any stride.
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")


def check_index(t: torch.Tensor, name: str, ndim: int, dtypes=(torch.int32,)) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} dtype must be {names}, got {t.dtype}")
    if ndim == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if ndim == 2 and t.numel() > 0 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"all tensors must be on one device, got {devices}")
    return first


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Returns (num_blocks, block_size, num_kv_heads, head_dim) of [num_blocks, block_size, Hkv, D] caches."""
    check_float(k_cache, "k_cache", 4)
    check_float(v_cache, "v_cache", 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} has an empty block or head dim")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(q: torch.Tensor, k_cache: torch.Tensor, name: str = "q") -> tuple[int, int]:
    """q [T, Hq, D] against the cache: same dtype and head_dim, Hq a multiple of Hkv. Returns (T, group)."""
    check_float(q, name, 3)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dtype != k_cache.dtype:
        raise ValueError(f"{name} dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if q.shape[2] != head_dim:
        raise ValueError(f"{name} head_dim {q.shape[2]} differs from the cache head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0 or q.shape[1] == 0:
        raise ValueError(f"{name} heads ({q.shape[1]}) must be a positive multiple of the KV heads ({num_kv_heads})")
    return q.shape[0], q.shape[1] // num_kv_heads


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    check_float(out, "out", 3)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"want {tuple(q.shape)} {q.dtype} on {q.device}"
        )
    return out


def check_block_tables(block_tables: torch.Tensor, num_seqs: int) -> None:
    check_index(block_tables, "block_tables", 2)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, want one per sequence ({num_seqs})")


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs take exact fp32 products (the reference's numbers), not tf32's 10-bit mantissa.
    return "ieee" if dtype == torch.float32 else "tf32"
