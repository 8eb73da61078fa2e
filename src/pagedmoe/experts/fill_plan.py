"""The host-side plan of every MoE layer's fill: which rows the pager copies (host tier, and resident rows
into a plain double buffer), decodes (compressed tiers) and dequantises (quantized tier) into the layer's
compute rows, and the bytes each moves. Built from the store once loading is done (experts/pager.py
builds it on first use, after ExpertStore.finalize); the fills run on whatever stream is current.

Shapes: n = 3*I*H weights of one expert; rows may be padded to a longer stride (VMM granularity).
"""
from __future__ import annotations

import torch

from pagedmoe.experts.layout import consecutive_runs
from pagedmoe.experts.table import COMPRESSED, HOST, QUANTIZED, RESIDENT


class FillPlan:
    def __init__(self, store) -> None:
        self.store = store
        self.num_layers = store.table.num_layers
        # (destination row, source row, is_host) copies of each layer
        self.copies = [self._layer_copies(layer) for layer in range(self.num_layers)]
        # a compressed host tier: per group, (host array, staging array) copies, its staging view, its rows
        self.host_experts = [self._layer_host_experts(layer) for layer in range(self.num_layers)]
        self.bytes_per_layer = [(sum(s.numel() * s.element_size() for _, s, h in c if h)
                                 + sum(src.numel() * src.element_size() for arrays, _, _ in he for src, _ in arrays),
                                 sum(s.numel() * s.element_size() for _, s, h in c if not h))
                                for c, he in zip(self.copies, self.host_experts)]
        # Per layer: (parts [p0, p1), destination) decode launches of its compressed experts.
        self.decodes = [self._layer_decodes(layer) for layer in range(self.num_layers)]
        elem = store.dtype.itemsize
        fused = store.compressed_tier.fused  # --compressed-gemm fused: the GEMMs read the compressed tier
        self.decoded_per_layer = [(store.table.count(layer, COMPRESSED) * (not fused)
                                   + sum(view.num_parts for _, view, _ in self.host_experts[layer]))
                                  * store.expert_numel * elem for layer in range(self.num_layers)]
        self.dequantized_per_layer = [store.table.count(layer, QUANTIZED) * store.expert_numel * elem
                                      for layer in range(self.num_layers)]

    def _layer_host_experts(self, layer: int) -> list[tuple[list, object, torch.Tensor]]:
        store = self.store
        cts, views = store.host_compressed[layer], store.host_staging[layer]
        if not cts:
            return []
        names = ("stream", "block_bit_offsets", "lane_bits", "raw")  # what the decoder reads
        dst, n = store.buffers.packed(layer), store.expert_numel
        # a group of k consecutive experts decodes into their rows [k, n] (padded rows: a row stride)
        return [([(getattr(ct, name), getattr(view, name)) for name in names], view, dst[e0:e0 + k, :n])
                for ct, view, (e0, k) in zip(cts, views, store.host_groups[layer])]

    def _layer_copies(self, layer: int):
        store, table = self.store, self.store.table
        dst = store.buffers.packed(layer)
        n = store.expert_numel  # rows may be padded (VMM granularity): copy the weights only
        copies = [] if store.host_compressed[layer] else \
            [(dst[e, :n], store.row(layer, e)[:n], True) for e in table.ids(layer, HOST)]
        if not store.buffers.maps_resident:
            copies += [(dst[e, :n], store.row(layer, e)[:n], False) for e in table.ids(layer, RESIDENT)]
        return copies

    def _layer_decodes(self, layer: int) -> list[tuple[int, int, torch.Tensor]]:
        """Runs of compressed experts whose parts and buffer rows are both consecutive: one decode each,
        into the run's rows [k, expert_numel] (row padding up to the stride is skipped by the decoder)."""
        store = self.store
        ids = store.table.ids(layer, COMPRESSED)  # slot (= part) order is expert-id order
        if not ids or store.compressed_tier.fused:  # fused: read where they are, by the GEMMs
            return []
        dst, n = store.buffers.packed(layer), store.expert_numel
        return [(p0, p0 + k, dst[e0:e0 + k, :n]) for p0, e0, k in consecutive_runs(ids)]

    def device_work(self, layer: int, direct: bool) -> bool:
        """Whether the layer's fill reads GPU tiers (dynamic precision fills from its versions instead)."""
        return self.store.dynamic is None and (
            bool(self.decodes[layer]) or bool(self.dequantized_per_layer[layer] and not direct))

    def fill_copies(self, layer: int, skip_host: bool, non_blocking: bool, direct: bool) -> None:
        """The part of layer `layer`'s fill that reads host memory (on CUDA, the copy stream): copies from the
        host tier (and resident rows for the plain double buffer), a compressed host tier's copies and their
        decodes; under dynamic precision the whole fill (device work only). On CPU synchronously."""
        dyn = self.store.dynamic
        if dyn is not None:
            # NOTE: read the published version once: a publish happens only between steps.
            if not direct:  # direct: the MoE layer reads the version's parts (weights())
                dyn.versions[layer].fill(self.store.buffers.packed(layer))
            return
        for dst, src, from_host in self.copies[layer]:
            if not (from_host and skip_host):
                dst.copy_(src, non_blocking=non_blocking)
        if self.host_experts[layer]:
            from pagedmoe.kernels.lossless_decode import decode_runs  # triton: an optional package

            for arrays, view, rows in self.host_experts[layer]:
                if not skip_host:
                    for src, dst in arrays:
                        dst.copy_(src, non_blocking=non_blocking)
                decode_runs(view, [(0, view.num_parts, rows)])

    def fill_on_device(self, layer: int, direct: bool) -> None:
        """The part of the fill from GPU tiers (on CUDA, the decode stream, beside the copies): lossless
        decodes of the compressed tier, dequantisation of the quantized one."""
        if self.decodes[layer]:
            from pagedmoe.kernels.lossless_decode import decode_runs  # triton: an optional package

            decode_runs(self._compressed(layer), self.decodes[layer])
        if self.dequantized_per_layer[layer] and not direct:
            # NOTE: sync-free: on CUDA one Triton launch per weight kind (kernels/dequant.py), on CPU the
            # PyTorch reference.
            self._quantized(layer).dequantize_into(self.store.buffers.packed(layer))

    def _compressed(self, layer: int):
        ct = self.store.compressed[layer]
        if ct is None:
            raise RuntimeError(f"MoE layer {layer}'s compressed experts are not encoded yet (ExpertStore.finalize)")
        return ct

    def _quantized(self, layer: int):
        q = self.store.quantized[layer]
        if q is None:
            raise RuntimeError(f"MoE layer {layer}'s quantized experts are not quantised yet (ExpertStore.finalize)")
        return q
