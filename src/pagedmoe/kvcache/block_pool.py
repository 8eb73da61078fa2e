"""KV cache blocks: a free list and per-request block tables. Pure Python, no torch.

A block holds `block_size` consecutive token positions of one sequence in every layer's K and V cache.
Token position p of a request lives in block `table[p // block_size]` at offset `p % block_size`;
its slot id is `block_id * block_size + offset`.
"""
from __future__ import annotations

import heapq


class BlockPool:
    """Free list over block ids 0..num_blocks-1, lowest id first.

    Blocks can be *withheld* (dynamic precision lends their memory to expert weights): always the highest
    ids, `top..num_blocks-1`, so that the memory lent is one tail of every layer's KV tensor and can be
    handed back to the device (kvcache/kv_cache.py::LendableKVCache). Handing out the lowest free ids
    first keeps that tail free while the cache is not full."""

    _FREE, _USED, _WITHHELD = 0, 1, 2

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.top = num_blocks                    # blocks [top, num_blocks) are withheld
        self._heap = list(range(num_blocks))     # free ids, a min-heap (a sorted list is one); withheld ids
        self._queued = [True] * num_blocks       # may stay in it, and are skipped when popped
        self._state = [self._FREE] * num_blocks
        self._num_free = num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_withheld_blocks(self) -> int:
        return self.num_blocks - self.top

    def can_withhold(self, n: int) -> bool:
        """Whether the `n` blocks below the withheld tail are all free."""
        return 0 <= n <= self.top and all(self._state[b] == self._FREE for b in range(self.top - n, self.top))

    def withhold(self, n: int) -> None:
        """Take the `n` blocks below the withheld tail out of circulation (their memory is lent)."""
        if not self.can_withhold(n):
            raise MemoryError(f"cannot withhold {n} KV blocks: blocks {max(0, self.top - n)}..{self.top - 1} "
                              f"are not all free ({self._num_free} free)")
        for b in range(self.top - n, self.top):
            self._state[b] = self._WITHHELD
        self.top -= n
        self._num_free -= n

    def release(self, n: int) -> None:
        """Give the lowest `n` withheld blocks back to the free list."""
        if not 0 <= n <= self.num_withheld_blocks:
            raise ValueError(f"cannot release {n} KV blocks, {self.num_withheld_blocks} withheld")
        for b in range(self.top, self.top + n):
            self._state[b] = self._FREE
            self._push(b)
        self.top += n
        self._num_free += n

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} KV blocks, {self._num_free} free")
        blocks = []
        while len(blocks) < n:
            b = heapq.heappop(self._heap)
            self._queued[b] = False
            if self._state[b] == self._FREE:
                self._state[b] = self._USED
                blocks.append(b)
        self._num_free -= n
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._state[b] != self._USED:
                raise RuntimeError(f"double free of KV block {b}")
            self._state[b] = self._FREE
            self._push(b)
        self._num_free += len(blocks)

    def _push(self, b: int) -> None:
        if not self._queued[b]:
            self._queued[b] = True
            heapq.heappush(self._heap, b)

    def usage(self) -> float:
        return 1.0 - self._num_free / self.top


class KVCacheManager:
    """Block tables per request on top of a BlockPool.

    `backing` (optional) is the memory behind the blocks when it can follow the pool's withheld tail
    (kvcache/kv_cache.py::LendableKVCache): withholding gives the tail's memory back to the device, and
    releasing maps it again first."""

    def __init__(self, num_blocks: int, block_size: int, backing=None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self.backing = backing

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks for the request to hold `num_tokens` positions in total."""
        have = len(self._tables.get(request_id, ()))
        need = -(-num_tokens // self.block_size)
        return max(0, need - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.blocks_needed(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` positions. False (and no change) if full."""
        n = self.blocks_needed(request_id, num_tokens)
        if n == 0:  # most decode steps: the last block has room
            return True
        if not self.pool.can_allocate(n):
            return False
        self._tables.setdefault(request_id, []).extend(self.pool.allocate(n))
        return True

    def free(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def has(self, request_id: str) -> bool:
        """Whether the request holds blocks (allocated and not freed)."""
        return request_id in self._tables

    def slot(self, request_id: str, position: int) -> int:
        table = self._tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def can_withhold(self, n: int) -> bool:
        return self.pool.can_withhold(n)

    def withhold(self, n: int) -> None:
        self.pool.withhold(n)
        if self.backing is not None:
            self.backing.set_top(self.pool.top)

    def release(self, n: int) -> int:
        """Give back up to `n` withheld blocks; returns how many (fewer only if their memory could not be
        mapped again yet: the device is short of it until torch frees what it caches)."""
        top = self.pool.top + n
        if self.backing is not None:
            top = self.backing.set_top(top)
        done = max(0, top - self.pool.top)
        self.pool.release(done)
        return done

    def usage(self) -> float:
        return self.pool.usage()
