"""The GPU expert cache of routed fetching (`--expert-fetch routed`, experts/routed.py): one pool of S
fixed-size slots in device memory, one expert per page ([stride] elements, experts/layout.py's row), shared
by every MoE layer, and a device-side slot map per layer (expert id -> slot, -1 when not cached).

The MoE kernels index the pool by expert id through the slot map (`DenseOperand.slots`: the layer maps
its router ids with one gather, no host round trip), so the pool is the only expert memory on the device.
Which experts stay cached follows recency: a routed expert that is cached is a hit and moves to the back of
the LRU order; a miss takes a free slot, else evicts the least recently used page (LRU over every layer's
pages, so a layer that routes to few experts gives its slots to the layers that need more). The pages of the
layer being fetched are all at the back of the order when a victim is taken, and S >= E, so a fetch never
evicts an expert its own layer routed to.

The page table is the expert table (experts/table.py): each entry's `cache_slot` (where its page is, -1:
only its master copy in the host tier), `last_access` (the cache's fetch tick of its last use) next to its
tier, precision and activity.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CacheStats:
    hits: int = 0              # routed experts found in the cache (per layer and step)
    misses: int = 0            # routed experts fetched
    bytes_moved: int = 0       # host -> device bytes of the fetched experts
    bytes_routed: int = 0      # bytes of the distinct experts routed (per layer and step)


class ExpertCache:
    """The pool and its slot maps. Doubles as the store's compute buffers (`packed(layer)` is the pool)."""

    maps_resident = False  # nothing is resident outside the pool

    def __init__(self, table, num_slots: int, stride: int, dtype: torch.dtype, device: torch.device) -> None:
        L, E = table.num_layers, table.num_experts
        if num_slots < E:
            raise ValueError(f"an expert cache of {num_slots} slots cannot hold one layer's {E} experts")
        self.table, self.num_slots, self.num_layers, self.num_experts = table, num_slots, L, E
        self.pool = torch.zeros(num_slots, stride, dtype=dtype, device=device)
        self.slot_maps = torch.full((L, E), -1, dtype=torch.int64, device=device)
        self.host_maps = [[-1] * E for _ in range(L)]       # host mirror of slot_maps
        self.owner: list = [None] * num_slots               # slot -> (layer, expert)
        self.lru: OrderedDict = OrderedDict()               # (layer, expert) -> slot, least recent first
        self.free = list(range(num_slots - 1, -1, -1))
        self.tick = 0
        self.stats = CacheStats()

    def packed(self, layer: int) -> torch.Tensor:
        return self.pool

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size() + self.slot_maps.numel() * 8

    def lookup(self, layer: int, ids) -> tuple[list[int], list[tuple[int, int]]]:
        """The distinct routed `ids` of `layer`: (hits, [(expert, slot to fill)]) — the misses get slots
        (evicting LRU pages of other layers, or older ones of this layer that were not routed now)."""
        self.tick += 1
        hits, misses = [], []
        for e in ids:
            key = (layer, e)
            if key in self.lru:
                self.lru.move_to_end(key)
                hits.append(e)
                self.table.touch(layer, e, self.tick)
        for e in ids:
            if (layer, e) in self.lru:
                continue
            slot = self.free.pop() if self.free else self._evict()
            self.owner[slot] = (layer, e)
            self.lru[(layer, e)] = slot
            self.host_maps[layer][e] = slot
            self.table.set_cache_slot(layer, e, slot, self.tick)
            misses.append((e, slot))
        return hits, misses

    def _evict(self) -> int:
        (layer, e), slot = self.lru.popitem(last=False)
        self.host_maps[layer][e] = -1
        self.table.set_cache_slot(layer, e, -1)
        return slot

    def publish(self, layer: int) -> None:
        """Write the layer's host slot map to the device (a small synchronous copy after its fetch)."""
        self.slot_maps[layer].copy_(torch.tensor(self.host_maps[layer], dtype=torch.int64))

    def cached(self, layer: int) -> list[int]:
        return [e for e, s in enumerate(self.host_maps[layer]) if s >= 0]
