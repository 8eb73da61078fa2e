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


# -- MLA (DeepSeek-V2/V3): the compressed latent in the paged cache -------------------------------
# Per token and layer the cache holds the latent [L] = kv_a_layernorm(c_kv) [kv_lora_rank] ++
# roped k_pe [qk_rope_head_dim]. NOTE: it is stored split across the layer's two cache tensors, the
# first D = ceil(L / 2) values in k_cache[..., 0, :] and the rest in v_cache[..., 0, :L - D], so
# the generic [num_blocks, block_size, 1, D] pair, its sizing (kv_cache.kv_bytes_per_block with one
# KV head of D) and the block tables serve MLA unchanged (models/deepseek.py sets Hkv = 1, D).

def write_latent_ref(latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Scatter latent [T, L] into the split cache pair at slot_mapping [T] (slots < 0 skipped)."""
    D = k_cache.shape[-1]
    lo, hi = latent[:, :D], latent[:, D:]
    if hi.shape[1] < D:  # odd L: the last element of v_cache's row is padding
        hi = torch.nn.functional.pad(hi, (0, D - hi.shape[1]))
    write_kv_ref(lo.unsqueeze(1), hi.unsqueeze(1), k_cache, v_cache, slot_mapping)


def gather_latent_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                      latent_dim: int) -> torch.Tensor:
    """The first seq_len latents of one sequence: [seq_len, L]."""
    lo = gather_kv_ref(k_cache, block_table, seq_len)[:, 0]
    hi = gather_kv_ref(v_cache, block_table, seq_len)[:, 0]
    return torch.cat((lo, hi), dim=-1)[:, :latent_dim]


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      kv_b_weight: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal MLA over each sequence's paged latents. Returns [T, Hq, v_head_dim] in q's dtype.

    q_nope [T, Hq, Dn], q_pe [T, Hq, Dr] (roped); kv_b_weight [Hq * (Dn + Dv), kv_lora_rank].
    Expands the latent of each cached token to per-head k_nope and v with kv_b_proj, as transformers
    does (the order of operations the golden tests compare against), in float32.
    """
    T, Hq, Dn = q_nope.shape
    Dr = q_pe.shape[-1]
    w = kv_b_weight.float().view(Hq, Dn + v_head_dim, kv_lora_rank)
    w_k, w_v = w[:, :Dn], w[:, Dn:]
    out = torch.empty(T, Hq, v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        lat = gather_latent_ref(k_cache, v_cache, block_tables[b], seq_len, kv_lora_rank + Dr).float()
        c, k_pe = lat[:, :kv_lora_rank], lat[:, kv_lora_rank:]                      # [S, R], [S, Dr]
        k_nope = torch.einsum("sr,hdr->shd", c, w_k)                               # [S, Hq, Dn]
        v = torch.einsum("sr,hdr->shd", c, w_v)                                    # [S, Hq, Dv]
        scores = (torch.einsum("qhd,shd->hqs", q_nope[s:e].float(), k_nope)
                  + torch.einsum("qhd,sd->hqs", q_pe[s:e].float(), k_pe)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q_nope.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q_nope.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hqs,shd->qhd", probs, v).to(out.dtype)
    return out
