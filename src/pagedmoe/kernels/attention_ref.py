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


# NOTE: the MLA paths below bound their float32 transients (scores [Hq, q, S], expanded k/v, gathered
# latents) to about this many elements per tensor by chunking queries or sequences, so a long prompt
# or a large decode batch costs a few hundred MiB of scratch, not gigabytes the memory plan never saw.
MLA_CHUNK_ELEMS = 1 << 26


def _absorbed_cheaper(q_len: int, seq_len: int, heads: int, R: int, Dn: int, Dr: int, Dv: int,
                      max_elems: int = MLA_CHUNK_ELEMS) -> bool:
    """Whether attending in the latent space beats expanding the cached latents (FLOPs / 2); always
    when the expanded k_nope / v [S, Hq, Dn + Dv] would exceed the scratch bound."""
    if seq_len * heads * (Dn + Dv) > max_elems:
        return True
    expand = seq_len * R * heads * (Dn + Dv) + q_len * seq_len * heads * (Dn + Dr + Dv)
    absorb = q_len * heads * R * (Dn + Dv) + q_len * seq_len * heads * (2 * R + Dr)
    return absorb < expand


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      kv_b_weight: torch.Tensor, kv_lora_rank: int, v_head_dim: int,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, absorb: "bool | None" = None,
                      max_elems: int = MLA_CHUNK_ELEMS) -> torch.Tensor:
    """Causal MLA over each sequence's paged latents. Returns [T, Hq, v_head_dim] in q's dtype.

    q_nope [T, Hq, Dn], q_pe [T, Hq, Dr] (roped); kv_b_weight [Hq * (Dn + Dv), kv_lora_rank] =
    per head W_k [Dn, R] over W_v [Dv, R]. In float32, one sequence at a time (its queries in chunks
    whose scores stay within max_elems), in one of two equal forms (absorb=None picks the one with
    fewer FLOPs for each sequence):
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
        use_absorb = absorb if absorb is not None else _absorbed_cheaper(q_len, seq_len, Hq, R, Dn, Dr,
                                                                        v_head_dim, max_elems)
        if not use_absorb:
            k_nope = torch.einsum("sr,hdr->shd", c, w_k)                           # [S, Hq, Dn]
            v = torch.einsum("sr,hdr->shd", c, w_v)                                # [S, Hq, Dv]
        k_pos = torch.arange(seq_len, device=q_nope.device).unsqueeze(0)
        step = max(1, max_elems // (Hq * seq_len))
        for qs in range(s, e, step):
            qe = min(qs + step, e)
            qn, qp = q_nope[qs:qe].float(), q_pe[qs:qe].float()
            if use_absorb:
                q_lat = torch.einsum("qhd,hdr->qhr", qn, w_k)                      # [q, Hq, R]
                scores = torch.einsum("qhr,sr->hqs", q_lat, c) + torch.einsum("qhd,sd->hqs", qp, k_pe)
            else:
                scores = torch.einsum("qhd,shd->hqs", qn, k_nope) + torch.einsum("qhd,sd->hqs", qp, k_pe)
            q_pos = torch.arange(seq_len - q_len + qs - s, seq_len - q_len + qe - s,
                                 device=q_nope.device).unsqueeze(1)
            probs = torch.softmax((scores * scale).masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
            if use_absorb:
                o_lat = torch.einsum("hqs,sr->qhr", probs, c)                      # [q, Hq, R]
                out[qs:qe] = torch.einsum("qhr,hdr->qhd", o_lat, w_v).to(out.dtype)
            else:
                out[qs:qe] = torch.einsum("hqs,shd->qhd", probs, v).to(out.dtype)
    return out


def mla_decode_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   kv_b_weight: torch.Tensor, kv_lora_rank: int, v_head_dim: int, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                   max_elems: int = MLA_CHUNK_ELEMS) -> torch.Tensor:
    """A decode-only step (one query token per sequence, T = B) in the absorbed form, sequences
    batched: their latents gathered into [b, max_seq_len, L] (b sequences at a time, within
    max_elems) and masked past each seq_len. No host sync (max_seq_len is the host's). Same result
    as mla_attention_ref."""
    B, Hq, Dn = q_nope.shape
    Dr = q_pe.shape[-1]
    R = kv_lora_rank
    block_size, D = k_cache.shape[1], k_cache.shape[-1]
    num_blocks = -(-max_seq_len // block_size)
    S = num_blocks * block_size
    w = kv_b_weight.float().view(Hq, Dn + v_head_dim, R)
    w_k, w_v = w[:, :Dn], w[:, Dn:]
    k_pos = torch.arange(max_seq_len, device=q_nope.device)
    out = torch.empty(B, Hq, v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
    step = max(1, max_elems // (S * max(2 * D, Hq)))
    for bs in range(0, B, step):
        be = min(bs + step, B)
        table = block_tables[bs:be, :num_blocks].long()
        lat = torch.cat((k_cache[table, :, 0], v_cache[table, :, 0]), dim=-1)   # [b, nb, bs, 2D]
        lat = lat.reshape(be - bs, S, 2 * D)[:, :max_seq_len, :R + Dr].float()
        c, k_pe = lat[..., :R], lat[..., R:]                                       # [b, S, R], [b, S, Dr]
        q_lat = torch.einsum("bhd,hdr->bhr", q_nope[bs:be].float(), w_k)
        scores = (torch.einsum("bhr,bsr->bhs", q_lat, c)
                  + torch.einsum("bhd,bsd->bhs", q_pe[bs:be].float(), k_pe))
        mask = k_pos[None, :] >= seq_lens[bs:be, None].long()                      # [b, S]
        probs = torch.softmax((scores * scale).masked_fill(mask[:, None, :], float("-inf")), dim=-1)
        o_lat = torch.einsum("bhs,bsr->bhr", probs, c)
        out[bs:be] = torch.einsum("bhr,hdr->bhd", o_lat, w_v).to(out.dtype)
    return out
