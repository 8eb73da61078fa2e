"""Triton paged-attention prefill: causal and chunked prefill over the paged KV cache.

Shapes: T query tokens of B sequences, Hq query heads, Hkv KV heads, G = Hq // Hkv, D head_dim.
q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; query_start_loc [B + 1]; seq_lens [B]
include this step's tokens (``attention_ref.py``). Query token i of sequence b sits at position
seq_len - q_len + i and sees keys 0 .. that position: the cached context plus its own chunk, so
chunked prefill and decode rows (q_len 1) mix freely in one batch.

One program owns (row tile, sequence, KV head). Its rows are (token, head-in-group) pairs
flattened token-major, so the G heads that share a KV head ride in one tile of BLOCK_M rows and
the KV is read once per group. Flash-attention online softmax over KV tiles of BLOCK_N positions,
read through the block table. Keys every row of the tile sees run without masks; the diagonal
tiles after them carry the causal mask. Reference: ``attention_ref.paged_attention_ref``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._attention_checks import (
    check_block_tables, check_caches, check_index, check_out, check_query, check_same_device, dot_precision,
    next_pow2,
)

NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" (see paged_decode.py)
RESCALE_LOG2 = tl.constexpr(8.0)  # lazy rescale (opt-in): the running max moves when a row's grows by more than 2^8


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, n0, bt_row, k_base, v_base, block_size,
    stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
    q_pos, kv_end, scale_log2e, offs_d, d_mask,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    if MASKED:
        blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + offs_n // block_size).to(tl.int64)
    tok = (offs_n % block_size).to(tl.int64)
    k_ptrs = k_base + (blk * stride_k_blk + tok * stride_k_tok)[:, None] + offs_d[None, :]
    v_ptrs = v_base + (blk * stride_v_blk + tok * stride_v_tok)[:, None] + offs_d[None, :]
    if MASKED:
        if HEAD_DIM == HEAD_DIM_PAD:
            k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        k = tl.load(k_ptrs)  # interior tile, full head: no mask at all
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N], unscaled
    if MASKED:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)  # log2 units (scale_log2e > 0: the max commutes)
    if LAZY_RESCALE:
        # The running max (and acc's scale) moves only when some row's grew by more than RESCALE_LOG2: below it,
        # p = 2^(s - m_i) stays <= 2^RESCALE_LOG2 (exact in fp32, and in bf16 / fp16 for the PV dot), and the
        # [BLOCK_M, HEAD_DIM] rescale of acc, a quarter of the tile's instructions at 32 keys, is skipped
        # whenever no row's max jumped. acc and l_i always share one scale, so acc / l_i is the same softmax.
        if tl.max(m_new - m_i, 0) > RESCALE_LOG2:
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
    else:
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s * scale_log2e - m_i[:, None])  # one FFMA a score
    l_i = l_i + tl.sum(p, 1)
    if MASKED:
        if HEAD_DIM == HEAD_DIM_PAD:
            v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def paged_attention_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale_log2e, block_size,
    stride_q_t, stride_q_h,
    stride_k_blk, stride_k_tok, stride_k_h,
    stride_v_blk, stride_v_tok, stride_v_h,
    stride_bt_b,
    stride_o_t, stride_o_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, LAZY_RESCALE: tl.constexpr = False,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kv_h = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    row0 = tile * BLOCK_M
    # The grid is sized by the longest query; shorter sequences' extra tiles leave at once.
    if row0 >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len  # positions cached before this step's tokens

    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    heads = kv_h * GROUP + rows % GROUP
    row_mask = tok < q_len
    q_pos = ctx_len + tok
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_q_t + heads * stride_q_h
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    k_base = k_cache_ptr + kv_h.to(tl.int64) * stride_k_h
    v_base = v_cache_ptr + kv_h.to(tl.int64) * stride_v_h
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt_b

    first_pos = ctx_len + row0 // GROUP  # the tile's earliest query position
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    kv_end = ctx_len + last_tok + 1  # keys past the tile's last query position are never seen
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # keys [0, full_end) are visible to every row
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, bt_row, k_base, v_base, block_size,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            q_pos, kv_end, scale_log2e, offs_d, d_mask,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, DOT_PRECISION, LAZY_RESCALE)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, bt_row, k_base, v_base, block_size,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
            q_pos, kv_end, scale_log2e, offs_d, d_mask,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, DOT_PRECISION, LAZY_RESCALE)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_o_t + heads * stride_o_h
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    lazy_rescale: bool = False,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged context; returns [T, Hq, D].

    This step's K/V must already be in the cache (``write_kv`` first). query_start_loc [B + 1] int32,
    seq_lens [B] int32, block_tables [B, max_blocks] int32; max_query_len (host int) is the longest
    q_len in the batch and sizes the grid: a smaller value leaves rows unwritten (not checked, that
    would need a host sync). block_m, block_n, num_warps, num_stages override the tuning. lazy_rescale=True
    moves the running max only when a row's grows by more than 2^8 (skipping acc's rescale otherwise): exact, but
    measured slower on the H100 at 8 x 1024 tokens (auto tiles 414.6 us against 269.1 for the default per-tile
    rescale, Qwen3-30B-A3B's shape; benchmarks/results/session31/issue25), so it is off by default.
    """
    _, block_size, num_kv_heads, head_dim = check_caches(k_cache, v_cache)
    _, group = check_query(q, k_cache)
    check_index(query_start_loc, "query_start_loc", 1)
    check_index(seq_lens, "seq_lens", 1)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have B + 1 = {num_seqs + 1} entries, got {query_start_loc.shape[0]}")
    check_block_tables(block_tables, num_seqs)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, seq_lens=seq_lens)
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a host int >= 0, got {max_query_len!r}")
    if max_query_len > q.shape[0]:
        raise ValueError(f"max_query_len {max_query_len} exceeds the number of query tokens {q.shape[0]}")
    out = check_out(out, q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    head_dim_pad = max(16, next_pow2(head_dim))
    fp32 = q.dtype == torch.float32  # exact fp32 dots run on FMA units: smaller tiles keep them out of spills
    # Half precision: 128 rows x 32 keys, 8 warps, 2 stages measured best of 38 tile variants at 8 x 1024 fresh
    # tokens, D 128, on the H200 (benchmarks/tune_prefill_attention.py: 270 us against 352 for 64 x 64 x 4 warps,
    # Qwen3-30B-A3B's Hkv 4 and Mixtral-8x7B's Hkv 8 alike), but with too few programs to fill the GPU it loses
    # (1 x 512 tokens, 128 programs: 26.9 us against 22.3): 128 rows only where that makes >= 1024 programs.
    wide = not fp32 and head_dim_pad <= 128 and q.shape[0] * q.shape[1] >= 1024 * 128
    if block_m is None:
        block_m = min((16 if head_dim_pad > 128 else 32) if fp32 else (128 if wide else 64),
                      max(16, next_pow2(max_query_len * group)))
    if block_n is None:
        if fp32:
            block_n = 32 if head_dim_pad <= 64 else 16
        elif block_m >= 128:
            block_n = 32
        else:
            block_n = 64 if head_dim_pad <= 128 else 32
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    grid = (triton.cdiv(max_query_len * group, block_m), num_seqs, num_kv_heads)
    paged_attention_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * math.log2(math.e), block_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype), LAZY_RESCALE=lazy_rescale,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
