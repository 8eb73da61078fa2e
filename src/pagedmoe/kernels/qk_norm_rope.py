"""Triton fused per-head q/k RMSNorm + RoPE + paged KV write: one kernel in place of five to eight.

Unfused (layers/attention.py): q_norm, k_norm (Qwen3, GLM-4.5 with use_qk_norm), the rotary of
layers/rotary.py (half-split "neox" layout, optionally partial: only the first rotary_dim dims of each
head rotate, GLM-4.5), then write_kv (kv_write.py). Here one program per token does all of it for every
q and k head: q is written rotated (in place when ``q_out`` is q), k rotated and v as they are go straight
into the paged caches at the token's slot (slot < 0: padding, nothing written to the caches).

Rounding follows the torch ops: the norm is layers/norm.py's (float64 sum of the float32 squares, 1 / sqrt:
fused_norm.rms_inv_tile) and casts to the model dtype before its weight, cos/sin are cast to the model
dtype, and each product and sum of the rotation rounds to the model dtype; fp fusion is off (no FMA
merges what torch rounds apart). So the outputs are bit-exact against the unfused path (float32 inputs:
but for odds of about 2^-28 a head, fused_norm.py says why). DeepSeek's interleaved rope (MLA) is not handled here.
Reference: ``qk_norm_rope_kv_ref``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._attention_checks import (
    INDEX_DTYPES, check_caches, check_float, check_index, check_same_device, next_pow2,
)
from .fused_norm import rms_inv_tile
from .pdl import launch_args, pdl_enter


@triton.jit
def _norm_rope_heads(x_ptr, stride_h, w_ptr, cos, sin, eps,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HALF: tl.constexpr, HALF_PAD: tl.constexpr, TAIL: tl.constexpr, TAIL_PAD: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    """Rows [NUM_HEADS] of one token -> (rotated first half, rotated second half, tail), model dtype."""
    dt = x_ptr.dtype.element_ty
    offs_h = tl.arange(0, HEADS_PAD)
    offs_r = tl.arange(0, HALF_PAD)
    offs_t = tl.arange(0, TAIL_PAD)
    mask_h = offs_h < NUM_HEADS
    m_rot = mask_h[:, None] & (offs_r < HALF)[None, :]
    m_tail = mask_h[:, None] & (offs_t < TAIL)[None, :]
    rows = x_ptr + offs_h[:, None] * stride_h
    x1 = tl.load(rows + offs_r[None, :], mask=m_rot, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + offs_r[None, :], mask=m_rot, other=0.0).to(tl.float32)
    xt = tl.load(rows + 2 * HALF + offs_t[None, :], mask=m_tail, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = (tl.sum((x1 * x1).to(tl.float64), axis=1) + tl.sum((x2 * x2).to(tl.float64), axis=1)
              + tl.sum((xt * xt).to(tl.float64), axis=1))
        inv = rms_inv_tile(ss, tl.full([], HEAD_DIM, tl.float64), eps)[:, None]
        w1 = tl.load(w_ptr + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)[None, :]
        wt = tl.load(w_ptr + 2 * HALF + offs_t, mask=offs_t < TAIL, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xt = (wt * (xt * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded as torch's is.
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    return o1, o2, xt.to(dt)


@triton.jit
def _store_heads(ptr, stride_h, o1, o2, ot, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, TAIL: tl.constexpr, TAIL_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_r = tl.arange(0, HALF_PAD)
    offs_t = tl.arange(0, TAIL_PAD)
    mask_h = offs_h < NUM_HEADS
    m_rot = mask_h[:, None] & (offs_r < HALF)[None, :]
    rows = ptr + offs_h[:, None] * stride_h
    tl.store(rows + offs_r[None, :], o1, mask=m_rot)
    tl.store(rows + HALF + offs_r[None, :], o2, mask=m_rot)
    if TAIL > 0:
        tl.store(rows + 2 * HALF + offs_t[None, :], ot, mask=mask_h[:, None] & (offs_t < TAIL)[None, :])


@triton.jit
def qk_norm_rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, cos_sin_ptr, pos_ptr, qw_ptr, kw_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    eps, block_size, cos_sin_half, stride_cs_p,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_qo_t, stride_qo_h,
    stride_kc_blk, stride_kc_tok, stride_kc_h, stride_vc_blk, stride_vc_tok, stride_vc_h,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    TAIL: tl.constexpr, TAIL_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    # cos/sin [2, P, rotary_dim] float32, both halves equal (emb = cat(freqs, freqs)); cast as the torch path.
    cs = cos_sin_ptr + pos * stride_cs_p + offs_r
    cos = tl.load(cs, mask=offs_r < HALF, other=0.0).to(dt).to(tl.float32)[None, :]
    sin = tl.load(cs + cos_sin_half, mask=offs_r < HALF, other=0.0).to(dt).to(tl.float32)[None, :]

    q1, q2, qt = _norm_rope_heads(q_ptr + t * stride_q_t, stride_q_h, qw_ptr, cos, sin, eps,
                                  NUM_Q_HEADS, Q_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, TAIL, TAIL_PAD, HAS_NORM)
    _store_heads(q_out_ptr + t * stride_qo_t, stride_qo_h, q1, q2, qt,
                 NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD, TAIL, TAIL_PAD)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        k1, k2, kt = _norm_rope_heads(k_ptr + t * stride_k_t, stride_k_h, kw_ptr, cos, sin, eps,
                                      NUM_KV_HEADS, KV_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, TAIL, TAIL_PAD,
                                      HAS_NORM)
        kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok
        ec = k_cache_ptr.dtype.element_ty
        _store_heads(kc, stride_kc_h, k1.to(ec), k2.to(ec), kt.to(ec),
                     NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD, TAIL, TAIL_PAD)
        offs_h = tl.arange(0, KV_HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
        vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok
        tl.store(vc + offs_h[:, None] * stride_vc_h + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)


def _check_norm_weight(w: Optional[torch.Tensor], name: str, head_dim: int) -> None:
    if w is not None and (w.dim() != 1 or w.shape[0] != head_dim or not w.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor, got shape {tuple(w.shape)}")


def qk_norm_rope_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin: torch.Tensor, positions: torch.Tensor,
    q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor], eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    q_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hkv, D] -> q normed and rotated [T, Hq, D] (``q_out``, which may be q);
    k normed and rotated, and v, written into k_cache, v_cache [num_blocks, block_size, Hkv, D] at
    slot_mapping [T] (< 0 skipped). cos_sin: RotaryEmbedding.cos_sin [2, P, rotary_dim] float32;
    positions [T] < P (not checked: a host sync). q_weight / k_weight: the per-head RMSNorm weights [D],
    both or neither."""
    _, block_size, num_kv_heads, head_dim = check_caches(k_cache, v_cache)
    check_float(q, "q", 3)
    check_float(k, "k", 3)
    check_float(v, "v", 3)
    T = q.shape[0]
    if tuple(k.shape) != (T, num_kv_heads, head_dim) or k.shape != v.shape:
        raise ValueError(f"k and v must be [T={T}, {num_kv_heads}, {head_dim}] to match the cache, got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [T, a multiple of {num_kv_heads} heads, {head_dim}], got {tuple(q.shape)}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cos_sin.dim() != 3 or cos_sin.shape[0] != 2 or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError(f"cos_sin must be a contiguous float32 [2, P, rotary_dim], got {tuple(cos_sin.shape)} "
                         f"{cos_sin.dtype}")
    rotary_dim = cos_sin.shape[2]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight (per-head q/k RMSNorm) or neither")
    _check_norm_weight(q_weight, "q_weight", head_dim)
    _check_norm_weight(k_weight, "k_weight", head_dim)
    check_index(positions, "positions", 1, INDEX_DTYPES)
    check_index(slot_mapping, "slot_mapping", 1, INDEX_DTYPES)
    if positions.shape[0] != T or slot_mapping.shape[0] != T:
        raise ValueError(f"positions and slot_mapping need one entry per token ({T}), got "
                         f"{positions.shape[0]} and {slot_mapping.shape[0]}")
    q_out = torch.empty_like(q) if q_out is None else q_out
    if q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(-1) != 1:
        raise ValueError(f"q_out must match q ({tuple(q.shape)}, {q.dtype}, unit last stride)")
    has_norm = q_weight is not None
    check_same_device(q=q, k=k, v=v, cos_sin=cos_sin, positions=positions, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping, q_out=q_out,
                      **({"q_weight": q_weight, "k_weight": k_weight} if has_norm else {}))
    if T == 0:
        return q_out
    half, tail = rotary_dim // 2, head_dim - rotary_dim
    qw, kw = (q_weight, k_weight) if has_norm else (q, k)  # unread without the norm
    num_q_heads = q.shape[1]
    qk_norm_rope_kv_kernel[(T,)](
        q, k, v, q_out, cos_sin, positions, qw, kw, k_cache, v_cache, slot_mapping,
        float(eps), block_size, cos_sin.stride(0), cos_sin.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=next_pow2(num_q_heads),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), HALF=half, HALF_PAD=next_pow2(half),
        TAIL=tail, TAIL_PAD=next_pow2(max(tail, 1)), HAS_NORM=has_norm,
        num_warps=4 if num_q_heads * head_dim >= 2048 else 1, enable_fp_fusion=False, **launch_args(q.device),
    )
    return q_out


def qk_norm_rope_kv_ref(q, k, v, cos_sin, positions, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping):
    """The unfused path op for op: per-head RMSNorm (layers/norm.py), RoPE (layers/rotary.py), write_kv_ref."""
    from pagedmoe.kernels.attention_ref import write_kv_ref
    from pagedmoe.kernels.fused_norm import fused_add_rmsnorm_ref

    def norm(x, w):  # layers/norm.py's RMSNorm over each head
        return fused_add_rmsnorm_ref(x, None, w, eps)[0]

    if q_weight is not None:
        q, k = norm(q, q_weight), norm(k, k_weight)
    r = cos_sin.shape[2]
    cos = cos_sin[0, positions].unsqueeze(1).to(q.dtype)
    sin = cos_sin[1, positions].unsqueeze(1).to(q.dtype)

    def rope(x):  # half-split rotation, as layers/rotary.py (kernels import no models: written out here)
        xr = x[..., :r]
        rotated = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), dim=-1)
        return torch.cat((xr * cos + rotated * sin, x[..., r:]), dim=-1)

    q, k = rope(q), rope(k)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q
