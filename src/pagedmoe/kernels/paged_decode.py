"""Triton paged-attention decode: one query token per sequence over its paged KV context.

Shapes: B sequences, Hq query heads, Hkv KV heads, G = Hq // Hkv (GQA group), D head_dim,
S context splits. q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D] (``attention_ref.py``).

One program owns (sequence, KV head, split): it loads the G query heads that share the KV head as
one [G, D] tile, so each KV byte is read once per group. When B * Hkv programs cannot fill the GPU
(small batch, long context), the context is split into S partitions (flash-decoding); each writes
its normalised partial output and its softmax max/sum, and a second kernel merges the S partials.
Reference: ``attention_ref.paged_attention_ref`` with one token per sequence.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device_info import sm_count
from ._attention_checks import (
    check_block_tables, check_caches, check_index, check_out, check_query, check_same_device, dot_precision,
    next_pow2,
)
from .pdl import launch_args, pdl_enter

# Splitting: no partition shorter than one 64-token tile. Small batches are latency-bound, so more
# programs with shorter partitions win: H200, Mixtral shape, batch 1 at context 1024 took 11.0 µs with
# 4 splits of 256 tokens and 7.4 µs with 16 of 64 (benchmarks/bench_attention.py, commit 00baad4).
MIN_PARTITION_TOKENS = 64
MAX_SPLITS = 64
# A finite "minus infinity": max/exp2 stay NaN-free for rows that see no key (empty splits, seq_len 0).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def paged_attention_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    scale_log2e, partition_size, block_size,
    stride_q_b, stride_q_h,
    stride_k_blk, stride_k_tok, stride_k_h,
    stride_v_blk, stride_v_tok, stride_v_h,
    stride_bt_b,
    stride_o_b, stride_o_h,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * partition_size
    # The last split runs to seq_len, so a max_seq_len hint that is too small costs speed, never keys.
    end = tl.minimum(start + partition_size, seq_len)
    if split == num_splits - 1:
        end = seq_len

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_h * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    k_base = k_cache_ptr + kv_h.to(tl.int64) * stride_k_h
    v_base = v_cache_ptr + kv_h.to(tl.int64) * stride_v_h
    bt_row = block_tables_ptr + b64 * stride_bt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # Per-token block lookup: any block size works, and a tile may span several cache blocks.
        blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
        tok = (offs_n % block_size).to(tl.int64)
        if HEAD_DIM == HEAD_DIM_PAD:
            kv_mask = n_mask[:, None]  # no column mask: keeps the 16-byte row loads obvious to the compiler
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + (blk * stride_k_blk + tok * stride_k_tok)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [G, N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (blk * stride_v_blk + tok * stride_v_tok)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i == 0 only when this program saw no key (seq_len 0 or an empty split): output zeros.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        row = (b64 * (tl.num_programs(1) * GROUP) + heads) * num_splits + split  # [B, Hq, S]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
    else:
        tl.store(out_ptr + b64 * stride_o_b + heads[:, None] * stride_o_h + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def paged_attention_decode_reduce_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr,
    num_splits, stride_o_b, stride_o_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    # One program per (sequence, query head): merge S normalised partials by their softmax mass.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    m = tl.load(part_m_ptr + row0 + offs_s, mask=s_mask, other=NEG_BIG)
    l = tl.load(part_l_ptr + row0 + offs_s, mask=s_mask, other=0.0)
    w = l * tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w, 0)
    w = w / tl.where(denom > 0, denom, 1.0)
    d_mask = offs_d < HEAD_DIM
    o = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, 0)
    tl.store(out_ptr + b * stride_o_b + h * stride_o_h + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): enough programs for ~2 per SM, partitions >= MIN_PARTITION_TOKENS.

    Batch 64 x 8 KV heads at context 1024 already fills an H200 (1 split, 0.93 of the HBM floor);
    batch 1 at 8k takes 33 splits (0.43 of the floor, latency-bound at 19 µs).
    """
    by_length = math.ceil(max(max_seq_len, 1) / MIN_PARTITION_TOKENS)
    by_occupancy = math.ceil(2 * num_sms / max(num_programs, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence, at position seq_len - 1) over its context.

    seq_lens [B] int32 include this token (its K/V must already be in the cache); block_tables
    [B, max_blocks] int32. max_seq_len (host int, optional) is an upper bound of seq_lens used to
    size the split-K grid; without it the block table's width bounds the context. A hint that is
    too small is still correct (the last split runs to seq_len), only slower. num_splits, block_n,
    num_warps, num_stages override the tuning (benchmarks). Returns out [B, Hq, D] in q's dtype.
    """
    _, block_size, num_kv_heads, head_dim = check_caches(k_cache, v_cache)
    num_seqs, group = check_query(q, k_cache)
    check_index(seq_lens, "seq_lens", 1)
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"decode takes one query token per sequence: q has {num_seqs} tokens, "
                         f"seq_lens {seq_lens.shape[0]} sequences")
    check_block_tables(block_tables, num_seqs)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens)
    out = check_out(out, q)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    head_dim_pad = max(16, next_pow2(head_dim))
    if block_n is None:
        if q.dtype == torch.float32:  # exact fp32 dots run on FMA units: smaller tiles keep them out of spills
            block_n = 32 if head_dim_pad <= 64 else 16
        else:
            block_n = 64 if head_dim_pad <= 128 else 32
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads, max_seq_len, sm_count(q.device))
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in 1..1024, got {num_splits}")
    partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = min(num_splits, triton.cdiv(max(max_seq_len, 1), partition))
    split = num_splits > 1
    num_heads = q.shape[1]
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused (SPLIT is False)
    paged_attention_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_m, part_l,
        scale * math.log2(math.e), partition, block_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=block_n, SPLIT=split, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **launch_args(q.device),
    )
    if split:
        paged_attention_decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_m, part_l, out,
            num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=next_pow2(num_splits),
            num_warps=4, **launch_args(q.device),
        )
    return out
