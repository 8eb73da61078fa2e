"""The compute buffers the expert GEMMs read, one [E, stride] range per MoE layer.

`PlainDoubleBuffer`: two device buffers, layer l uses buffer l % 2 (works anywhere, CPU included);
resident rows are copied in by the pager like streamed ones.

`VmmExpertBuffers`: stable-address buffers with CUDA virtual memory management (pagedmoe/cuda_vmm.py).

Each MoE layer l gets one reserved virtual range holding its packed [E, stride] expert rows; the
GEMMs always read that range, so its address never changes (CUDA graphs stay valid). Physical
memory behind it is mapped once, at start-up, expert row by expert row:
- a resident expert's row maps its own physical allocation (no copies, ever);
- a streamed expert's row (host or compressed tier) maps a row of one of two rotating slots (slot
  l % 2), so layers l and l+2 share physical memory and only two layers' worth of streamed experts exist;
- or, with `ring=True` (`--expert-buffers vmm-ring`), the k-th streamed row of the model (layer by layer)
  maps row k mod S of one ring of S = 2 x (most streamed experts in a layer) rows: the same physical
  memory, but a row is free again as soon as the layer that used it S rows earlier has computed, so the
  pager can copy it many layers ahead (experts/pager.py);
- with --compressed-gemm fused, a compressed expert's row maps one spare row shared by all of them: the MoE
  GEMMs read those experts from the compressed tier and skip their rows.
The pager copies host rows (and decodes compressed ones) into the layer's range just before it runs
(experts/pager.py).

Rows are padded to the allocation granularity (2 MiB on the H200) so every row maps on its own.
"""
from __future__ import annotations

import torch

from pagedmoe import cuda_vmm as vmm
from pagedmoe.experts.table import COMPRESSED, RESIDENT


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


class VmmExpertBuffers:
    maps_resident = True  # resident rows live in the layer's range; the pager copies host rows only

    def __init__(self, store, ring: bool = False) -> None:
        cu = vmm.driver()
        table, device = store.table, store.device
        self.device_idx = device.index if device.index is not None else torch.cuda.current_device()
        self.row_bytes = store.row_bytes
        gran = vmm.granularity(device)
        if self.row_bytes % gran:
            raise ValueError(f"expert rows of {self.row_bytes} bytes are not a multiple of the {gran}-byte "
                             "VMM granularity")
        L, E = table.num_layers, table.num_experts
        self._handles, self._mappings, self._reservations = [], [], []
        self._access = vmm.access_desc(self.device_idx)
        # NOTE: the driver maps a handle only from offset 0 (a non-zero offset gives
        # CUDA_ERROR_NOT_SUPPORTED on the H200), so every row is its own allocation.
        # --compressed-gemm fused: the GEMMs read the compressed experts where they are, so their rows are never
        # written or read; they all map one spare row (the layer's range stays one tensor)
        unbuffered = COMPRESSED if getattr(store, "fused_compressed", False) else None
        max_streamed = max((E - table.count(l, RESIDENT) - (table.count(l, unbuffered) if unbuffered else 0)
                            for l in range(L)), default=0)
        spare = None
        self.ring = ring
        self.ring_size = 2 * max_streamed
        if ring:
            ring_rows = [self._create(self.row_bytes) for _ in range(self.ring_size)]
        else:
            self.slots = [[self._create(self.row_bytes) for _ in range(max_streamed)] for _ in range(2)]
        self.slot_bytes = (2 * max_streamed + (unbuffered is not None)) * self.row_bytes
        # per layer, the model-wide indices k of its streamed rows (ring: row k maps ring row k mod S)
        self.streamed_rows: list[list[int]] = []
        self._packed: list[torch.Tensor] = []
        self._resident_rows: list[list[torch.Tensor]] = []
        k = 0
        for layer in range(L):
            va = int(vmm.check(cu.cuMemAddressReserve(E * self.row_bytes, gran, 0, 0)))
            self._reservations.append((va, E * self.row_bytes))
            resident_ids = table.ids(layer, RESIDENT)
            streamed = 0  # host and compressed experts share the rotating slot's rows
            rows = []
            for e in range(E):
                tier = table.lookup(layer, e).tier
                if tier == RESIDENT:
                    handle = self._create(self.row_bytes)
                elif tier == unbuffered:
                    if spare is None:
                        spare = self._create(self.row_bytes)
                    handle = spare
                elif ring:
                    handle = ring_rows[k % self.ring_size]
                    rows.append(k)
                    k += 1
                else:
                    handle, streamed = self.slots[layer % 2][streamed], streamed + 1
                self._map(va + e * self.row_bytes, handle)
            self.streamed_rows.append(rows)
            flat = torch.as_tensor(vmm.CudaArray(va, E * self.row_bytes), device=device).view(store.dtype)
            packed = flat.view(E, store.stride)
            self._packed.append(packed)
            self._resident_rows.append([packed[e] for e in resident_ids])

    def _create(self, nbytes: int):
        cu = vmm.driver()
        handle = vmm.check(cu.cuMemCreate(nbytes, vmm.allocation_prop(self.device_idx), 0))
        self._handles.append(handle)
        return handle

    def _map(self, va: int, handle) -> None:
        vmm.map_range(va, self.row_bytes, handle, self._access)
        self._mappings.append(va)

    def packed(self, layer: int) -> torch.Tensor:
        return self._packed[layer]

    def resident_rows(self, layer: int) -> list[torch.Tensor]:
        return self._resident_rows[layer]

    @property
    def nbytes(self) -> int:
        """Physical bytes of the two rotating slots (resident rows are counted as resident)."""
        return self.slot_bytes

    def close(self) -> None:
        cu = vmm.driver()
        torch.cuda.synchronize()
        self._packed.clear()
        self._resident_rows.clear()
        for va in self._mappings:
            vmm.check(cu.cuMemUnmap(va, self.row_bytes))
        for va, size in self._reservations:
            vmm.check(cu.cuMemAddressFree(va, size))
        for handle in self._handles:
            vmm.check(cu.cuMemRelease(handle))
        self._mappings, self._reservations, self._handles = [], [], []
