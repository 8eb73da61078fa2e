"""Fetch path (b) of routed fetching: the routed misses of a layer read by a GPU kernel straight from mapped pinned
host memory (kernels/uva_gather.py), with no host sync, so the decode steps that use it run in CUDA graphs.

The RoutedPager (experts/routed.py) runs it in forwards of at most `max_tokens` tokens (the decode buckets the
cost model gives to it: planning/fetch_cost.py::settle_fetch_path); larger forwards keep path (a). Per MoE layer:

    plan_misses(topk_ids, slot_map[l], miss_base)   cached experts keep their page, each routed miss gets
                                                    miss_base + its rank among the layer's misses (id order)
    gather_rows(host rows of l, pool, fetch_dst)     the misses' rows, host -> miss area, one launch

and the layer's GEMMs read the pool through the planned slot map. The miss area (min(E, max_tokens x A) pages at
the end of the pool, outside the LRU order) is reused by every layer.
# NOTE: layer l+1's gather overwrites the miss area after layer l's GEMMs read it: both run on the compute
# stream, in order. The slot maps change only between forwards (path (a) and `refresh`), so a graph that reads
# them at replay sees the cache as it is then.

Counting without a sync: the misses and distinct routed experts of each layer accumulate in device counters
(captured into the graphs, so replays count too) and are read by `collect` after the step (its results reached
the host, so the read waits for nothing). The misses also accumulate per (layer, expert): every
REFRESH_STEPS steps `refresh_candidates` names the experts missed in at least two steps of the window, which the
pager then pages into the cache (copy engine, between steps), so a skewed routing stops missing them.
Path (b) reads the raw host rows of every expert by id: it needs every expert in the raw host tier (no lossless
tiers: their fills decode, experts/routed_fill.py).
"""
from __future__ import annotations

import torch

REFRESH_STEPS = 8      # steps between two reads of the per-expert miss counts (one small device -> host read)
REFRESH_MIN_MISSES = 2  # an expert missed in at least this many forwards of the window is paged in


def miss_rows(num_experts: int, top_k: int, max_tokens: int) -> int:
    """Pages of the miss area: one per distinct expert a forward of `max_tokens` tokens can route to a layer."""
    return min(num_experts, max_tokens * top_k) if max_tokens > 0 else 0


class SyncFreeFetch:
    def __init__(self, cache, host_rows, max_tokens: int) -> None:
        E = cache.num_experts
        if cache.miss_rows < miss_rows(E, 1, 1) or any(r is None or r.shape[0] != E for r in host_rows):
            raise ValueError("the sync-free fetch needs a miss area and every expert's raw row in the host tier")
        self.cache, self.host_rows, self.max_tokens = cache, host_rows, max_tokens
        dev = cache.pool.device
        self.counts = torch.zeros(cache.num_layers, 2, dtype=torch.int64, device=dev)   # (misses, routed)
        self.miss_counts = torch.zeros(cache.num_layers, E, dtype=torch.int32, device=dev)
        self.pending = False     # a forward counted on the device since the last collect
        self.steps = 0           # steps collected since the last refresh
        self.num_steps = 0       # steps that fetched by path (b), in all

    def layer_slots(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Gather the layer's routed misses into the miss area; the slot map [E] int32 its GEMMs read."""
        from pagedmoe.kernels.uva_gather import gather_rows, plan_misses  # triton: an optional package

        fetch_dst, slots, routed = plan_misses(topk_ids, self.cache.slot_maps[layer], self.cache.miss_base,
                                               with_routed=True)
        gather_rows(self.host_rows[layer], self.cache.pool, fetch_dst)
        missed = fetch_dst >= 0
        self.counts[layer] += torch.stack((missed.sum(), routed.sum()))
        self.miss_counts[layer] += missed.to(torch.int32)
        self.pending = True
        return slots.to(torch.int32)

    def collect(self) -> tuple[int, int]:
        """(misses, distinct routed experts) summed over layers since the last collect; after a step only."""
        if not self.pending:
            return 0, 0
        misses, routed = self.counts.sum(0).tolist()   # NOTE: between steps: the step's results reached the host
        self.counts.zero_()
        self.pending = False
        self.steps += 1
        self.num_steps += 1
        return misses, routed

    def refresh_candidates(self) -> list[list[int]]:
        """Every REFRESH_STEPS collected steps: per layer, the experts missed in at least REFRESH_MIN_MISSES
        forwards of the window, most missed first (then the counts restart); else nothing."""
        if self.steps < REFRESH_STEPS:
            return []
        self.steps = 0
        counts = self.miss_counts.tolist()
        self.miss_counts.zero_()   # NOTE: in place: the graphs hold this tensor
        return [sorted((e for e, c in enumerate(row) if c >= REFRESH_MIN_MISSES), key=lambda e: -row[e])
                for row in counts]

    def reset(self) -> None:
        """Drop what was counted (capture warm-ups are not traffic of the workload)."""
        self.counts.zero_()
        self.miss_counts.zero_()
        self.pending, self.steps = False, 0
