"""Where expert bytes live, per tier, and the compute buffers the expert GEMMs read.

Placements:
- resident: every layer owns a device tensor packed [E, stride]; the GEMMs read its views, no copies.
- paged: resident experts of layer l in `resident[l]` (device rows), compressed experts in
  `compressed[l]` (one lossless CompressedTensor per layer on the device, one part per expert in slot
  order; codecs/lossless.py), the others in `host[l]` (pinned rows). Before layer l's MoE runs, its
  experts are assembled in a compute buffer whose address is fixed per layer: `buffers.packed(l)`.
  With the plain double buffer, layers l and l+2 share one buffer, so resident rows are copied in too
  (device to device); with CUDA VMM (experts/vmm.py) the resident rows are mapped into the layer's
  range and only host rows are copied. Compressed experts are decoded into their buffer rows
  (experts/pager.py); quantized experts (`quantized[l]`, one QuantizedLayer of fp8/int8/int4 experts
  on the device, experts/quantized.py) are dequantised into theirs.

Loading a compressed expert: `write` stages its raw row in host memory; once every staged row of a
layer is complete the layer is encoded (on the device) and its staging freed; `finalize()` (called
by the loader after loading or dummy init) encodes whatever is still staged. Quantized experts are
staged the same way and quantised (on the device) once the layer's staged rows are complete; the raw
rows are then dropped: static precision modes keep no bf16 master (promotion is a later, dynamic mode).

Shapes: E experts, H hidden, I expert intermediate size (see experts/layout.py).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from pagedmoe.engine.memory import dynamic_build_bytes
from pagedmoe.experts.layout import consecutive_runs, expert_stride, expert_views, row_part
from pagedmoe.experts.placement import HOST_STAGING_SLOTS, host_group_experts
from pagedmoe.experts.table import COMPRESSED, HOST, QUANTIZED, RESIDENT, ExpertTable


# the parts of an expert row each checkpoint tensor kind covers (experts/layout.py::row_part)
_PARTS = {"gate": ("gate",), "up": ("up",), "down": ("down",), "w13": ("gate", "up"), "w2": ("down",)}


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly this size.

    `torch.empty(..., pin_memory=True)` goes through the caching host allocator, which rounds every
    block up to a power of two (a 2.6 GiB Mixtral layer would pin 4 GiB, 128 GiB for the model), so
    the pages are allocated normally and registered with the driver instead.
    """
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    # Fault the pages in on every core first (zero_ runs in parallel): cudaHostRegister faults fresh
    # pages in one by one on one thread (GLM-4.5-Air's 100 GiB host tier: load 147 s that way, 52 s this way).
    t.zero_()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1)  # 1: cudaHostRegisterPortable
    if int(err) != 0 or not t.is_pinned():
        # Fall back on the caching allocator (exact size lost, but copies stay asynchronous).
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    # NOTE: registered pages must be unregistered before they are freed.
    weakref.finalize(t, _unregister, t.data_ptr())
    return t


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process is going away anyway
        pass


