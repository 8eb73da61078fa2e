"""KV cache blocks: a free list and per-request block tables. Pure Python, no torch.

A block holds `block_size` consecutive token positions of one sequence in every layer's K and V cache.
Token position p of a request lives in block `table[p // block_size]` at offset `p % block_size`;
its slot id is `block_id * block_size + offset`.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Free list over block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks
        self._withheld: list[int] = []   # free blocks lent to expert weights (dynamic precision)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_withheld_blocks(self) -> int:
        return len(self._withheld)

    def withhold(self, n: int) -> None:
        """Take `n` free blocks out of circulation (their memory is lent to expert weights)."""
        if n > len(self._free):
            raise MemoryError(f"cannot withhold {n} KV blocks, {len(self._free)} free")
        self._withheld.extend(self._free.pop() for _ in range(n))

    def release(self, n: int) -> None:
        """Give `n` withheld blocks back to the free list."""
        if n > len(self._withheld):
            raise ValueError(f"cannot release {n} KV blocks, {len(self._withheld)} withheld")
        self._free.extend(self._withheld.pop() for _ in range(n))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"double free of KV block {b}")
            self._is_free[b] = True
            self._free.append(b)

    def usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_blocks - len(self._withheld))


class KVCacheManager:
    """Block tables per request on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

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
            # Freed in reverse so the tail of a sequence is reused first (keeps the head warm for later reuse).
            self.pool.free(list(reversed(blocks)))

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

    def withhold(self, n: int) -> None:
        self.pool.withhold(n)

    def release(self, n: int) -> None:
        self.pool.release(n)

    def usage(self) -> float:
        return self.pool.usage()
