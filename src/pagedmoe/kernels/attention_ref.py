"""PyTorch reference for attention over the paged KV cache (CPU path and kernel tests).

Layout (shared with the Triton kernels in ``paged_attention.py``):
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer
  slot_mapping      [T] int64, slot = block_id * block_size + offset; -1 = do not write
  query_start_loc   [B + 1] int32, tokens of sequence b are q[query_start_loc[b]:query_start_loc[b+1]]
  seq_lens          [B] int32, context length of sequence b *including* this step's tokens
  block_tables      [B, max_blocks] int32, block ids of sequence b in order (padding ignored)

Causality: query token i of sequence b (0-based within its q_len) sits at position
seq_len - q_len + i and attends to key positions 0 .. seq_len - q_len + i.
"""
from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k, v [T, Hkv, D] into the caches at slot_mapping [T] (slots < 0 are skipped)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one sequence: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged context. Returns [T, Hq, D].

    Computes in float32 and casts back to q's dtype. GQA: query head h reads KV head h // (Hq // Hkv).
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_b = q[starts[b]:starts[b + 1]].float()  # [Q, Hq, D]
        q_len = q_b.shape[0]
        if q_len == 0:
            continue
        k_b = gather_kv_ref(k_cache, block_tables[b], seq_len).float()  # [S, Hkv, D]
        v_b = gather_kv_ref(v_cache, block_tables[b], seq_len).float()
        k_b = k_b.repeat_interleave(group, dim=1)
        v_b = v_b.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k_b) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[b]:starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v_b).to(q.dtype)
    return out