class PlainDoubleBuffer:
    """Two [E, stride] device buffers; layer l uses buffer l % 2. Works anywhere (CPU included)."""

    maps_resident = False  # resident rows must be copied in

    def __init__(self, num_experts: int, stride: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffers = [torch.empty(num_experts, stride, dtype=dtype, device=device) for _ in range(2)]

    def packed(self, layer: int) -> torch.Tensor:
        return self.buffers[layer % 2]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class ExpertStore:
    def __init__(self, table: ExpertTable, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                 paged: bool, stride_align_bytes: int = 16, buffers_factory=None,
                 host_compression: str = "none") -> None:
        self.table, self.hidden, self.inter = table, hidden, inter
        self.dtype, self.device, self.paged = dtype, device, paged
        elem = dtype.itemsize
        self.expert_numel = 3 * inter * hidden
        self.stride = expert_stride(hidden, inter, elem, stride_align_bytes)
        self.row_bytes = self.stride * elem
        L, E = table.num_layers, table.num_experts
        pin = device.type == "cuda"
        self.buffers = None
        self.host: list[Optional[torch.Tensor]] = [None] * L
        self.compressed: list = [None] * L          # CompressedTensor per layer (paged, compressed tier)
        self._staging: list[Optional[torch.Tensor]] = [None] * L  # raw rows [n_comp, 3*I*H] until encoded
        self._staged_parts: list[set] = [set() for _ in range(L)]  # (slot, 'gate'|'up'|'down') written
        self.quantized: list = [None] * L           # QuantizedLayer per layer (paged, quantized tier)
        self._qstaging: list[Optional[torch.Tensor]] = [None] * L  # raw rows [n_quant, 3*I*H] until quantised
        self._qstaged_parts: list[set] = [set() for _ in range(L)]
        self._host_staged_parts: list[set] = [set() for _ in range(L)]  # host rows written (compressed host tier)
        self.dynamic = None                          # DynamicExperts under --expert-precision dynamic
        # --host-compression lossless: per layer, its host experts in groups of consecutive ids (at most
        # HOST_GROUP_BYTES of bf16 each), each group a CompressedTensor (one part per expert) in pinned host
        # memory, copied into one of HOST_STAGING_SLOTS device staging slots and decoded into its compute
        # rows by the pager in one launch.
        self.host_compression = host_compression
        self.host_compressed: list = [None] * L
        self.host_groups: list = [None] * L         # per layer: (first expert id, experts) of each group
        self.host_staging: list = [None] * L        # per layer: the groups' device views into the slots
        self._host_staging_bytes = 0
        if host_compression != "none" and (not paged or dtype != torch.bfloat16):
            raise ValueError("--host-compression lossless needs paged placement and bf16 weights (--dtype "
                             "bfloat16)")
        if not paged:
            self.resident = [torch.empty(E, self.stride, dtype=dtype, device=device) for _ in range(L)]
            return
        if buffers_factory is not None:
            self.buffers = buffers_factory(self)
        else:
            self.buffers = PlainDoubleBuffer(E, self.stride, dtype, device)
        self.resident = []
        for layer in range(L):
            n_res, n_host = table.count(layer, RESIDENT), table.count(layer, HOST)
            if self.buffers.maps_resident:
                self.resident.append(self.buffers.resident_rows(layer))
            else:
                self.resident.append(torch.empty(n_res, self.stride, dtype=dtype, device=device))
            # With a compressed host tier the raw rows only stage a layer until it is encoded (pageable,
            # touched lazily): pinning them all first would peak host memory at the raw host tier.
            self.host[layer] = pinned_empty((n_host, self.stride), dtype) if pin and host_compression == "none" \
                else torch.empty(n_host, self.stride, dtype=dtype)
            n_comp = table.count(layer, COMPRESSED)
            if n_comp:
                if dtype != torch.bfloat16:
                    raise ValueError(f"the lossless compressed tier holds bf16 weights; the model runs in {dtype} "
                                     "(use --dtype bfloat16)")
                self._staging[layer] = torch.empty(n_comp, self.expert_numel, dtype=dtype)
            n_quant = table.count(layer, QUANTIZED)
            if n_quant:
                self._qstaging[layer] = torch.empty(n_quant, self.expert_numel, dtype=dtype)

    # -- where an expert's bytes live ---------------------------------------------------------
    def row(self, layer: int, expert: int) -> torch.Tensor:
        """The master copy of one expert: a 1-D [stride] tensor in its tier. A compressed expert has
        no raw master copy once encoded; before that, this is its staging row [3*I*H]."""
        if not self.paged:
            return self.resident[layer][expert]
        if self.dynamic is not None:   # the host master (experts live at their current rung on the device)
            return self.host[layer][expert]
        entry = self.table._entries[layer][expert]
        if entry.tier == COMPRESSED:
            if self._staging[layer] is None:
                raise RuntimeError(f"expert {expert} of MoE layer {layer} is compressed; it has no raw row "
                                   "(decode it with the pager)")
            return self._staging[layer][entry.slot]
        if entry.tier == QUANTIZED:
            if self._qstaging[layer] is None:
                raise RuntimeError(f"expert {expert} of MoE layer {layer} is quantized; it has no raw row "
                                   "(dequantise it with the pager)")
            return self._qstaging[layer][entry.slot]
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
        entry = self.table._entries[layer][expert] if self.paged and self.dynamic is None else None
        if entry is not None and entry.tier == COMPRESSED:
            # Encode the layer as soon as every part of every staged row has been written (a part
            # written twice counts once); finalize() encodes rows a checkpoint left incomplete.
            self._staged_parts[layer].update((entry.slot, p) for p in _PARTS[kind])
            if len(self._staged_parts[layer]) == 3 * self._staging[layer].shape[0]:
                self._encode(layer)
        elif entry is not None and entry.tier == QUANTIZED:
            self._qstaged_parts[layer].update((entry.slot, p) for p in _PARTS[kind])
            if len(self._qstaged_parts[layer]) == 3 * self._qstaging[layer].shape[0]:
                self._quantize(layer)
        elif entry is not None and entry.tier == HOST and self.host_compression == "lossless":
            self._host_staged_parts[layer].update((entry.slot, p) for p in _PARTS[kind])
            if len(self._host_staged_parts[layer]) == 3 * self.host[layer].shape[0]:
                self._compress_host_layer(layer)

    def _encode(self, layer: int, rows: Optional[torch.Tensor] = None) -> None:
        """Encode the layer's compressed experts: their staged rows, or `rows` (device, slot order) given."""
        from pagedmoe.codecs.lossless import encode

        staged = self._staging[layer] if rows is None else rows
        # One tensor per layer, one part per expert: a shared codebook, and a run of experts decodes
        # with one kernel launch. Checksums guard files, not device memory: skipped.
        ct = self.compressed[layer] = encode(staged.to(self.device), num_parts=staged.shape[0], checksum=False)
        if self.device.type == "cuda":
            from pagedmoe.kernels.lossless_decode import prepare_launch

            prepare_launch(ct)  # NOTE: host work, before any CUDA-graph capture
        self._staging[layer] = None
        self._staged_parts[layer] = set()

    def _quantize(self, layer: int, rows: Optional[torch.Tensor] = None) -> None:
        """Quantise the layer's quantized experts: their staged rows, or `rows` (slot order) given."""
        from pagedmoe.experts.quantized import QuantizedLayer

        ids = self.table.ids(layer, QUANTIZED)  # slot order = expert-id order
        precision = self.table._entries[layer][ids[0]].precision
        self.quantized[layer] = QuantizedLayer.quantize_rows(self._qstaging[layer] if rows is None else rows,
                                                             precision, self.hidden, self.inter, ids, self.device)
        self._qstaging[layer] = None
        self._qstaged_parts[layer] = set()

    def finalize(self) -> None:
        """After loading or dummy init: encode (quantise) every layer whose compressed (quantized) experts
        are still staged."""
        for layer in range(self.table.num_layers):
            if self._staging[layer] is not None:
                self._encode(layer)
            if self._qstaging[layer] is not None:
                self._quantize(layer)
        if self.host_compression == "lossless" and all(v is None for v in self.host_staging):
            for layer in range(self.table.num_layers):
                if self.host[layer] is not None:
                    self._compress_host_layer(layer)
            self._build_host_staging()
        if self.device.type == "cuda" and any(x is not None for x in self.compressed + self.quantized
                                              + self.host_compressed):
            # the encoder's temporaries (~80 B per weight of a chunk) would otherwise stay cached and
            # shrink the free memory the KV cache is sized from
            torch.cuda.empty_cache()

    def _compress_host_layer(self, layer: int, rows: Optional[torch.Tensor] = None) -> None:
        """Encode one layer's host rows (on the device: fast; one codebook per layer), or `rows` (device,
        slot order) given; keep each expert's part in pinned host memory and free the raw rows."""
        from pagedmoe.codecs.lossless import encode

        rows = self.host[layer] if rows is None else rows
        if rows is None or not rows.shape[0]:
            return
        self.host[layer] = None
        self._host_staged_parts[layer] = set()
        ct = encode(rows[:, :self.expert_numel].to(self.device).contiguous(), num_parts=rows.shape[0],
                    checksum=False)
        # groups: runs of consecutive expert ids (slot order is id order), at most host_group_experts each
        groups = consecutive_runs(self.table.ids(layer, HOST), host_group_experts(2 * self.expert_numel))
        self.host_groups[layer] = [(e0, k) for _, e0, k in groups]
        self.host_compressed[layer] = _to_host([ct.parts(s0, s0 + k) for s0, _, k in groups],
                                               self.device.type == "cuda")

    def _build_host_staging(self) -> None:
        """Once every host layer is encoded: the device staging slots and each group's views into its slot."""
        from pagedmoe.codecs.lossless import ARRAYS as names, CompressedTensor

        experts = [ct for cts in self.host_compressed if cts for ct in cts]   # groups of experts
        if not experts:
            return
        # NOTE: the k-th host group of the model decodes from slot k % HOST_STAGING_SLOTS; its copies follow
        # the decode of the group before it in that slot on the same copy stream, so the slot is free.
        staging = [{name: torch.empty(max(getattr(ct, name).numel() for ct in experts),
                                      dtype=getattr(experts[0], name).dtype, device=self.device) for name in names}
                   for _ in range(HOST_STAGING_SLOTS)]
        self._host_staging_bytes = sum(t.numel() * t.element_size() for st in staging for t in st.values())
        # NOTE: CUDA-graph warm-ups decode without copying (ExpertPager.no_host_copies): the slots must hold
        # a real group's arrays, or the decoder would follow garbage bit offsets out of its buffers. The group
        # with the most parts: every view's blocks are a prefix of its blocks, their offsets inside its stream.
        fill = max(experts, key=lambda ct: (ct.num_parts, ct.stream.numel()))
        for slot in staging:
            for name in names:
                src = getattr(fill, name).reshape(-1)
                slot[name][:src.numel()].copy_(src)
        k = 0
        for layer, cts in enumerate(self.host_compressed):
            if not cts:
                continue
            views = []
            for ct in cts:
                slot = staging[k % HOST_STAGING_SLOTS]
                k += 1
                view = CompressedTensor(ct.shape, ct.num_parts, ct.layout, ct.code_lengths, ct.fill_exponent, **{
                    name: slot[name][:getattr(ct, name).numel()].view(getattr(ct, name).shape) for name in names})
                if self.device.type == "cuda":
                    from pagedmoe.kernels.lossless_decode import prepare_launch

                    prepare_launch(view)  # NOTE: host work, before any CUDA-graph capture
                views.append(view)
            self.host_staging[layer] = views

    def init_random(self, seed: int, std: float = 0.02) -> None:
        """N(0, std) weights, generated on the device (fast) and copied to their tier."""
        gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        n = 3 * self.inter * self.hidden
        for layer in range(self.table.num_layers):
            rows = torch.empty(self.table.num_experts, self.stride, dtype=self.dtype, device=self.device)
            rows.normal_(0.0, std, generator=gen)
            # Experts whose tier encodes (quantises) them go to the encoder from the device rows, in slot
            # order; the rest are copied to their rows. Staging them in host memory first would copy every
            # compressed weight device -> host -> device, through pageable memory (GLM-4.5-Air: 95 GB).
            encoded: dict[str, dict[int, int]] = {COMPRESSED: {}, QUANTIZED: {}, HOST: {}}
            for e in range(self.table.num_experts):
                entry = self.table._entries[layer][e] if self.paged and self.dynamic is None else None
                if entry is not None and (entry.tier in (COMPRESSED, QUANTIZED)
                                          or entry.tier == HOST and self.host_compression == "lossless"):
                    encoded[entry.tier][entry.slot] = e
                else:
                    self.row(layer, e)[:n].copy_(rows[e, :n])
            by_slot = {tier: rows[[ids[k] for k in sorted(ids)], :n] for tier, ids in encoded.items() if ids}
            del rows
            if COMPRESSED in by_slot:
                self._encode(layer, by_slot.pop(COMPRESSED))
            if QUANTIZED in by_slot:
                self._quantize(layer, by_slot.pop(QUANTIZED))
            if HOST in by_slot:
                self._compress_host_layer(layer, by_slot.pop(HOST))
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
        return self._bytes(self.host) + sum(ct.nbytes for cts in self.host_compressed if cts for ct in cts)

    @property
    def compressed_bytes(self) -> int:
        """Device bytes of the lossless compressed tier (0 until encoded)."""
        return sum(ct.nbytes for ct in self.compressed if ct is not None)

    @property
    def quantized_bytes(self) -> int:
        """Device bytes of the quantized tier: data + scales, exactly `quant.bytes_of` per weight."""
        return sum(q.nbytes for q in self.quantized if q is not None)

    @property
    def dynamic_bytes(self) -> int:
        """Device bytes of the experts under dynamic precision: the floor every expert is guaranteed
        (what the KV cache is sized around; the rest is lent from the KV cache: experts/controller.py)."""
        return self.dynamic_floor_bytes if self.dynamic is not None else 0

    @property
    def dynamic_build_bytes(self) -> int:
        """Room a dynamic-precision build needs beside the published versions (built one layer at a time:
        engine/memory.py::dynamic_build_bytes); 0 without dynamic precision."""
        if self.dynamic is None:
            return 0
        bf16 = self.dynamic.bytes_per_rung()["bf16"]
        return dynamic_build_bytes(self.dynamic.num_experts, bf16, self.expert_numel)

    def enable_dynamic(self, min_precision: str, lossless: bool = True):
        """--expert-precision dynamic: every expert paged from the host tier becomes the master of a
        DynamicExperts (its device forms are built by the DynamicPrecisionManager). `lossless`: offer the
        lossless rung (bf16 weights, and compute buffers filled every forward)."""
        from pagedmoe.experts.quantized import DynamicExperts

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
        return self.buffers.nbytes + self._host_staging_bytes if self.paged else 0

    @property
    def device_bytes(self) -> int:
        if self.dynamic is not None:
            return self.dynamic_bytes + self.buffer_bytes
        return self.resident_bytes + self.compressed_bytes + self.quantized_bytes + self.buffer_bytes


def _to_host(parts: list, pin: bool) -> list:
    """One layer's CompressedTensors (its host groups) with their arrays moved to host memory: one (pinned,
    when `pin`) tensor per array kind for the whole layer, each group a view of it (a few registrations per
    layer, not five per group)."""
    from pagedmoe.codecs.lossless import ARRAYS as names, CompressedTensor

    arrays: list[dict] = [{} for _ in parts]
    for name in names:
        src = [getattr(p, name) for p in parts]
        flat = torch.cat([a.reshape(-1) for a in src])
        host = pinned_empty(tuple(flat.shape), flat.dtype) if pin else torch.empty(flat.shape, dtype=flat.dtype)
        host.copy_(flat)
        off = 0
        for d, a in zip(arrays, src):
            d[name] = host[off:off + a.numel()].view(a.shape)
            off += a.numel()
    return [CompressedTensor(p.shape, p.num_parts, p.layout, p.code_lengths, p.fill_exponent, **d)
            for p, d in zip(parts, arrays)]
