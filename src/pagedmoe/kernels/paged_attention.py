"""Triton attention over the paged KV cache: public entry points and the attention backend.

Kernels (each with its launcher; the layout and the reference are in ``attention_ref.py``):
  write_kv                 kv_write.py       scatter this step's k, v into the caches
  paged_attention_decode   paged_decode.py   one token per sequence, GQA, split-K for long contexts
  paged_attention_prefill  paged_prefill.py  causal / chunked prefill, mixed with decode rows

``TritonAttentionBackend`` runs one layer's attention step: write, then decode or prefill. The model
code builds the metadata once per step (``PagedAttentionMetadata`` is the protocol it must meet).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .kv_write import write_kv, write_kv_kernel
from .paged_decode import (
    choose_num_splits, paged_attention_decode, paged_attention_decode_kernel, paged_attention_decode_reduce_kernel,
)
from .paged_prefill import paged_attention_prefill, paged_attention_prefill_kernel

__all__ = [
    "PagedAttentionMetadata", "TritonAttentionBackend",
    "write_kv", "write_kv_kernel",
    "paged_attention_decode", "paged_attention_decode_kernel", "paged_attention_decode_reduce_kernel",
    "paged_attention_prefill", "paged_attention_prefill_kernel", "choose_num_splits",
]


@runtime_checkable
class PagedAttentionMetadata(Protocol):
    """What the backend reads per step. Tensors live on the device; the ints and the flag on the host.

    slot_mapping     [T] int32/int64  cache slot of each of this step's tokens, -1 = padding
    query_start_loc  [B + 1] int32    token range of each sequence in q
    seq_lens         [B] int32        context length including this step's tokens
    block_tables     [B, max_blocks] int32
    max_query_len    int              longest q_len in the step (sizes the prefill grid)
    max_seq_len      int              upper bound of seq_lens (sizes the decode split-K grid; a
                                      fixed bound such as max_model_len keeps CUDA graphs valid)
    is_decode_only   bool             every sequence has exactly one token: T == B
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool


class TritonAttentionBackend:
    """Paged attention on the GPU through the Triton kernels (the PyTorch path stays for CPU)."""

    name = "triton"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k, v [T, Hkv, D] of this step; writes k, v into the layer's caches, returns [T, Hq, D]."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale, out=out)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata,
               scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode or prefill over caches that already hold this step's k, v (written by a fused kernel)."""
        if meta.is_decode_only:
            return paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out=out, max_seq_len=meta.max_seq_len
            )
        return paged_attention_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            meta.max_query_len, out=out,
        )

    __call__ = forward
