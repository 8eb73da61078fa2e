"""Where expert bytes live, per tier, and the compute buffers the expert GEMMs read.

Placements:
- resident: every layer owns a device tensor packed [E, stride]; the GEMMs read its views, no copies.
- paged: resident experts of layer l in `resident[l]` (device rows); the other tiers own their storage,
  fill and bytes (experts/tiers/): compressed (`compressed[l]`, lossless on the device), quantized
  (`quantized[l]`, fp8/int8/int4 on the device) and host (`host[l]`, pinned rows, or compressed groups).
  Before layer l's MoE runs, its experts are assembled in a compute buffer whose address is fixed per
  layer, `buffers.packed(l)` (experts/buffers.py): with the plain double buffer, layers l and l+2 share
  one buffer, so resident rows are copied in too (device to device); with CUDA VMM the resident rows are
  mapped into the layer's range and only host rows are copied. Compressed experts are decoded into their
  buffer rows, quantized ones dequantised (experts/pager.py).

Loading: `write` is the loader's sink; a tier that encodes (compressed, quantized, a compressed host tier)
stages raw rows and encodes a layer once its rows are complete; `finalize()` (after loading or dummy init)
encodes whatever is still staged.

Shapes: E experts, H hidden, I expert intermediate size (see experts/layout.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedmoe.experts.buffers import PlainDoubleBuffer
from pagedmoe.experts.dummy import DummyExperts
from pagedmoe.experts.dynamic.versions import DynamicExperts
from pagedmoe.experts.layout import expert_stride, expert_views, row_part
from pagedmoe.experts.table import COMPRESSED, HOST, QUANTIZED, RESIDENT, ExpertTable
from pagedmoe.experts.tiers.compressed import CompressedTier
from pagedmoe.experts.tiers.host import HostTier, pinned_empty
from pagedmoe.experts.tiers.quantized import QuantizedTier
from pagedmoe.planning.kv_sizing import dynamic_build_bytes

__all__ = ["ExpertStore", "pinned_empty"]

# the parts of an expert row each checkpoint tensor kind covers (experts/layout.py::row_part)
_PARTS = {"gate": ("gate",), "up": ("up",), "down": ("down",), "w13": ("gate", "up"), "w2": ("down",)}


class ExpertStore:
    def __init__(self, table: ExpertTable, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                 paged: bool, stride_align_bytes: int = 16, buffers_factory=None,
                 host_compression: str = "none", host_group_experts: int = 0, host_mapped: bool = False,
                 fused_compressed: bool = False, fused_format: str = "tiled", fused_kernel: str = "exact") -> None:
        self.table, self.hidden, self.inter = table, hidden, inter
        self.dtype, self.device, self.paged = dtype, device, paged
        elem = dtype.itemsize
        self.expert_numel = 3 * inter * hidden
        self.stride = expert_stride(hidden, inter, elem, stride_align_bytes)
        self.row_bytes = self.stride * elem
        L, E = table.num_layers, table.num_experts
        self.buffers = None
        self.dynamic = None                          # DynamicExperts under --expert-precision dynamic
        self.host_compression = host_compression
        self.fused_compressed = fused_compressed  # read by the VMM buffers: no rows for the compressed experts
        if host_compression != "none" and (not paged or dtype != torch.bfloat16):
            raise ValueError("--host-compression lossless needs paged placement and bf16 weights (--dtype "
                             "bfloat16)")
        if not paged:
            self.resident = [torch.empty(E, self.stride, dtype=dtype, device=device) for _ in range(L)]
        else:
            self.buffers = buffers_factory(self) if buffers_factory is not None else \
                PlainDoubleBuffer(E, self.stride, dtype, device)
            self.resident = [self.buffers.resident_rows(layer) if self.buffers.maps_resident else
                             torch.empty(table.count(layer, RESIDENT), self.stride, dtype=dtype, device=device)
                             for layer in range(L)]
        self.host_tier = HostTier(table, self.stride, self.expert_numel, dtype, device, paged, host_compression,
                                  host_group_experts, host_mapped)
        self.compressed_tier = CompressedTier(table, self.expert_numel, dtype, device, paged, hidden, inter,
                                              fused=fused_compressed, fused_format=fused_format,
                                              fused_kernel=fused_kernel)
        self.quantized_tier = QuantizedTier(table, hidden, inter, dtype, device, paged)
        # each tier's per-layer lists, under the names the pager, the tests and the stats read
        self.host, self.host_compressed = self.host_tier.rows, self.host_tier.compressed
        self.host_groups, self.host_staging = self.host_tier.groups, self.host_tier.staging
        self.compressed, self.quantized = self.compressed_tier.layers, self.quantized_tier.layers

    # -- where an expert's bytes live ---------------------------------------------------------
    def row(self, layer: int, expert: int) -> torch.Tensor:
        """The master copy of one expert: a 1-D [stride] tensor in its tier. A compressed expert has
        no raw master copy once encoded; before that, this is its staging row [3*I*H]."""
        if not self.paged:
            return self.resident[layer][expert]
        if self.dynamic is not None:   # the host master (experts live at their current rung on the device)
            return self.host[layer][expert]
        entry = self.table.lookup(layer, expert)
        if entry.tier == COMPRESSED:
            if self.compressed_tier.staging[layer] is None:
                raise RuntimeError(f"expert {expert} of MoE layer {layer} is compressed; it has no raw row "
                                   "(decode it with the pager)")
            return self.compressed_tier.staging[layer][entry.slot]
        if entry.tier == QUANTIZED:
            if self.quantized_tier.staging[layer] is None:
                raise RuntimeError(f"expert {expert} of MoE layer {layer} is quantized; it has no raw row "
                                   "(dequantise it with the pager)")
            return self.quantized_tier.staging[layer][entry.slot]
        if entry.tier == HOST and self.host[layer] is None and self.host_compressed[layer]:
            raise RuntimeError(f"expert {expert} of MoE layer {layer} is compressed in host memory; it has no "
                               "raw row (decode it with the pager)")
        store = self.resident[layer] if entry.tier == RESIDENT else self.host[layer]
        return store[entry.slot]

    def write(self, layer: int, expert: int, kind: str, tensor: torch.Tensor) -> None:
        """Loader sink: one checkpoint tensor ('gate', 'up', 'down', 'w13' or 'w2') of one expert."""
        dst = row_part(self.row(layer, expert), self.hidden, self.inter, kind)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} of MoE layer {layer}: {kind} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        entry = self.table.lookup(layer, expert) if self.paged and self.dynamic is None else None
        if entry is not None and entry.tier == COMPRESSED:
            # Encode the layer as soon as every part of every staged row has been written (a part
            # written twice counts once); finalize() encodes rows a checkpoint left incomplete.
            if self.compressed_tier.stage(layer, entry.slot, _PARTS[kind]):
                self._encode(layer)
        elif entry is not None and entry.tier == QUANTIZED:
            if self.quantized_tier.stage(layer, entry.slot, _PARTS[kind]):
                self._quantize(layer)
        elif entry is not None and entry.tier == HOST and self.host_compression == "lossless":
            if self.host_tier.stage(layer, entry.slot, _PARTS[kind]):
                self._compress_host_layer(layer)

    # the tiers' encoders, called per layer once its rows are complete (or given `rows`, device, slot order; the
    # host tier: `read`, experts/tiers/host.py)
    def _encode(self, layer: int, rows: Optional[torch.Tensor] = None, read=None) -> None:
        self.compressed_tier.encode(layer, rows, read)

    def _quantize(self, layer: int, rows: Optional[torch.Tensor] = None) -> None:
        self.quantized_tier.quantize(layer, rows)

    def _compress_host_layer(self, layer: int, read=None) -> None:
        self.host_tier.compress_layer(layer, read)

    def finalize(self) -> None:
        """After loading or dummy init: encode (quantise) every layer whose compressed (quantized) experts
        are still staged."""
        for layer in range(self.table.num_layers):
            if self.compressed_tier.staging[layer] is not None:
                self._encode(layer)
            if self.quantized_tier.staging[layer] is not None:
                self._quantize(layer)
        if self.host_compression == "lossless" and all(v is None for v in self.host_staging):
            for layer in range(self.table.num_layers):
                if self.host[layer] is not None:
                    self._compress_host_layer(layer)
            self.host_tier.build_staging()
        if self.device.type == "cuda" and any(x is not None for x in self.compressed + self.quantized
                                              + self.host_compressed):
            # the encoder's temporaries (~80 B per weight of a chunk) would otherwise stay cached and
            # shrink the free memory the KV cache is sized from
            torch.cuda.empty_cache()

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """N(0, std) weights, generated on the device (fast) a chunk at a time (experts/dummy.py) and written
        to their tier: never a whole layer on the device."""
        gen = DummyExperts(seed + 1, std, self.dtype, self.device)
        n = self.expert_numel
        for layer in range(self.table.num_layers):
            # Experts whose tier encodes (quantises) them go to the encoder from the device, in slot order; the
            # rest are written to their rows. Staging them in host memory first would copy every compressed
            # weight device -> host -> device, through pageable memory (GLM-4.5-Air: 95 GB).
            encoded: dict[str, dict[int, int]] = {COMPRESSED: {}, QUANTIZED: {}, HOST: {}}
            for e in range(self.table.num_experts):
                entry = self.table.lookup(layer, e) if self.paged and self.dynamic is None else None
                if entry is not None and (entry.tier in (COMPRESSED, QUANTIZED)
                                          or entry.tier == HOST and self.host_compression == "lossless"):
                    encoded[entry.tier][entry.slot] = e
                else:
                    gen.fill(layer, e, self.row(layer, e)[:n])
            ids = {tier: [by_slot[k] for k in sorted(by_slot)] for tier, by_slot in encoded.items() if by_slot}
            # the lossless tiers encode straight from the generator (codecs/lossless_groups.py); the quantizer
            # (and the tiled format) take the layer's device rows at once
            reader = {tier: lambda slot, a, b, ids=ids[tier], l=layer: gen.read(l, ids[slot], a, b, n) for tier in ids}
            for tier, encode in ((COMPRESSED, self._encode), (QUANTIZED, self._quantize)):
                if tier not in ids:
                    continue
                if tier == COMPRESSED and not self.fused_compressed:
                    encode(layer, None, reader[tier])
                    continue
                rows = torch.empty(len(ids[tier]), n, dtype=self.dtype, device=self.device)
                for row, e in zip(rows, ids[tier]):
                    gen.fill(layer, e, row)
                encode(layer, rows)
                del rows
            if HOST in ids:
                self._compress_host_layer(layer, reader[HOST])
        self.finalize()

    # -- what the GEMMs read --------------------------------------------------------------------
    def compute_packed(self, layer: int) -> torch.Tensor:
        return self.buffers.packed(layer) if self.paged else self.resident[layer]

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return expert_views(self.compute_packed(layer), self.hidden, self.inter)

    # -- sizes ------------------------------------------------------------------------------------
    def _bytes(self, tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def resident_bytes(self) -> int:
        if self.paged and self.buffers.maps_resident:
            return sum(self.table.count(l, RESIDENT) for l in range(self.table.num_layers)) * self.row_bytes
        return self._bytes(self.resident)

    @property
    def host_bytes(self) -> int:
        return self.host_tier.nbytes

    @property
    def compressed_bytes(self) -> int:
        """Device bytes of the lossless compressed tier (0 until encoded)."""
        return self.compressed_tier.nbytes

    @property
    def quantized_bytes(self) -> int:
        """Device bytes of the quantized tier: data + scales, exactly `quant.bytes_of` per weight."""
        return self.quantized_tier.nbytes

    @property
    def dynamic_bytes(self) -> int:
        """Device bytes of the experts under dynamic precision: the floor every expert is guaranteed
        (what the KV cache is sized around; the rest is lent from the KV cache: experts/dynamic/controller.py)."""
        return self.dynamic_floor_bytes if self.dynamic is not None else 0

    @property
    def dynamic_build_bytes(self) -> int:
        """Room a dynamic-precision build needs beside the published versions (built one layer at a time:
        planning/kv_sizing.py::dynamic_build_bytes); 0 without dynamic precision."""
        if self.dynamic is None:
            return 0
        bf16 = self.dynamic.bytes_per_rung()["bf16"]
        return dynamic_build_bytes(self.dynamic.num_experts, bf16, self.expert_numel)

    def enable_dynamic(self, min_precision: str, lossless: bool = True):
        """--expert-precision dynamic: every expert paged from the host tier becomes the master of a
        DynamicExperts (its device forms are built by the DynamicPrecisionManager). `lossless`: offer the
        lossless rung (bf16 weights, and compute buffers filled every forward)."""
        if not self.paged or self.buffers.maps_resident or any(
                self.table.count(l, t) for l in range(self.table.num_layers) for t in (RESIDENT, COMPRESSED,
                                                                                     QUANTIZED)):
            raise ValueError("dynamic precision needs every expert in the host tier and plain compute buffers")
        self.dynamic = DynamicExperts(self, self.host, min_precision, lossless)
        self.dynamic_floor_bytes = len(self.dynamic.keys) * self.dynamic.bytes_per_rung()[min_precision]
        return self.dynamic

    @property
    def buffer_bytes(self) -> int:
        """Compute buffers, plus the staging copies of a compressed host tier."""
        return self.buffers.nbytes + self.host_tier.staging_bytes if self.paged else 0

    @property
    def device_bytes(self) -> int:
        if self.dynamic is not None:
            return self.dynamic_bytes + self.buffer_bytes
        return self.resident_bytes + self.compressed_bytes + self.quantized_bytes + self.buffer_bytes
