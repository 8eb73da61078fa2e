"""Fetch path (b) of routed fetching: the routed misses of a layer read by a GPU kernel straight from mapped pinned
host memory (kernels/uva_gather.py for raw host rows; the indexed lossless decode, kernels/lossless_decode.py, for a
compressed host tier), or decoded from the compressed GPU tier (the same indexed decode), with no host sync, so the
decode steps that use it run in CUDA graphs.

The RoutedPager (experts/routed.py) runs it in forwards of at most `max_tokens` tokens (the decode buckets the
cost model gives to it: planning/fetch_cost.py::settle_fetch_path); larger forwards keep path (a). Per MoE layer:

    plan_misses(topk_ids, slot_map[l], miss_base)   cached experts keep their page, each routed miss gets
                                                    miss_base + its rank among the layer's misses (id order)
    gather_rows(host rows of l, pool, host_dst)      the host tier's misses, host -> miss area, one launch; or,
                                                    with the host tier compressed (--host-compression lossless),
    lossless_decode_indexed(host layer of l, pool,   its misses decoded from mapped host memory into their miss
        host parts, host_dst)                        pages (the kernel reads each compressed byte once over PCIe)
    lossless_decode_indexed(compressed tier of l,    the compressed GPU tier's misses decoded into their miss
        pool, parts, comp_dst)                       pages, one launch (a fixed grid: unmissed parts exit)

and the layer's GEMMs read the pool through the planned slot map. The miss area (min(E, max_tokens x A) pages at
the end of the pool, outside the LRU order) is reused by every layer.
# NOTE: layer l+1's gather overwrites the miss area after layer l's GEMMs read it: both run on the compute
# stream, in order. The slot maps change only between forwards (path (a) and `refresh`), so a graph that reads
# them at replay sees the cache as it is then.

Counting without a sync: the misses, distinct routed experts, decoded misses and bytes moved over PCIe of each layer
accumulate in device counters
(captured into the graphs, so replays count too) and are read by `collect` after the step (its results reached
the host, so the read waits for nothing). The misses also accumulate per (layer, expert): every
REFRESH_STEPS steps `refresh_candidates` names the host experts missed in at least two steps of the window, which
the pager then pages into the cache (copy engine, between steps), so a skewed routing stops missing them. The
compressed GPU tier's experts are not named: their misses cross no PCIe (a decode of a few microseconds), so the
pages go to host experts (each miss ~30x dearer: 9 MiB over PCIe against 9 MiB decoded, Qwen3-30B-A3B on the H200).
Each expert's master copy is a raw host row, a part of its layer's mapped compressed host tensor
(experts/tiers/host.py::mapped_layer, one part per host slot) or a part of its layer's compressed GPU-tier tensor
(experts/build.py places the first C ids compressed, the rest on the host, each tier in id order). `host_dst` and
`comp_dst` are fetch_dst read through each tier's experts in slot order (views where those ids are one range, as
built: no kernel), so the host rows (parts) are read by host slot and the GPU tier's parts by part index.
"""
from __future__ import annotations

from typing import NamedTuple, Union

import torch

from pagedmoe.experts.table import COMPRESSED, HOST
from pagedmoe.planning.fetch_cost import miss_rows

REFRESH_STEPS = 8      # steps between two reads of the per-expert miss counts (one small device -> host read)
REFRESH_MIN_MISSES = 2  # an expert missed in at least this many forwards of the window is paged in
# The indexed decode reading a compressed host tier over PCIe: 16 warps a block read 43.8 GB/s of compressed bytes on
# the H200 against 37.9 with the 4 the device decode is fastest with (benchmarks/bench_routed_fetch.py, 8ae7d4f);
# any value decodes the same bits.
MAPPED_DECODE_WARPS = 16


class Collected(NamedTuple):
    """What path (b) counted since the last collect, summed over layers (per layer and forward)."""
    misses: int     # routed experts not cached: gathered from the host or decoded
    routed: int     # distinct routed experts
    decoded: int    # of the misses, those decoded on the device (from either lossless tier)
    moved: int      # bytes the misses read over PCIe (raw host rows, or compressed host parts)


def _select(ids: list[int], device) -> Union[slice, torch.Tensor, None]:
    """Indexes [E] per-expert tensors at `ids` (in order): a slice when they are one range (a view, no kernel), an
    index tensor otherwise; None when there are none."""
    if not ids:
        return None
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, dtype=torch.int64, device=device)


