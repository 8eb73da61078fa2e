"""Fetch path (b) of routed fetching (issue 21): the routed experts a layer misses, read by a GPU kernel straight
from mapped pinned host memory (UVA zero-copy reads, 47-51 GB/s on the H200 per shared/H200.md), indexed by the
router's ids on the device and written into pages chosen on the device: no host sync, so a CUDA graph can
capture it (fetch path (a), experts/routed.py, syncs per layer).

Pages without a sync: a layer's cached experts keep their pages (the slot map, changed only between steps);
its misses go, in expert-id order, to the layer's `miss_base + rank` pages (a fixed area of at most
min(E, T * A) rows), so the slot map a layer's GEMMs read is `where(cached, slot_map, miss_base + rank)`.
`plan_misses` computes that with fixed-shape torch ops; `gather_rows` copies the rows (Triton; `gather_rows_ref`
is the torch reference). The RoutedPager runs them through experts/routed_uva.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def plan_misses(topk_ids: torch.Tensor, slot_map: torch.Tensor, miss_base: int, with_routed: bool = False):
    """(fetch_dst [E]: the page each missed expert id is read into, -1 for the others; layer_slots [E]: the slot
    map the layer's GEMMs read), and with `with_routed` the routed mask [E] too. No host sync: fixed shapes,
    device ops only."""
    E = slot_map.shape[0]
    # index_fill_ takes the value as a kernel argument: no host tensor is copied inside a CUDA-graph capture
    routed = torch.zeros(E, dtype=torch.bool, device=slot_map.device).index_fill_(0, topk_ids.reshape(-1).long(), True)
    miss = routed & (slot_map < 0)
    rank = torch.cumsum(miss.to(torch.int64), 0) - 1
    fetch_dst = torch.where(miss, miss_base + rank, torch.full_like(rank, -1))
    layer_slots = torch.where(miss, fetch_dst, slot_map)
    return (fetch_dst, layer_slots, routed) if with_routed else (fetch_dst, layer_slots)


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, dst_slot_ptr, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)           # the expert id (a source row of the layer's host rows)
    dst = tl.load(dst_slot_ptr + row)
    if dst >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < stride
        vals = tl.load(src_ptr + row.to(tl.int64) * stride + offs, mask=mask)
        tl.store(dst_ptr + dst.to(tl.int64) * stride + offs, vals, mask=mask)


def gather_rows(src: torch.Tensor, dst: torch.Tensor, fetch_dst: torch.Tensor, block: int = 4096) -> None:
    """dst[fetch_dst[e]] = src[e] for every e with fetch_dst[e] >= 0. `src` [E, stride]: a layer's host rows
    (pinned and mapped on CUDA: the kernel reads them over PCIe), `dst` [S, stride] the expert cache's pool."""
    E, stride = src.shape
    if dst.shape[1] != stride or fetch_dst.shape[0] != E:
        raise ValueError(f"rows of {stride} into {tuple(dst.shape)} with {fetch_dst.shape[0]} destinations")
    grid = (E, triton.cdiv(stride, block))
    _gather_rows_kernel[grid](src, dst, fetch_dst, stride, BLOCK=block)


def gather_rows_ref(src: torch.Tensor, dst: torch.Tensor, fetch_dst: torch.Tensor) -> None:
    """The torch reference of gather_rows (one host sync: for tests)."""
    ids = (fetch_dst >= 0).nonzero().reshape(-1)
    dst[fetch_dst[ids]] = src[ids.to(src.device)].to(dst.device)
