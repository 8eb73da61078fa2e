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
# kernel), or torch's kernels over this step's keys gathered from the cache: "cudnn-dense" (cuDNN's fused attention
# on [B, S, H, D] views of the step, sequences right-padded to the longest when their lengths differ; GQA through
# enable_gqa), "flash" (varlen FlashAttention-2), "cudnn" / "cudnn-gqa" (cuDNN's varlen path, KV heads repeated or as
# they are). On the H100 at 8 x 1024 tokens (Qwen3-30B-A3B's heads; tune_prefill_attention.py --quick,
# benchmarks/results/session32/33): cudnn-dense 155.5-168.3 us, triton 266.5-269.2, flash 314.4-332.2; cuDNN's varlen
# path is right but rebuilds its graph every call (47 ms) and cannot be captured. In the engine's 8192-token prefill
# step of Qwen3-30B-A3B cudnn-dense took the step from 123.8 to 118.2 ms (session33). PAGEDMOE_PREFILL_ATTENTION
# picks one; "auto" (the default) takes cudnn-dense where `dense_prefill_ok` holds, triton elsewhere.
PREFILL_ATTENTION = os.environ.get("PAGEDMOE_PREFILL_ATTENTION", "auto")
PREFILL_KERNELS = ("auto", "triton", "cudnn-dense", "flash", "cudnn", "cudnn-gqa")
if PREFILL_ATTENTION not in PREFILL_KERNELS:
    raise ValueError(f"PAGEDMOE_PREFILL_ATTENTION must be one of {PREFILL_KERNELS}, got {PREFILL_ATTENTION!r}")
# auto pads a step to dense [B, S] only while the padded causal work B * S^2 stays within this factor of the real
# work sum(len^2): cudnn-dense was 1.6x faster than ours on equal lengths
DENSE_PADDING_WORK = 1.5


def dense_prefill_ok(q: torch.Tensor, lengths: list[int]) -> bool:
    """Whether auto runs a fresh prefill of these prompt lengths through cudnn-dense: half precision on a Hopper or
    later GPU (where it was measured), head size 64 or 128 (cuDNN's fused kernels on every version torch ships), and
    little padding (dense_padding_ok)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in (64, 128):
        return False
    if not torch.backends.cudnn.is_available() or torch.cuda.get_device_capability(q.device) < (9, 0):
        return False
    return dense_padding_ok(lengths)


def dense_padding_ok(lengths: list[int]) -> bool:
    """The causal work of sequences right-padded to the longest, B * S^2, within DENSE_PADDING_WORK of their own,
    sum(len^2)."""
    return len(lengths) * max(lengths) ** 2 <= DENSE_PADDING_WORK * sum(n * n for n in lengths)


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
        kernel = self.fresh_kernel(q, k_cache, meta)
        if kernel is not None:
            return fresh_prefill_attention(q, k_cache, v_cache, meta.slot_mapping, meta.query_start_loc,
                                           meta.max_query_len, scale, kernel, meta.query_start_loc_cpu)
        if meta.is_decode_only:
            return paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out=out, max_seq_len=meta.max_seq_len
            )
        return paged_attention_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
            meta.max_query_len, out=out,
        )

    @staticmethod
    def fresh_kernel(q: torch.Tensor, k_cache: torch.Tensor, meta: PagedAttentionMetadata) -> str | None:
        """torch's kernel for this step (PREFILL_ATTENTION), or None for ours: only a fresh prefill with its host
        query_start_loc (a CUDA graph's metadata has none: its sequences change between replays) over a contiguous
        cache, and only in half precision (torch's fused kernels; an fp32 engine keeps ours)."""
        qsl_cpu = getattr(meta, "query_start_loc_cpu", None)
        if (PREFILL_ATTENTION == "triton" or not getattr(meta, "fresh", False) or qsl_cpu is None
                or not k_cache.is_contiguous() or q.dtype not in (torch.bfloat16, torch.float16)):
            return None
        if PREFILL_ATTENTION != "auto":
            return PREFILL_ATTENTION
        return "cudnn-dense" if dense_prefill_ok(q, (qsl_cpu[1:] - qsl_cpu[:-1]).tolist()) else None

    __call__ = forward
