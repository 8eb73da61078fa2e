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

The per-layer sync rules out CUDA graphs (the model runner runs eager: `syncs_host`). The sync-free
variant (a device-side gather from mapped host memory, kernels/uva_gather.py) is not wired in here yet.
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


class RoutedPager(ExpertPager):
    syncs_host = True   # fetch path (a): one host sync per MoE layer (no CUDA graphs)

    def __init__(self, store, activity=None) -> None:
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

    def set_routers(self, routers) -> None:
        """The MoE layers' routers, in MoE-layer order (engine/startup.py): enables prefetch by prediction."""
        self.routers = list(routers)

    # -- the expert interface -------------------------------------------------------------------
    def begin_forward(self, num_tokens: Optional[int] = None) -> None:
        self.cache.begin_step()

    def before_layer(self, layer: int) -> None:
        pass

    def weights(self, layer: int, topk_ids: Optional[torch.Tensor] = None) -> ExpertOperand:
        if topk_ids is None:
            raise ValueError("routed fetching needs the router's ids")
        if self.activity is not None:
            self.activity.record(layer, topk_ids)
        ids = torch.unique(topk_ids).tolist()   # NOTE: the per-layer host sync of fetch path (a)
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
            moved, decoded = fill.moved_bytes(layer, e), fill.decoded_bytes(layer, e)
            st.bytes_moved += moved
            st.bytes_decoded += decoded
            self.stats.bytes_h2d += moved
            self.stats.bytes_decoded += decoded

    def predict(self, layer: int, x: torch.Tensor) -> None:
        """Prefetch for layer + 1 what its router picks for layer `layer`'s MoE input `x` (called after
        weights(layer), before layer's GEMMs)."""
        nxt = layer + 1
        if nxt >= len(self.routers) or self._skip_host:
            return
        _, ids = self.routers[nxt](x)
        ids = torch.unique(ids).tolist()
        _, misses = self.cache.lookup(nxt, ids, protect=layer)
        self._prefetched[nxt] = {e for e, _ in misses}
        ctx = contextlib.nullcontext()
        if self.cuda:
            self._prefetch_fork.record()
            self.copy_stream.wait_event(self._prefetch_fork)
            ctx = torch.cuda.stream(self.copy_stream)
        with ctx:
            self._fill_pages(nxt, misses)
            if misses:   # NOTE: weights(nxt) publishes only its own misses; a fully predicted layer has none
                self.cache.publish(nxt)
            if self.cuda:
                self.prefetch_done[nxt].record()
        self.cache.stats.prefetched += len(misses)

    def done(self, layer: int) -> None:
        pass

    # -- what the engine reads --------------------------------------------------------------------
    def account_replay(self) -> None:
        raise RuntimeError("routed fetching syncs with the host per layer: it runs without CUDA graphs")

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

    def cache_stats(self) -> dict:
        return dict(self.cache.stats.__dict__)

    @contextlib.contextmanager
    def no_host_copies(self):
        with super().no_host_copies():
            yield
