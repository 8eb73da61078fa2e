"""The GPU expert cache of routed fetching (`--expert-fetch routed`, experts/routed.py): one pool of S
fixed-size slots in device memory, one expert per page ([stride] elements, experts/layout.py's row), shared
by every MoE layer, and a device-side slot map per layer (expert id -> slot, -1 when not cached).

The MoE kernels index the pool by expert id through the slot map (`DenseOperand.slots`: the layer maps
its router ids with one gather, no host round trip), so the pool is the only expert memory on the device.
Which experts stay cached follows recency: a routed expert that is cached is a hit and moves to the back of
the LRU order; a miss takes a free slot, else evicts the least recently used page (LRU over every layer's
pages, so a layer that routes to few experts gives its slots to the layers that need more). Under fetch path (b)
(experts/routed_uva.py) the last pages of the pool are a miss area outside the LRU order. When every page
was used in the current step (the step routes to more experts than the cache holds), LRU would evict exactly
the pages the next step needs first (layers run in a cycle: a working set of 1.5 x the cache hit 0% on the
default model at batch 8); then the victim is the most recently used page of another layer, the page whose
next use is farthest away in the layer cycle (Belady's choice for a cyclic order). Pages of the layer being
fetched are never victims (S >= E).

The page table is the expert table (experts/table.py): each entry's `cache_slot` (where its page is, -1:
only its master copy in the host tier), `last_access` (the cache's fetch tick of its last use) next to its
tier, precision and activity.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class CacheStats:
    # paths (a) and (b) count the distinct routed experts of each layer and step; a stream step (experts/routed.py)
    # looks up every expert of each layer: its hits are the pages it found, its misses the pages it filled
    hits: int = 0              # routed experts found in the cache (per layer and step); stream steps: every expert
    misses: int = 0            # routed experts fetched; stream steps: every page filled (prefetched or on demand)
    bytes_moved: int = 0       # host -> device bytes of the fetched experts (compressed bytes from a compressed tier)
    bytes_decoded: int = 0     # bf16 bytes decoded into pages (misses from a compressed host or GPU tier)
    bytes_routed: int = 0      # bytes of the distinct experts routed (per layer and step)
    prefetched: int = 0        # pages fetched by prediction (layer l+1's router on layer l's input)
    prefetch_hits: int = 0     # of those, routed by their layer in the same forward
    streamed: int = 0          # pages filled by stream steps (counted in misses too)


class ExpertCache:
    """The pool and its slot maps. Doubles as the store's compute buffers (`packed(layer)` is the pool)."""

    maps_resident = False  # nothing is resident outside the pool

    def __init__(self, table, num_slots: int, stride: int, dtype: torch.dtype, device: torch.device,
                 miss_rows: int = 0) -> None:
        L, E = table.num_layers, table.num_experts
        if num_slots - miss_rows < E:
            raise ValueError(f"an expert cache of {num_slots - miss_rows} slots cannot hold one layer's {E} experts")
        self.table, self.num_slots, self.num_layers, self.num_experts = table, num_slots, L, E
        self.pool = torch.zeros(num_slots, stride, dtype=dtype, device=device)
        # fetch path (b) (experts/routed_uva.py): the last `miss_rows` pages are the miss area, never LRU pages
        self.miss_base, self.miss_rows = num_slots - miss_rows, miss_rows
        self.slot_maps = torch.full((L, E), -1, dtype=torch.int32, device=device)   # as fused_moe_mixed takes
        self.host_maps = [[-1] * E for _ in range(L)]       # host mirror of slot_maps
        self._mirror = torch.full((L, E), -1, dtype=torch.int32)   # the same as one CPU tensor (publish's source)
        self.owner: list = [None] * num_slots               # slot -> (layer, expert)
        self.lru: OrderedDict = OrderedDict()               # (layer, expert) -> slot, least recent first
        self.free = list(range(self.miss_base - 1, -1, -1))
        self.tick = 0
        self.step = 0                                       # forwards so far (begin_step)
        self.used_in: dict = {}                             # (layer, expert) -> step of its last use
        self.dirty: set = set()                             # layers whose slot map changed since publish
        self.stats = CacheStats()

    def begin_step(self) -> None:
        self.step += 1

    def packed(self, layer: int) -> torch.Tensor:
        return self.pool

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size() + self.slot_maps.numel() * 4

    def lookup(self, layer: int, ids, protect: int = -1) -> tuple[list[int], list[tuple[int, int]]]:
        """The distinct routed `ids` of `layer`: (hits, [(expert, slot to fill)]) — the misses get slots
        (evicting LRU pages of other layers, or older ones of this layer that were not routed now; never
        pages of layer `protect`, whose GEMMs may still be pending: a prefetch for the next layer). With a
        `protect`ed layer a prefetch is best effort: the misses past the last page it may take get none (they are
        fetched on demand)."""
        self.tick += 1
        hits, misses = [], []
        for e in ids:
            key = (layer, e)
            if key in self.lru:
                self.lru.move_to_end(key)
                self.used_in[key] = self.step
                hits.append(e)
                self.table.touch(layer, e, self.tick)
        for e in ids:
            if (layer, e) in self.lru:
                continue
            slot = self.free.pop() if self.free else self._evict(layer, protect)
            if slot is None:   # every page is the protected layer's or this one's (S - miss area < 2 x E)
                if protect < 0:
                    raise RuntimeError(f"the expert cache has no page for layer {layer}'s expert {e}")
                break
            self.owner[slot] = (layer, e)
            self.lru[(layer, e)] = slot
            self.used_in[(layer, e)] = self.step
            self.host_maps[layer][e] = slot
            self.table.set_cache_slot(layer, e, slot, self.tick)
            misses.append((e, slot))
        return hits, misses

    def _evict(self, fetching: int, protect: int = -1) -> Optional[int]:
        """The victim's slot, None when every page is the fetching or protected layer's."""
        key = next((k for k in self.lru if k[0] != protect), None)
        if key is None or self.used_in[key] == self.step:  # every page used this step: the newest of another layer
            key = next((k for k in reversed(self.lru) if k[0] not in (fetching, protect)), None)
            if key is None:
                return None
        slot = self.lru.pop(key)
        del self.used_in[key]
        layer, e = key
        self.host_maps[layer][e] = -1
        self.table.set_cache_slot(layer, e, -1)
        self.dirty.add(layer)
        return slot

    def publish(self, *layers: int) -> None:
        """Write the layers' host slot maps to the device after their fetch, and those of the layers that lost
        pages to them: one asynchronous copy of every layer's map, on the current stream (so it follows the fills
        and precedes the GEMMs that read it)."""
        # NOTE: fetch path (b) trusts every entry of a device slot map (a cached expert keeps its page), so a
        # victim's layer is written too; path (a) reads only the entries of the experts it just looked up. The
        # rows nobody changed are rewritten with the values they hold.
        self.dirty.update(layers)
        for v in self.dirty:
            self._mirror[v] = torch.tensor(self.host_maps[v], dtype=torch.int32)
        self.dirty.clear()
        if self.slot_maps.is_cuda:
            # a pinned snapshot: the copy runs later, and the host changes the mirror before then; the caching
            # host allocator keeps the block until the copy is done. A pageable source would sync per row.
            self.slot_maps.copy_(self._mirror.pin_memory(), non_blocking=True)
        else:
            self.slot_maps.copy_(self._mirror)

    def cached(self, layer: int) -> list[int]:
        return [e for e, s in enumerate(self.host_maps[layer]) if s >= 0]
