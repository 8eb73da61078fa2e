"""Routed fetching (`--expert-fetch routed`): paged placement's experts object that brings in only the experts
the router picks, into the GPU expert cache (experts/cache.py), instead of streaming every host expert of
every layer (experts/pager.py, `--expert-fetch stream`).

Per MoE layer, in `weights(layer, topk_ids)`: the distinct routed ids reach the host (one sync per layer:
fetch path (a)), the cache names the hits and gives each miss a slot, the misses are copied from pinned
host memory into their slots on the compute stream (so the copy follows every earlier GEMM that read the
slot it overwrites, and precedes this layer's), the layer's slot map is written, and the layer gets
`DenseOperand(pool views, slots=slot_map)`: the MoE layer maps its router ids through the slot map and
runs the same GEMMs over the pool. Each token meets the same weights in the same layout as in resident
placement, so the logits are bit-identical.

Prefetch by prediction (`predict`, called by the MoE layer between `weights` and its GEMMs, once the
routers are known: `set_routers`): layer l+1's router applied to layer l's MoE input names the experts layer
l+1 will likely route to (recall 0.80-0.87 on the default model, benchmarks/routed_cpu.py); those not cached
are copied on the copy stream while layer l computes (after an event on the compute stream: every GEMM
that read a victim page was issued before it; layer l's pages are never victims); layer l+1's `weights`
waits for those copies and fetches what the prediction missed on demand.

Stream steps (`stream_min_tokens`, settled by the cost model: planning/fetch_cost.py::stream_step_min_tokens):
a forward of at least that many tokens that does not take path (b) (a prefill chunk, a large decode batch) routes
to nearly every expert of every layer, so it prefetches like stream-all instead: `begin_forward` fills every expert
of the first MoE layer that is not cached on the copy stream, and `weights(l)` waits for layer l's fills, then
starts layer l+1's (never into layer l's pages) while layer l computes, and returns the slot map with no host sync.
Under `protect` the cache may give layer l+1 fewer pages than it misses (fewer than 2 x E pages outside the miss
area): such a layer fetches what it lacks by path (a) (one sync) before layer l+2's prefetch starts. The experts
it routes to are the activity table's count of the step (experts/activity.py::step_distinct), read in `end_step`.

The per-layer sync rules out CUDA graphs. Forwards of at most `graph_max_seqs` tokens (the decode buckets the
cost model gives to it, `--expert-fetch-path`) take fetch path (b) instead (experts/routed_uva.py): the misses
are planned on the device and gathered from mapped pinned host memory by a GPU kernel, no sync, so the model
runner captures those buckets' decode steps in CUDA graphs and runs the rest eager (`syncs_host`). Path (b) reads
the raw host tier (gathered) or the compressed host tier (decoded from mapped host memory), and the compressed GPU
tier (decoded on the device).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from pagedmoe.experts.cache import ExpertCache
from pagedmoe.experts.interface import DenseOperand, ExpertOperand
from pagedmoe.experts.layout import expert_views
from pagedmoe.experts.pager import ExpertPager
from pagedmoe.experts.routed_fill import RoutedFill
from pagedmoe.experts.routed_uva import SyncFreeFetch


# Up to this many router picks a forward's ids reach the host as they are (one small device -> host copy) and
# the host dedups them; more (prefill) are deduplicated on the device first (torch.unique syncs to size its
# output, then a second copy brings at most E ids).
HOST_UNIQUE_MAX_IDS = 4096


def routed_ids(topk_ids: torch.Tensor) -> list[int]:
    """The distinct expert ids of a layer's router picks, ascending (a host sync)."""
    if topk_ids.numel() <= HOST_UNIQUE_MAX_IDS:
        return sorted(set(topk_ids.reshape(-1).tolist()))
    return torch.unique(topk_ids).tolist()


