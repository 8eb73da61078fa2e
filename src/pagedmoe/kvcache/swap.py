"""Swap space (vLLM's --swap-space): a preempted request's KV blocks go to pinned host memory and come back when it
is readmitted, instead of being recomputed from its prompt.

Recompute costs a prefill of everything the request holds (Mixtral-8x7B: ~67 ms of GPU time for 1,485 tokens
at the H200's prefill rate); a swap moves the same 195 MB out and back over PCIe (~7 ms at 55 GB/s). Under KV
pressure (more sequences than the cache holds to their end) the recompute of the preempted requests is a large
share of the run: in the whole-GPU Mixtral throughput run, 227k of 751k prefill tokens by the scheduler's
simulation (benchmarks/sim_preemption.py); with the swap space its measured prefill time fell from 38.9 to 28.7 s
(docs/benchmarks.md).

Two parts, so the scheduler stays pure Python:
  - `SwapSpace`: which host blocks each swapped request holds (contiguous runs, first fit);
  - `HostKVSwap`: the pinned host tensor and the copies between it and the KV cache tensors, queued on the
    current stream before the step's forward (swap-outs first: the blocks they free may be written by the same
    step; then swap-ins), so they need no host sync: stream order makes the step see them. Under tensor
    parallelism every rank has one over its own KV shard and runs the copies rank 0 broadcasts with the step.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch

from pagedmoe.planning.kv_sizing import GiB

logger = logging.getLogger("pagedmoe")


class SwapSpace:
    """Host block runs of swapped requests. `num_blocks` host blocks, each as large as one KV block (every layer)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[tuple[int, int]] = [(0, num_blocks)]   # (start, length), sorted by start, coalesced
        self._held: dict[str, tuple[int, int]] = {}           # request id -> (start, length)

    def reserve(self, request_id: str, n: int) -> Optional[int]:
        """The start of a run of `n` host blocks for the request, or None when no free run is that long."""
        if request_id in self._held:
            raise RuntimeError(f"request {request_id!r} is already swapped out")
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                self._free[i:i + 1] = [(start + n, length - n)] if length > n else []
                self._held[request_id] = (start, n)
                return start
        return None

    def release(self, request_id: str) -> None:
        """Give the request's run back (swapped in, or finished while swapped); nothing if it holds none."""
        run = self._held.pop(request_id, None)
        if run is None:
            return
        runs = sorted(self._free + [run])
        merged = [runs[0]]
        for start, length in runs[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self._free = merged

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def start(self, request_id: str) -> int:
        return self._held[request_id][0]

    @property
    def num_swapped(self) -> int:
        return len(self._held)

    @property
    def num_used_blocks(self) -> int:
        return sum(n for _, n in self._held.values())

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


class HostKVSwap:
    """The host side of the swap space: one tensor [2 * layers, num_blocks, block_size, Hkv, D] (pinned on CUDA),
    host block j of every layer's K and V at [:, j], and the copies to and from the KV cache tensors."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], num_blocks: int) -> None:
        self.caches = [t for pair in kv_caches for t in pair]   # K0, V0, K1, V1, ...
        first = self.caches[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in self.caches):
            raise ValueError("the swap space's host layout needs every KV cache tensor of one shape and dtype")
        self.device = first.device
        pin = first.device.type == "cuda"
        t0 = time.perf_counter()
        self.host = torch.empty((len(self.caches), num_blocks) + tuple(first.shape[1:]), dtype=first.dtype,
                                pin_memory=pin)
        if pin:
            logger.info("KV swap space: %.2f GiB of pinned host memory (%d blocks) in %.1f s", self.nbytes / GiB,
                        num_blocks, time.perf_counter() - t0)

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    @staticmethod
    def block_bytes(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Host bytes of one swapped block (every layer's K and V, the host tensor's [:, j])."""
        first = kv_caches[0][0]
        return 2 * len(kv_caches) * first[0].numel() * first.element_size()

    def run(self, swap_out: Sequence[tuple[list[int], int]], swap_in: Sequence[tuple[int, list[int]]]) -> None:
        """Queue a step's copies: each swap-out (device blocks, host start), then each swap-in (host start,
        device blocks). Asynchronous on the current stream."""
        for blocks, start in swap_out:
            idx = torch.tensor(blocks, dtype=torch.int64).to(self.device, non_blocking=True)
            for j, cache in enumerate(self.caches):
                self.host[j, start:start + len(blocks)].copy_(cache.index_select(0, idx), non_blocking=True)
        for start, blocks in swap_in:
            idx = torch.tensor(blocks, dtype=torch.int64).to(self.device, non_blocking=True)
            for j, cache in enumerate(self.caches):
                cache.index_copy_(0, idx, self.host[j, start:start + len(blocks)].to(self.device, non_blocking=True))


def auto_swap_blocks(device: torch.device, num_kv_blocks: int, block_size: int, max_num_seqs: int,
                     max_model_len: int, block_bytes: int, host_budget: Optional[int],
                     cap_bytes: int = 16 * GiB) -> int:
    """--swap-space unset: host blocks for the KV that cannot fit at once (max_num_seqs sequences of
    max_model_len tokens beyond the cache), at most `cap_bytes` (pinning costs ~0.5 s a GiB at start-up on the
    H200 machine) and half of what the host can still pin (`host_budget`: a rank's share under tensor
    parallelism); none on CPU (the KV cache is host memory already: recompute there is what the tests exercise
    unless they ask)."""
    if device.type != "cuda":
        return 0
    overflow = max(0, -(-max_model_len // block_size) * max_num_seqs - num_kv_blocks)
    limit = cap_bytes if host_budget is None else min(cap_bytes, host_budget // 2)
    return min(overflow, limit // block_bytes)
