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


def _absorbed_cheaper(q_len: int, seq_len: int, heads: int, R: int, Dn: int, Dr: int, Dv: int) -> bool:
    """Whether attending in the latent space beats expanding the cached latents (FLOPs / 2)."""
    expand = seq_len * R * heads * (Dn + Dv) + q_len * seq_len * heads * (Dn + Dr + Dv)
    absorb = q_len * heads * R * (Dn + Dv) + q_len * seq_len * heads * (2 * R + Dr)
    return absorb < expand


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      kv_b_weight: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, absorb: "bool | None" = None) -> torch.Tensor:
    """Causal MLA over each sequence's paged latents. Returns [T, Hq, v_head_dim] in q's dtype.

    q_nope [T, Hq, Dn], q_pe [T, Hq, Dr] (roped); kv_b_weight [Hq * (Dn + Dv), kv_lora_rank] =
    per head W_k [Dn, R] over W_v [Dv, R]. In float32, one sequence at a time, in one of two equal
    forms (absorb=None picks the one with fewer FLOPs for each sequence):
    - expanded (prefill): each cached latent c [R] becomes k_nope = W_k c and v = W_v c per head, as
      transformers does; scores q_nope . k_nope + q_pe . k_pe;
    - absorbed (decode): the query moves into the latent space, q_lat = W_k^T q_nope [R], scores
      q_lat . c + q_pe . k_pe, the output is W_v (sum_s p_s c_s): no per-token expansion.
    """
    T, Hq, Dn = q_nope.shape
    Dr = q_pe.shape[-1]
    R = kv_lora_rank
    w = kv_b_weight.float().view(Hq, Dn + v_head_dim, R)
    w_k, w_v = w[:, :Dn], w[:, Dn:]
    out = torch.empty(T, Hq, v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        lat = gather_latent_ref(k_cache, v_cache, block_tables[b], seq_len, R + Dr).float()
        c, k_pe = lat[:, :R], lat[:, R:]                                           # [S, R], [S, Dr]
        qn, qp = q_nope[s:e].float(), q_pe[s:e].float()
        use_absorb = absorb if absorb is not None else _absorbed_cheaper(q_len, seq_len, Hq, R, Dn, Dr,
                                                                        v_head_dim)
        if use_absorb:
            q_lat = torch.einsum("qhd,hdr->qhr", qn, w_k)                          # [Q, Hq, R]
            scores = torch.einsum("qhr,sr->hqs", q_lat, c) + torch.einsum("qhd,sd->hqs", qp, k_pe)
        else:
            k_nope = torch.einsum("sr,hdr->shd", c, w_k)                           # [S, Hq, Dn]
            scores = torch.einsum("qhd,shd->hqs", qn, k_nope) + torch.einsum("qhd,sd->hqs", qp, k_pe)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q_nope.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q_nope.device).unsqueeze(0)
        probs = torch.softmax((scores * scale).masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        if use_absorb:
            o_lat = torch.einsum("hqs,sr->qhr", probs, c)                          # [Q, Hq, R]
            out[s:e] = torch.einsum("qhr,hdr->qhd", o_lat, w_v).to(out.dtype)
        else:
            v = torch.einsum("sr,hdr->shd", c, w_v)                                # [S, Hq, Dv]
            out[s:e] = torch.einsum("hqs,shd->qhd", probs, v).to(out.dtype)
    return out


def mla_decode_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kv_b_weight: torch.Tensor, kv_lora_rank: int, v_head_dim: int, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """A decode-only step (one query token per sequence, T = B) in the absorbed form, all sequences
    at once: their latents gathered into [B, max_seq_len, L] and masked past each seq_len. No
    per-sequence loop and no host sync (max_seq_len is the host's). Same result as mla_attention_ref."""
    B, Hq, Dn = q_nope.shape
    Dr = q_pe.shape[-1]
    R = kv_lora_rank
    block_size, D = k_cache.shape[1], k_cache.shape[-1]
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks].long()
    lat = torch.cat((k_cache[table, :, 0], v_cache[table, :, 0]), dim=-1)        # [B, nb, bs, 2D]
    lat = lat.reshape(B, num_blocks * block_size, 2 * D)[:, :max_seq_len, :R + Dr].float()
    c, k_pe = lat[..., :R], lat[..., R:]                                           # [B, S, R], [B, S, Dr]
    w = kv_b_weight.float().view(Hq, Dn + v_head_dim, R)
    w_k, w_v = w[:, :Dn], w[:, Dn:]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope.float(), w_k)
    scores = torch.einsum("bhr,bsr->bhs", q_lat, c) + torch.einsum("bhd,bsd->bhs", q_pe.float(), k_pe)
    k_pos = torch.arange(max_seq_len, device=q_nope.device)
    mask = k_pos[None, :] >= seq_lens[:, None].long()                              # [B, S]
    probs = torch.softmax((scores * scale).masked_fill(mask[:, None, :], float("-inf")), dim=-1)
    o_lat = torch.einsum("bhs,bsr->bhr", probs, c)
    return torch.einsum("bhr,hdr->bhd", o_lat, w_v).to(q_nope.dtype)
