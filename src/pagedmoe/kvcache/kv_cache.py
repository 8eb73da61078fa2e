"""KV cache tensors and how many blocks a budget buys."""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from pagedmoe import cuda_vmm as vmm


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """K and V, every layer, one block."""
    elem = dtype.itemsize
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def kv_cache_bytes(dims, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes of `num_blocks` KV blocks of a model of `dims` (every layer's K and V)."""
    return num_blocks * kv_bytes_per_block(dims.num_layers, dims.num_kv_heads, dims.head_dim, block_size, dtype)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, Hkv, D]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def blocks_per_chunk(num_blocks: int, slice_bytes: int, granularity: int, max_chunks: int = 64) -> int:
    """Blocks in one lendable chunk of a LendableKVCache tensor: a multiple of the fewest blocks whose bytes
    in one tensor (`slice_bytes` each) fill whole VMM granules, large enough that a tensor has at most
    `max_chunks` chunks (so the driver handles stay few; what is lent is rounded down to whole chunks)."""
    unit = math.lcm(slice_bytes, granularity) // slice_bytes
    units = max(1, -(-num_blocks // (max_chunks * unit)))
    return units * unit


class LendableKVCache:
    """KV tensors in CUDA virtual memory whose top blocks can give their memory back to the device.

    Each layer's K and V tensor is one reserved range, mapped chunk by chunk (`blocks_per_chunk` blocks a
    chunk, one driver allocation each). Dynamic precision withholds the pool's highest blocks for expert
    weights (kvcache/block_pool.py); `set_top(top)` unmaps and frees every chunk that lies wholly at or
    above `top` in every tensor, so torch can allocate the expert forms from that memory, and maps chunks
    again (zeroed) when the blocks come back. The tensors' addresses never change; only blocks no request
    holds are ever unmapped. Without it the lent bytes would sit in the KV tensors *and* in the experts:
    the physical footprint would pass the budget by everything lent."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_chunks: int = 64) -> None:
        cu = vmm.driver()
        self.device = device
        self.device_idx = device.index if device.index is not None else torch.cuda.current_device()
        self.num_blocks = num_blocks
        self.slice_bytes = block_size * num_kv_heads * head_dim * dtype.itemsize   # one block, one tensor
        gran = vmm.granularity(device)
        self.blocks_per_chunk = blocks_per_chunk(num_blocks, self.slice_bytes, gran, max_chunks)
        self.num_chunks = -(-num_blocks // self.blocks_per_chunk)
        full = self.blocks_per_chunk * self.slice_bytes
        last = num_blocks * self.slice_bytes - (self.num_chunks - 1) * full
        self.chunk_bytes = [full] * (self.num_chunks - 1) + [-(-last // gran) * gran]
        reserve = sum(self.chunk_bytes)
        self._access = vmm.access_desc(self.device_idx)
        # what the finalizer frees: reserved ranges, and per chunk the handle of each tensor (None: unmapped)
        self._ranges: list[tuple[int, int]] = []
        self._handles: list[Optional[list]] = [None] * self.num_chunks
        self._memory = _Token()          # held by every tensor over the ranges: freed once all are gone
        self._finalizer = weakref.finalize(self._memory, _free_lendable, self._ranges, self._handles,
                                           self.chunk_bytes)
        self._finalizer.atexit = False   # at exit the driver frees it, and may already be gone
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        for _ in range(2 * num_layers):
            self._ranges.append((int(vmm.check(cu.cuMemAddressReserve(reserve, gran, 0, 0))), reserve))
        self.mapped = 0                                  # chunks [0, mapped) are backed by memory
        # bytes the budget has left for chunks mapped again (None: the device's free memory is the only limit);
        # the engine sets it once the KV cache is mapped (engine/llm_engine.py)
        self.room = None
        if self.set_top(num_blocks) != num_blocks:
            self.close()
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: the KV cache's {num_blocks} blocks "
                                              f"({reserve * 2 * num_layers / 2**30:.2f} GiB) could not be mapped")
        tensors = [torch.as_tensor(vmm.CudaArray(va, num_blocks * self.slice_bytes, self._memory), device=device)
                   .view(dtype).view(shape) for va, _ in self._ranges]
        self.caches = list(zip(tensors[0::2], tensors[1::2]))

    @property
    def lent_bytes(self) -> int:
        """Device bytes given back: the unmapped chunks of every tensor."""
        return sum(self.chunk_bytes[self.mapped:]) * len(self._ranges)

    def set_top(self, top: int) -> int:
        """Back blocks [0, top) with memory and give back every chunk wholly in [top, num_blocks). Returns
        the top actually backed: less than `top` when the device has no memory for a chunk yet."""
        want = -(-top // self.blocks_per_chunk)
        if want < self.mapped:
            torch.cuda.synchronize(self.device)          # no kernel may still read what is unmapped
            for c in reversed(range(want, self.mapped)):
                _unmap_chunk(self._ranges, self._handles, self.chunk_bytes, c)
            self.mapped = want
        if want > self.mapped:
            # what the experts gave up is cached by torch: hand it to the driver, or the chunks would take
            # new memory and the footprint would pass the budget by it
            torch.cuda.empty_cache()
        while self.mapped < want and self._map_chunk(self.mapped):
            self.mapped += 1
        return min(top, self.mapped * self.blocks_per_chunk)

    def _map_chunk(self, c: int) -> bool:
        cu = vmm.driver()
        size, offset, handles = self.chunk_bytes[c], _chunk_offset(self.chunk_bytes, c), []
        if self.room is not None and self.room() < size * len(self._ranges):
            return False    # within the device's free memory but not the budget's: tick tries again
        for _ in self._ranges:
            err, handle = cu.cuMemCreate(size, vmm.allocation_prop(self.device_idx), 0)
            if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:   # not yet: what the experts gave up is in use
                for h in handles:
                    vmm.check(cu.cuMemRelease(h))
                return False
            vmm.check((err, handle))
            handles.append(handle)
        for (va, _), h in zip(self._ranges, handles):
            vmm.map_range(va + offset, size, h, self._access)
            vmm.check(cu.cuMemsetD8(va + offset, 0, size))    # blocks come back zeroed, as allocated
        self._handles[c] = handles
        return True

    def close(self) -> None:
        """Free everything now (the tensors must not be used after)."""
        torch.cuda.synchronize(self.device)
        self.caches = []
        self._finalizer()


class _Token:
    pass


def _chunk_offset(chunk_bytes: list[int], c: int) -> int:
    """Where chunk c starts in its tensor's range: every chunk but the last is full."""
    return c * chunk_bytes[0]


def _unmap_chunk(ranges, handles, chunk_bytes, c: int) -> None:
    cu = vmm.driver()
    offset = _chunk_offset(chunk_bytes, c)
    for (va, _), h in zip(ranges, handles[c]):
        vmm.check(cu.cuMemUnmap(va + offset, chunk_bytes[c]))
        vmm.check(cu.cuMemRelease(h))
    handles[c] = None


def _free_lendable(ranges, handles, chunk_bytes) -> None:
    cu = vmm.driver()
    for c in range(len(handles)):
        if handles[c] is not None:
            _unmap_chunk(ranges, handles, chunk_bytes, c)
    for va, size in ranges:
        vmm.check(cu.cuMemAddressFree(va, size))
    ranges.clear()