class RoutedPager(ExpertPager):
    syncs_host = True   # fetch path (a): one host sync per MoE layer (graphs only up to graph_max_seqs)

    def __init__(self, store, activity=None, sync_free_max_tokens: int = 0, stream_min_tokens: int = 0) -> None:
        super().__init__(store, timing=False, activity=activity)
        self.cache: ExpertCache = store.buffers
        self._w13, self._w2 = expert_views(self.cache.pool, store.hidden, store.inter)
        self.expert_bytes = store.expert_numel * store.dtype.itemsize
        self.routers: list = []                     # per MoE layer: x -> (topk weights, topk ids) (set_routers)
        self._prefetched: dict[int, set] = {}       # layer -> experts prefetched for it this forward
        self._fill: Optional[RoutedFill] = None     # how a page is filled from each expert's master copy
        if self.cuda:
            self.prefetch_done = [torch.cuda.Event() for _ in range(self.num_layers)]
            self._prefetch_fork = torch.cuda.Event()
        # fetch path (b), for forwards of at most sync_free_max_tokens tokens; None: path (a) only
        self.sync_free = (SyncFreeFetch(self.cache, store.host, sync_free_max_tokens, store.compressed,
                                        store.host_tier.uva if store.host_compression == "lossless" else None, self.expert_bytes)
                          if sync_free_max_tokens else None)
        self._sync_free_now = False     # this forward fetches by path (b)
        self.refreshed_pages = 0        # pages path (b)'s refresh filled between steps
        # stream steps: forwards of at least this many tokens (not path (b)) prefetch every expert a layer ahead;
        # 0: never (ExpertPlan.stream_min_tokens; tests set it directly)
        self.stream_min_tokens = stream_min_tokens
        self._stream_now = False        # this forward is a stream step
        self._covered: list[bool] = [False] * self.num_layers   # stream step: the prefetch gave layer l all E
        self._stream_pending = False    # a stream step ran whose routed experts end_step has not counted

    @property
    def graph_max_seqs(self) -> int:
        """The largest decode batch whose steps need no host sync (CUDA graphs up to it); 0: none."""
        return self.sync_free.max_tokens if self.sync_free is not None else 0

    def set_routers(self, routers) -> None:
        """The MoE layers' routers, in MoE-layer order (engine/startup.py): enables prefetch by prediction."""
        self.routers = list(routers)

    # -- the expert interface -------------------------------------------------------------------
    def begin_forward(self, num_tokens: Optional[int] = None) -> None:
        self.cache.begin_step()
        self._sync_free_now = (self.sync_free is not None and num_tokens is not None
                               and num_tokens <= self.sync_free.max_tokens)
        self._stream_now = (not self._sync_free_now and self.stream_min_tokens > 0 and num_tokens is not None
                            and num_tokens >= self.stream_min_tokens)
        if self._stream_now:   # NOTE: the fork follows every GEMM of the previous forward: any page may go
            self._stream_prefetch(0, protect=-1)

    def before_layer(self, layer: int) -> None:
        pass

    def weights(self, layer: int, topk_ids: Optional[torch.Tensor] = None, counted: bool = False) -> ExpertOperand:
        if topk_ids is None:
            raise ValueError("routed fetching needs the router's ids")
        if self.activity is not None and not counted:
            self.activity.record(layer, topk_ids)
        if self._sync_free_now:   # fetch path (b): planned and gathered on the device (counted in end_step)
            if not (self._skip_host or self.cuda and torch.cuda.is_current_stream_capturing()):
                self.stats.layers_loaded += 1
            return DenseOperand(self._w13, self._w2, self.sync_free.layer_slots(layer, topk_ids))
        if self._stream_now:
            return self._stream_weights(layer, topk_ids)
        ids = routed_ids(topk_ids)   # NOTE: the per-layer host sync of fetch path (a)
        predicted = self._prefetched.pop(layer, None)
        if predicted is not None and self.cuda:
            torch.cuda.current_stream().wait_event(self.prefetch_done[layer])
        hits, misses = self.cache.lookup(layer, ids)
        # NOTE: filled even under no_host_copies(): a page the cache names must hold its expert
        self._fill_pages(layer, misses)
        if misses:
            self.cache.publish(layer)
        if not self._skip_host:
            st = self.cache.stats
            st.hits += len(hits)
            st.misses += len(misses)
            st.bytes_routed += len(ids) * self.expert_bytes
            if predicted:
                st.prefetch_hits += len(predicted.intersection(ids))
            self.stats.layers_loaded += 1
        return DenseOperand(self._w13, self._w2, self.cache.slot_maps[layer])

    def _fill_pages(self, layer: int, misses) -> None:
        """Fill each missed expert's page from its master copy (experts/routed_fill.py), on the current stream,
        and count the bytes moved host -> device and decoded."""
        if self._fill is None:   # built on first use: after ExpertStore.finalize built the host staging
            self._fill = RoutedFill(self.store)
        fill, st = self._fill, self.cache.stats
        for e, slot in misses:
            fill.fill(layer, e, self.cache.pool[slot], non_blocking=True)
            if self._skip_host:   # CUDA-graph warm-ups: not traffic of the workload
                continue
            moved, decoded = fill.moved_bytes(layer, e), fill.decoded_bytes(layer, e)
            st.bytes_moved += moved
            st.bytes_decoded += decoded
            self.stats.bytes_h2d += moved
            self.stats.bytes_decoded += decoded

    def predict(self, layer: int, x: torch.Tensor) -> None:
        """Prefetch for layer + 1 what its router picks for layer `layer`'s MoE input `x` (called after
        weights(layer), before layer's GEMMs). A stream step prefetches every expert already."""
        nxt = layer + 1
        if nxt >= len(self.routers) or self._skip_host or self._sync_free_now or self._stream_now:
            return
        _, ids = self.routers[nxt](x)
        _, misses = self._prefetch(nxt, routed_ids(ids), protect=layer)
        self._prefetched[nxt] = {e for e, _ in misses}
        self.cache.stats.prefetched += len(misses)

    def _prefetch(self, layer: int, ids, protect: int) -> tuple[list, list]:
        """Look `ids` of `layer` up and fill the misses on the copy stream (after an event on the compute stream:
        every GEMM that read a victim page was issued before it; layer `protect`'s pages are never victims), then
        record prefetch_done[layer], which `weights(layer)` waits for. Returns the lookup's (hits, misses)."""
        hits, misses = self.cache.lookup(layer, ids, protect=protect)
        ctx = contextlib.nullcontext()
        if self.cuda:
            self._prefetch_fork.record()
            self.copy_stream.wait_event(self._prefetch_fork)
            ctx = torch.cuda.stream(self.copy_stream)
        with ctx:
            self._fill_pages(layer, misses)
            if misses:   # NOTE: weights(layer) publishes only its own misses; a fully prefetched layer has none
                self.cache.publish(layer)
            if self.cuda:
                self.prefetch_done[layer].record()
        return hits, misses

    def _stream_prefetch(self, layer: int, protect: int) -> None:
        """A stream step's prefetch of every expert of `layer` not cached (best effort under `protect`)."""
        E = self.cache.num_experts
        hits, misses = self._prefetch(layer, range(E), protect)
        self._covered[layer] = len(hits) + len(misses) == E
        if not self._skip_host:
            st = self.cache.stats
            st.hits += len(hits)
            st.misses += len(misses)
            st.streamed += len(misses)

    def _stream_weights(self, layer: int, topk_ids: torch.Tensor) -> ExpertOperand:
        """weights(layer) in a stream step: wait for the layer's prefetch, fetch by path (a) what it could not
        cover, then start the next layer's prefetch; no host sync when the prefetch covered the layer."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.prefetch_done[layer])
        if not self._covered[layer]:   # NOTE: before the next prefetch, whose pages it could otherwise evict
            _, misses = self.cache.lookup(layer, routed_ids(topk_ids))
            self._fill_pages(layer, misses)
            if misses:
                self.cache.publish(layer)
            if not self._skip_host:
                self.cache.stats.misses += len(misses)
                self.cache.stats.streamed += len(misses)
        if not self._skip_host:   # the distinct routed experts: the activity table's count (read in end_step)
            self._stream_pending = True
            self.stats.layers_loaded += 1
        if layer + 1 < self.num_layers:
            self._stream_prefetch(layer + 1, protect=layer)
        return DenseOperand(self._w13, self._w2, self.cache.slot_maps[layer])

    def done(self, layer: int) -> None:
        pass

    # -- what the engine reads --------------------------------------------------------------------
    def account_replay(self) -> None:
        """A CUDA-graph replay ran fetch path (b) in every layer; its device counters counted the misses."""
        if self.sync_free is None:
            raise RuntimeError("routed fetching by path (a) syncs with the host per layer: it runs without CUDA "
                               "graphs")
        self.stats.layers_loaded += self.num_layers
        self.sync_free.pending = True   # the replay counted on the device: collect after the step

    def end_step(self) -> None:
        """After the step's results reached the host: fold path (b)'s device counters into the stats; every
        REFRESH_STEPS steps page the experts it kept missing into the cache (copy engine, between steps); fold the
        stream step's routed experts (the activity table's count of the step, ended before this) into bytes_routed."""
        super().end_step()
        if self._stream_pending:   # the step's results reached the host: this read waits for nothing
            if self.activity is not None:
                self.cache.stats.bytes_routed += int(self.activity.step_distinct) * self.expert_bytes
            self._stream_pending = False
        if self.sync_free is None:
            return
        misses, routed, decoded, moved = self.sync_free.collect()
        st = self.cache.stats
        st.misses += misses
        st.hits += routed - misses
        st.bytes_moved += moved
        st.bytes_decoded += decoded * self.expert_bytes
        st.bytes_routed += routed * self.expert_bytes
        self.stats.bytes_h2d += moved
        self.stats.bytes_decoded += decoded * self.expert_bytes
        changed = []
        for layer, ids in enumerate(self.sync_free.refresh_candidates()):
            if ids:
                _, fills = self.cache.lookup(layer, ids)
                self._fill_pages(layer, fills)   # NOTE: on the compute stream, before the next forward
                self.refreshed_pages += len(fills)
                if fills:
                    changed.append(layer)
        if changed:
            self.cache.publish(*changed)   # one copy of the maps for every layer the refresh filled

    @property
    def bytes_per_forward(self) -> int:
        """Not fixed: what a forward moves depends on what is routed and cached (see `cache.stats`)."""
        return 0

    def refresh(self) -> None:
        super().refresh()
        self._fill = None

    def reset_stats(self) -> None:
        super().reset_stats()
        self.cache.stats = type(self.cache.stats)()
        self._stream_pending = False
        if self.sync_free is not None:
            self.sync_free.reset()

    def cache_stats(self) -> dict:
        return dict(self.cache.stats.__dict__)

    @contextlib.contextmanager
    def no_host_copies(self):
        with super().no_host_copies():
            yield
