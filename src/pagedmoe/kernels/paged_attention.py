"""Triton attention over the paged KV cache: public entry points and the attention backend.

Kernels (each with its launcher; the layout and the reference are in ``attention_ref.py``):
  write_kv                 kv_write.py       scatter this step's k, v into the caches
  paged_attention_decode   paged_decode.py   one token per sequence, GQA, split-K for long contexts
  paged_attention_prefill  paged_prefill.py  causal / chunked prefill, mixed with decode rows

``TritonAttentionBackend`` runs one layer's attention step: write, then decode or prefill. The model
code builds the metadata once per step (``PagedAttentionMetadata`` is the protocol it must meet).
"""
from __future__ import annotations

import functools
import os
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


# The kernel of a fresh prefill (every sequence a whole prompt, no cached context): "triton" (our paged prefill
# kernel, the default), or torch's kernels over this step's keys gathered from the cache: "cudnn-dense" (cuDNN's
# fused attention on [B, S, H, D] views of the step, sequences right-padded to the longest when their lengths differ;
# GQA through enable_gqa), "flash" (varlen FlashAttention-2), "cudnn" / "cudnn-gqa" (cuDNN's varlen path, KV heads
# repeated or as they are). On the H100 at 8 x 1024 tokens (Qwen3-30B-A3B's heads; tune_prefill_attention.py --quick,
# benchmarks/results/session32): cudnn-dense 155.5 us, triton 269.2, flash 314.4; cuDNN's varlen path is right but
# rebuilds its graph every call (47 ms) and cannot be captured. PAGEDMOE_PREFILL_ATTENTION picks one; the default
# stays triton until the engine's step is measured with it (gpu_issue25.sh prefill-variants).
PREFILL_ATTENTION = os.environ.get("PAGEDMOE_PREFILL_ATTENTION", "triton")
PREFILL_KERNELS = ("triton", "cudnn-dense", "flash", "cudnn", "cudnn-gqa")
if PREFILL_ATTENTION not in PREFILL_KERNELS:
    raise ValueError(f"PAGEDMOE_PREFILL_ATTENTION must be one of {PREFILL_KERNELS}, got {PREFILL_ATTENTION!r}")


def fresh_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                            scale: float, kernel: str, query_start_loc_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a fresh prefill (every sequence from position 0) through torch's kernels: this step's
    keys and values are gathered from the caches at slot_mapping (all >= 0: no padding rows) into contiguous
    [T, Hkv, D] rows, then `kernel` (PREFILL_KERNELS but triton) attends q [T, Hq, D]. cudnn-dense needs
    query_start_loc_cpu (the host copy of query_start_loc)."""
    _, _, hkv, d = k_cache.shape
    k = k_cache.view(-1, hkv, d).index_select(0, slot_mapping)
    v = v_cache.view(-1, hkv, d).index_select(0, slot_mapping)
    if kernel == "cudnn-dense":
        return _dense_cudnn(q, k, v, query_start_loc_cpu, scale)
    cu = query_start_loc.to(torch.int32)
    if kernel == "flash":
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_query_len, max_query_len, 0.0, True,
                                                       False, scale=scale)[0]
    group = q.shape[1] // hkv
    # cuDNN's ragged layout assumes packed [T, H, D] rows (its offsets are cumulative lengths x H x D); the engine's q
    # is a column slice of the fused q/k/v output (a wider row stride): packed first
    q = q.contiguous()
    if kernel == "cudnn" and group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_query_len, max_query_len, False, 0.0,
                                                   True, scale=scale)[0]


@functools.lru_cache(maxsize=16)
def _padding_rows(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src [B * S], dst [T]) for sequences of `lengths` right-padded to S = the longest: padded row b * S + i reads
    token qsl[b] + min(i, len_b - 1) (a real row: finite values), token qsl[b] + i comes back from row b * S + i."""
    S = max(lengths)
    src, dst, start = [], [], 0
    for b, n in enumerate(lengths):
        i = torch.arange(S)
        src.append(start + i.clamp(max=n - 1))
        dst.append(b * S + i[:n])
        start += n
    return torch.cat(src).to(device), torch.cat(dst).to(device)


def _dense_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl_cpu: torch.Tensor, scale: float,
                 backend=None) -> torch.Tensor:
    """cuDNN's fused attention over [B, S, H, D] views of the step (sequences right-padded to the longest S when
    their lengths differ: a causal query never sees the padding after it, so the real rows are exact). backend:
    another SDPBackend (the CPU tests run the same layout through MATH)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if qsl_cpu is None:
        raise ValueError("cudnn-dense prefill attention needs the host copy of query_start_loc")
    lengths = tuple((qsl_cpu[1:] - qsl_cpu[:-1]).tolist())
    B, S, (T, hq, d) = len(lengths), max(lengths), q.shape
    src = dst = None
    if B * S != T:
        src, dst = _padding_rows(lengths, q.device)
        q, k, v = (x.index_select(0, src) for x in (q, k, v))
    q, k, v = (x.view(B, S, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if backend is None else backend):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    o = o.transpose(1, 2).reshape(B * S, hq, d)
    return o if dst is None else o.index_select(0, dst)


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
        # torch's fused kernels take half precision only (an fp32 engine keeps ours)
        if (getattr(meta, "fresh", False) and PREFILL_ATTENTION != "triton" and k_cache.is_contiguous()
                and q.dtype in (torch.bfloat16, torch.float16)):
            return fresh_prefill_attention(q, k_cache, v_cache, meta.slot_mapping, meta.query_start_loc,
                                           meta.max_query_len, scale, PREFILL_ATTENTION, meta.query_start_loc_cpu)
        if meta.is_decode_only:
            return paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out=out, max_seq_len=meta.max_seq_len
            )
        return paged_attention_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            meta.max_query_len, out=out,
        )

    __call__ = forward
