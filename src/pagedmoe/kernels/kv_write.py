"""Triton KV-cache write: scatter this step's k, v [T, Hkv, D] into the paged caches.

Layout as in ``attention_ref.py``: caches [num_blocks, block_size, Hkv, D], slot = block * block_size
+ offset, slot < 0 = do not write (padding tokens). Reference: ``attention_ref.write_kv_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_checks import INDEX_DTYPES, check_caches, check_float, check_index, check_same_device, next_pow2


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    block_size,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_blk, stride_kc_tok, stride_kc_h,
    stride_vc_blk, stride_vc_tok, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # One program per token: all KV heads of the token, [Hkv, D], in one tile.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, NUM_KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok
    vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok
    tl.store(kc + offs_h[:, None] * stride_kc_h + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k, v [T, Hkv, D] into k_cache, v_cache at slot_mapping [T] (int32/int64; < 0 skipped).

    Values are cast to the cache dtype. Slots must be < num_blocks * block_size (not checked: that
    would need a host sync); two tokens with one slot leave either value.
    """
    _, block_size, num_kv_heads, head_dim = check_caches(k_cache, v_cache)
    check_float(k, "k", 3)
    check_float(v, "v", 3)
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k must be [T, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(k.shape)}")
    check_index(slot_mapping, "slot_mapping", 1, INDEX_DTYPES)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, want one per token ({k.shape[0]})")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def write_latent(latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """MLA: scatter latent [T, L] (L <= 2D) into the split cache pair [num_blocks, block_size, 1, D] at
    slot_mapping (< 0 skipped) with write_kv: the first D values to k_cache, the rest (zero-padded to D)
    to v_cache. No host sync, unlike the reference's boolean indexing. Reference:
    ``attention_ref.write_latent_ref``."""
    D = k_cache.shape[-1]
    if latent.dim() != 2 or not D < latent.shape[1] <= 2 * D:
        raise ValueError(f"latent must be [T, L] with {D} < L <= {2 * D}, got {tuple(latent.shape)}")
    hi = latent[:, D:]
    if hi.shape[1] < D:
        hi = torch.nn.functional.pad(hi, (0, D - hi.shape[1]))
    write_kv(latent[:, :D].contiguous().unsqueeze(1), hi.contiguous().unsqueeze(1), k_cache, v_cache, slot_mapping)
