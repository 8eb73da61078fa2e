"""KV cache blocks: a free list and per-request block tables. Pure Python, no torch.

A block holds `block_size` consecutive token positions of one sequence in every layer's K and V cache.
Token position p of a request lives in block `table[p // block_size]` at offset `p % block_size`;
its slot id is `block_id * block_size + offset`.

Automatic prefix caching (kvcache/prefix_cache.py): a full block is named by the hash of its tokens and
of everything before it, so two requests whose token sequences start alike can share the blocks of that
start. Shared blocks carry reference counts; a cached block nobody references stays in an LRU and keeps
its contents until the pool needs the block for something else.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable, Optional

from pagedmoe.kvcache.prefix_cache import PrefixHasher


class BlockPool:
    """Free list over block ids 0..num_blocks-1, lowest id first.

    Blocks can be *withheld* (dynamic precision lends their memory to expert weights): always the highest
    ids, `top..num_blocks-1`, so that the memory lent is one tail of every layer's KV tensor and can be
    handed back to the device (kvcache/kv_cache.py::LendableKVCache). Handing out the lowest free ids
    first keeps that tail free while the cache is not full."""

    # FREE: empty, in the heap. USED: referenced (ref count >= 1). EVICTABLE: nobody references it, but it
    # holds a cached block's contents (in the LRU, counted as free: it is reused when nothing is FREE).
    _FREE, _USED, _WITHHELD, _EVICTABLE = 0, 1, 2, 3

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.top = num_blocks                    # blocks [top, num_blocks) are withheld
        self._heap = list(range(num_blocks))     # free ids, a min-heap (a sorted list is one); withheld ids
        self._queued = [True] * num_blocks       # may stay in it, and are skipped when popped
        self._state = [self._FREE] * num_blocks
        self._num_free = num_blocks              # FREE + EVICTABLE blocks
        self._ref = [0] * num_blocks
        self._hash: list[Optional[bytes]] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}      # block hash -> the block holding those tokens
        self._lru: OrderedDict[int, None] = OrderedDict()  # EVICTABLE blocks, least recently freed first

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_withheld_blocks(self) -> int:
        return self.num_blocks - self.top

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_withhold(self, n: int) -> bool:
        """Whether the `n` blocks below the withheld tail are all free (cached contents may be dropped)."""
        return 0 <= n <= self.top and all(self._state[b] in (self._FREE, self._EVICTABLE)
                                          for b in range(self.top - n, self.top))

    def withhold(self, n: int) -> None:
        """Take the `n` blocks below the withheld tail out of circulation (their memory is lent)."""
        if not self.can_withhold(n):
            raise MemoryError(f"cannot withhold {n} KV blocks: blocks {max(0, self.top - n)}..{self.top - 1} "
                              f"are not all free ({self._num_free} free)")
        for b in range(self.top - n, self.top):
            if self._state[b] == self._EVICTABLE:
                del self._lru[b]
                self._uncache(b)
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
        while len(blocks) < n and self._heap:  # empty blocks first: cached contents stay while they can
            b = heapq.heappop(self._heap)
            self._queued[b] = False
            if self._state[b] == self._FREE:
                blocks.append(b)
        while len(blocks) < n:  # then evict the least recently used cached blocks
            b, _ = self._lru.popitem(last=False)
            self._uncache(b)
            blocks.append(b)
        for b in blocks:
            self._state[b] = self._USED
            self._ref[b] = 1
        self._num_free -= n
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody references is free again (kept in the LRU,
        contents intact, if it is cached). Blocks freed together enter the LRU in the order given."""
        for b in blocks:
            if self._state[b] != self._USED:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref[b] -= 1
            if self._ref[b]:
                continue
            self._num_free += 1
            if self._hash[b] is not None:
                self._state[b] = self._EVICTABLE
                self._lru[b] = None
            else:
                self._state[b] = self._FREE
                self._push(b)

    # -- prefix caching ---------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self._cached.get(block_hash)

    def is_evictable(self, b: int) -> bool:
        return self._state[b] == self._EVICTABLE

    def touch(self, b: int) -> None:
        """One more reference to a cached block (a cache hit): an evictable one leaves the LRU."""
        if self._state[b] == self._EVICTABLE:
            del self._lru[b]
            self._state[b] = self._USED
            self._num_free -= 1
        elif self._state[b] != self._USED:
            raise RuntimeError(f"KV block {b} is not cached")
        self._ref[b] += 1

    def cache(self, b: int, block_hash: bytes) -> bool:
        """Name a full, computed block by its hash. False when another block already holds those tokens
        (two requests computed the same prefix at once): this one stays private and is freed empty."""
        if self._state[b] != self._USED:
            raise RuntimeError(f"only a used KV block can be cached (block {b})")
        if block_hash in self._cached or self._hash[b] is not None:
            return False
        self._cached[block_hash] = b
        self._hash[b] = block_hash
        return True

    def reset_cache(self) -> None:
        """Forget every cached block (contents are no longer found; referenced blocks stay in use)."""
        for b in self._lru:
            self._state[b] = self._FREE
            self._push(b)
        self._lru.clear()
        for b in self._cached.values():
            self._hash[b] = None
        self._cached.clear()

    def _uncache(self, b: int) -> None:
        del self._cached[self._hash[b]]
        self._hash[b] = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with itself (tests; O(num_blocks))."""
        states = self._state
        assert self._num_free == sum(s in (self._FREE, self._EVICTABLE) for s in states)
        assert list(self._lru) == [b for b in self._lru if states[b] == self._EVICTABLE]
        assert set(self._lru) == {b for b, s in enumerate(states) if s == self._EVICTABLE}
        assert all(self._queued[b] for b, s in enumerate(states) if s == self._FREE)
        assert set(self._heap) >= {b for b, s in enumerate(states) if s == self._FREE}
        for b, s in enumerate(states):
            assert (self._ref[b] > 0) == (s == self._USED), (b, s, self._ref[b])
            assert s in (self._USED, self._EVICTABLE) or self._hash[b] is None
        assert all(s == self._WITHHELD for s in states[self.top:])
        assert {h: b for b, h in enumerate(self._hash) if h is not None} == self._cached

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

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 backing=None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self.backing = backing
        self.enable_prefix_caching = enable_prefix_caching
        self._hasher = PrefixHasher(block_size)
        self._num_cached: dict[str, int] = {}   # leading blocks of the table that are in the cache
        # Hash -> the running request that will compute that block (its prompt, scheduled but not yet
        # computed): a request needing the same block waits for it instead of computing it again.
        self._pending: dict[bytes, str] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission, as vLLM counts them
        self.prefix_cache_hits = 0     # of those, tokens found in the cache

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks for the request to hold `num_tokens` positions in total."""
        have = len(self._tables.get(request_id, ()))
        need = -(-num_tokens // self.block_size)
        return max(0, need - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.blocks_needed(request_id, num_tokens))

    def allocate(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> bool:
        """Grow the request's table to hold `num_tokens` positions. False (and no change) if full.

        `cached` (a new request only): blocks `find_cached` found, which start its table shared."""
        if cached:
            if request_id in self._tables:
                raise RuntimeError(f"request {request_id!r} already has blocks; cached ones start a new table")
            n = max(0, -(-num_tokens // self.block_size) - len(cached))
            # a hit on an evictable block takes it off the free list too
            if not self.pool.can_allocate(n + sum(map(self.pool.is_evictable, cached))):
                return False
            for b in cached:
                self.pool.touch(b)
            self._tables[request_id] = list(cached) + self.pool.allocate(n)
            self._num_cached[request_id] = len(cached)
            return True
        n = self.blocks_needed(request_id, num_tokens)
        if n == 0:  # most decode steps: the last block has room
            return True
        if not self.pool.can_allocate(n):
            return False
        self._tables.setdefault(request_id, []).extend(self.pool.allocate(n))
        return True

    def free(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if self.enable_prefix_caching:
            self._drop_pending(request_id)
            self._num_cached.pop(request_id, None)
            self._hasher.drop(request_id)
        if blocks:
            # last block first: a sequence's tail is the least likely part to be shared, so it is
            # the first to be evicted
            self.pool.free(reversed(blocks))

    # -- prefix caching ---------------------------------------------------------------------------
    def find_cached(self, request) -> list[int]:
        """The cached blocks a new (or preempted) request's tokens start with; [] when caching is off.
        At least one token is always left to compute, so that the step that computes it samples."""
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return []
        hashes = self._hasher.hashes(request, (request.num_tokens - 1) // self.block_size)
        found = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            found.append(b)
        return found

    def waits_for(self, request, num_cached: int) -> bool:
        """Whether the request's first uncached block is being computed by another running request (its
        prompt shares it: parallel samples of one prompt, one system prompt): better to wait a step or
        two and find it in the cache than to compute it twice."""
        hashes = self._hasher.known(request.request_id)
        owner = self._pending.get(hashes[num_cached]) if num_cached < len(hashes) else None
        return owner is not None and owner != request.request_id

    def admitted(self, request, num_cached: int) -> None:
        """Count the lookup (in tokens) and note the blocks this request will compute."""
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached * self.block_size
        if self.enable_prefix_caching:
            for h in self._hasher.known(request.request_id)[num_cached:]:
                self._pending.setdefault(h, request.request_id)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Name the request's blocks that are now full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        full, start = num_computed_tokens // self.block_size, self._num_cached.get(rid, 0)
        if full <= start:
            return
        table = self._tables[rid]
        for i, h in enumerate(self._hasher.hashes(request, full)[start:full], start):
            self.pool.cache(table[i], h)
            if self._pending.get(h) == rid:
                del self._pending[h]
        self._num_cached[rid] = full

    def reset_prefix_cache(self) -> None:
        """Forget what is cached (benchmarks: a warm-up must not make the measured run's prefill free)."""
        self.pool.reset_cache()

    def _drop_pending(self, request_id: str) -> None:
        for h in self._hasher.known(request_id)[self._num_cached.get(request_id, 0):]:
            if self._pending.get(h) == request_id:
                del self._pending[h]

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
