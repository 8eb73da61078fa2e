"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged cache of compressed latents.

Shapes: T tokens in the step, Hq query heads, Dn = qk_nope_head_dim, Dr = qk_rope_head_dim,
Dv = v_head_dim, R = kv_lora_rank, L = R + Dr (the latent one token keeps per layer).

Per token: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x) when q_lora_rank is None) splits
per head into q_nope [Dn] and q_pe [Dr]; kv_a_proj_with_mqa(x) splits into c [R] (normalised by
kv_a_layernorm) and one k_pe [Dr] shared by all heads. q_pe and k_pe are roped; the cache stores
c ++ k_pe only (L values instead of Hq * (Dn + Dr + Dv)). Attention (kernels/attention_ref.py):
decode-only steps run all sequences at once in the absorbed form (queries projected into the latent
space, mla_decode_ref); other steps go one sequence at a time, expanding the cached latents to
per-head k_nope / v with kv_b_proj or absorbing, whichever costs fewer FLOPs (mla_attention_ref).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedmoe.kernels.attention_ref import mla_attention_ref, mla_decode_ref, write_latent_ref
from pagedmoe.models.layers.linear import Linear
from pagedmoe.models.layers.norm import RMSNorm
from pagedmoe.models.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class MLADims:
    q_lora_rank: Optional[int]    # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj biases
    scale: float = 0.0            # softmax scale (qk_head_dim ** -0.5, times YaRN's mscale ** 2)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The cache pair's D: the latent split across k_cache and v_cache (attention_ref.py)."""
        return -(-self.latent_dim // 2)


class MLAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mla: MLADims, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.mla = num_heads, mla
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, mla.q_lora_rank, bias=bias)
            # NOTE: the low-rank norms use transformers' default eps 1e-6, not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank)
            self.q_b_proj = Linear(mla.q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank)
        # kv_b_proj stays nn.Linear: decode reads its weight directly (absorbed), never calls it
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                   bias=False)
        self.o_proj = Linear(num_heads * mla.v_head_dim, hidden_size, bias=bias)
        self.rotary = rotary
        self.scale = mla.scale or qk_head_dim ** -0.5
        # Bound by the model runner once the cache exists (the split latent pair); MLA runs its own
        # PyTorch path whatever backend is bound (no Triton MLA kernel yet).
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.backend = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        T, m = x.shape[0], self.mla
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((c, k_pe[:, 0]), dim=-1)
        if latent.is_cuda:  # the Triton write: no host sync (the reference's boolean indexing syncs)
            from pagedmoe.kernels.kv_write import write_latent

            write_latent(latent, self.k_cache, self.v_cache, meta.slot_mapping)
        else:
            write_latent_ref(latent, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.is_decode_only:  # one token per sequence: every sequence at once, absorbed
            out = mla_decode_ref(q_nope, q_pe, self.k_cache, self.v_cache, self.kv_b_proj.weight, m.kv_lora_rank,
                                 m.v_head_dim, meta.block_tables, meta.seq_lens, meta.max_seq_len, self.scale)
        else:
            out = mla_attention_ref(q_nope, q_pe, self.k_cache, self.v_cache, self.kv_b_proj.weight,
                                    m.kv_lora_rank, m.v_head_dim, meta.block_tables, meta.query_start_loc_cpu,
                                    meta.seq_lens_cpu, self.scale)
        return self.o_proj(out.reshape(T, self.num_heads * m.v_head_dim))