class SyncFreeFetch:
    def __init__(self, cache, host_rows, max_tokens: int, compressed=None, host_mapped=None,
                 expert_bytes: int = 0) -> None:
        """`host_rows[l]`: layer l's raw host rows in host-slot order, or, for a compressed host tier, `host_mapped[l]`
        its MappedLayer (experts/tiers/host.py; filled as layers are encoded: read at each forward); `compressed`: the
        compressed GPU tier's per-layer CompressedTensors (ExpertStore.compressed, likewise), for the experts
        cache.table places there; `expert_bytes`: the bytes a raw host row's miss moves."""
        E, table = cache.num_experts, cache.table
        if cache.miss_rows < miss_rows(E, 1, 1):
            raise ValueError("the sync-free fetch needs a miss area in the expert cache")
        self.cache, self.host_rows, self.max_tokens = cache, host_rows, max_tokens
        self.compressed, self.host_mapped, self.expert_bytes = compressed, host_mapped, expert_bytes
        dev = cache.pool.device
        self._host_sel, self._comp_sel, self._parts, self._comp_ids, self._host_parts = [], [], [], [], []
        for layer in range(cache.num_layers):
            host, comp = table.ids(layer, HOST), table.ids(layer, COMPRESSED)   # each in slot order
            rows = host_rows[layer]
            raw = host_mapped is None
            if len(host) + len(comp) != E or host and raw and (rows is None or rows.shape[0] != len(host)):
                raise ValueError("the sync-free fetch reads each expert's raw host row, mapped compressed host part "
                                 f"or compressed GPU-tier part; MoE layer {layer} has {len(host)} host experts in "
                                 f"{'no raw rows' if rows is None else f'{rows.shape[0]} raw rows'} and {len(comp)} "
                                 f"compressed of {E}")
            self._host_parts.append(None if raw or not host else
                                    torch.arange(len(host), dtype=torch.int32, device=dev))
            if comp and compressed is None:
                raise ValueError(f"MoE layer {layer} has compressed experts but no compressed tier was given")
            self._comp_ids.append(set(comp))
            self._host_sel.append(_select(host, dev))
            self._comp_sel.append(_select(comp, dev))
            self._parts.append(torch.tensor([table.lookup(layer, e).slot for e in comp], dtype=torch.int32,
                                            device=dev) if comp else None)
        # per layer: (misses, routed, decoded, bytes moved)
        self.counts = torch.zeros(cache.num_layers, 4, dtype=torch.int64, device=dev)
        self._zero = torch.zeros((), dtype=torch.int64, device=dev)   # a count a layer's tiers leave at 0
        self.miss_counts = torch.zeros(cache.num_layers, E, dtype=torch.int32, device=dev)
        self.pending = False     # a forward counted on the device since the last collect
        self.steps = 0           # steps collected since the last refresh
        self.num_steps = 0       # steps that fetched by path (b), in all

    def layer_slots(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Gather (decode) the layer's routed misses into the miss area; the slot map [E] int32 its GEMMs read."""
        from pagedmoe.kernels.uva_gather import gather_rows, plan_misses  # triton: an optional package

        fetch_dst, slots, routed = plan_misses(topk_ids, self.cache.slot_maps[layer], self.cache.miss_base,
                                               with_routed=True)
        from pagedmoe.kernels.lossless_decode import lossless_decode_indexed  # triton: an optional package

        pool = self.cache.pool
        host, comp = self._host_sel[layer], self._comp_sel[layer]
        missed = fetch_dst >= 0
        moved, decoded = self._zero, self._zero
        if host is not None:
            host_dst = fetch_dst[host]
            if self._host_parts[layer] is None:
                gather_rows(self.host_rows[layer], pool, host_dst)
                moved = (host_dst >= 0).sum() * self.expert_bytes
            else:
                mapped = self._encoded(self.host_mapped, layer, "host")
                lossless_decode_indexed(mapped.ct, pool, self._host_parts[layer], host_dst,
                                        num_warps=MAPPED_DECODE_WARPS)
                moved = torch.where(host_dst >= 0, mapped.part_bytes, 0).sum()
                decoded = (host_dst >= 0).sum()
        if comp is not None:
            lossless_decode_indexed(self._encoded(self.compressed, layer, "compressed"), pool, self._parts[layer],
                                    fetch_dst[comp])
            decoded = decoded + missed[comp].sum()
        self.counts[layer] += torch.stack((missed.sum(), routed.sum(), decoded, moved))
        self.miss_counts[layer] += missed.to(torch.int32)
        self.pending = True
        return slots.to(torch.int32)

    @staticmethod
    def _encoded(tier, layer: int, name: str):
        got = tier[layer]
        if got is None:
            raise RuntimeError(f"MoE layer {layer}'s {name} experts are not encoded yet (ExpertStore.finalize)")
        return got

    def collect(self) -> Collected:
        """What was counted since the last collect, summed over layers; after a step only."""
        if not self.pending:
            return Collected(0, 0, 0, 0)
        counted = self.counts.sum(0).tolist()   # NOTE: between steps: the step's results reached the host
        self.counts.zero_()
        self.pending = False
        self.steps += 1
        self.num_steps += 1
        return Collected(*counted)

    def refresh_candidates(self) -> list[list[int]]:
        """Every REFRESH_STEPS collected steps: per layer, the host experts missed in at least REFRESH_MIN_MISSES
        forwards of the window, most missed first (then the counts restart); else nothing."""
        if self.steps < REFRESH_STEPS:
            return []
        self.steps = 0
        counts = self.miss_counts.tolist()
        self.miss_counts.zero_()   # NOTE: in place: the graphs hold this tensor
        return [sorted((e for e, c in enumerate(row) if c >= REFRESH_MIN_MISSES and e not in comp),
                       key=lambda e: -row[e])
                for row, comp in zip(counts, self._comp_ids)]

    def reset(self) -> None:
        """Drop what was counted (capture warm-ups are not traffic of the workload)."""
        self.counts.zero_()
        self.miss_counts.zero_()
        self.pending, self.steps = False, 0
