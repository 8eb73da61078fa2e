"""The host tier: experts in pinned host memory, copied into their layer's compute rows before it runs.

Raw (`rows[l]` [n_host, stride], pinned on CUDA) or, under `--host-compression lossless`, compressed: per
layer its host experts in groups of consecutive ids (at most HOST_GROUP_BYTES of bf16 each), each group a
CompressedTensor (one part per expert) in pinned host memory, copied into one of HOST_STAGING_SLOTS
device staging slots and decoded into its compute rows by the pager in one launch (experts/pager.py).
The raw rows then only stage a layer until it is encoded. Routed fetching (experts/routed.py) fetches one
expert at a time: its groups hold one expert each (`group_experts=1`), so a miss moves only that expert's
compressed bytes. With fetch path (b) (`mapped`) the layer's arrays are also mapped into the device's address
space and `uva[l]` names them as one CompressedTensor of the layer's host experts (one part per host slot), which
the indexed lossless decode reads straight from host memory (experts/routed_uva.py).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from pagedmoe.codecs.lossless import ARRAYS, CompressedTensor
from pagedmoe.codecs.lossless_groups import Reader, encode_groups, rows_reader
from pagedmoe.experts.layout import consecutive_runs
from pagedmoe.experts.table import HOST
from pagedmoe.planning.placement import HOST_STAGING_SLOTS, host_group_experts


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, mapped: bool = False) -> torch.Tensor:
    """Page-locked host memory of exactly this size (`mapped`: also mapped into the device's address space, so
    GPU kernels read it at its host address: routed fetching's path (b), experts/routed_uva.py).

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
    flags = 3 if mapped else 1   # 1: cudaHostRegisterPortable, 2: cudaHostRegisterMapped
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, flags)
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


class MappedLayer(NamedTuple):
    """A compressed host layer as fetch path (b) reads it: `ct` its host experts, one part per host slot, arrays in
    mapped pinned memory (the decode table on the device); `part_bytes` [parts] int64 on the device, each part's
    stored bytes (what a miss moves over PCIe)."""
    ct: CompressedTensor
    part_bytes: torch.Tensor


class HostTier:
    def __init__(self, table, stride: int, expert_numel: int, dtype: torch.dtype, device: torch.device,
                 paged: bool, compression: str = "none", group_experts: int = 0, mapped: bool = False) -> None:
        L = table.num_layers
        self.group_experts = group_experts   # experts per compressed group (0: host_group_experts' choice)
        self.mapped = mapped                 # host memory mapped for fetch path (b) (GPU kernels read it)
        self.table, self.expert_numel, self.device, self.compression = table, expert_numel, device, compression
        self.rows: list[Optional[torch.Tensor]] = [None] * L
        self.staged_parts: list[set] = [set() for _ in range(L)]  # host rows written (compressed host tier)
        self.compressed: list = [None] * L      # per layer: a CompressedTensor per group (compressed host tier)
        self.groups: list = [None] * L          # per layer: (first expert id, experts) of each group
        self.staging: list = [None] * L         # per layer: the groups' device views into the slots
        self.uva: list[Optional[MappedLayer]] = [None] * L   # per layer, when mapped: path (b)'s view of it
        self.staging_bytes = 0
        if not paged:
            return
        pin = device.type == "cuda"
        for layer in range(L):
            n_host = table.count(layer, HOST)
            # With a compressed host tier the raw rows only stage a layer until it is encoded (pageable,
            # touched lazily): pinning them all first would peak host memory at the raw host tier.
            self.rows[layer] = pinned_empty((n_host, stride), dtype, mapped) if pin and compression == "none" \
                else torch.empty(n_host, stride, dtype=dtype)

    def stage(self, layer: int, slot: int, parts) -> bool:
        """A compressed host tier's raw row parts written; True once the layer's rows are complete."""
        self.staged_parts[layer].update((slot, p) for p in parts)
        return len(self.staged_parts[layer]) == 3 * self.rows[layer].shape[0]

    def compress_layer(self, layer: int, read: Optional[Reader] = None) -> None:
        """Encode one layer's host experts with one codebook, a group at a time on the device (bounded memory:
        codecs/lossless_groups.py), from its raw host rows or from `read(slot, a, b)` (elements [a, b) of the
        expert in that slot, bf16 on the device: --load-format dummy generates them there); keep each group in
        pinned host memory and free the raw rows."""
        rows = self.rows[layer]
        n = self.table.count(layer, HOST)
        if not n:
            return
        if read is None:
            if rows is None:
                return
            read = rows_reader(rows, self.device)
        # groups: runs of consecutive expert ids (slot order is id order), at most host_group_experts each
        groups = consecutive_runs(self.table.ids(layer, HOST),
                                  self.group_experts or host_group_experts(2 * self.expert_numel))
        self.compressed[layer] = encode_groups(read, n, self.expert_numel, [(s0, k) for s0, _, k in groups],
                                               device=self.device, alloc=self._host_array)
        self.groups[layer] = [(e0, k) for _, e0, k in groups]
        self.rows[layer] = None
        self.staged_parts[layer] = set()
        if self.mapped:
            self.uva[layer] = mapped_layer(self.compressed[layer], self.device)

    def _host_array(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One array kind of a layer's compressed groups: pinned on CUDA (exact size; also mapped for fetch path
        (b))."""
        return pinned_empty(shape, dtype, self.mapped) if self.device.type == "cuda" else torch.empty(shape,
                                                                                                      dtype=dtype)

    def build_staging(self) -> None:
        """Once every host layer is encoded: the device staging slots and each group's views into its slot."""
        names = ARRAYS
        experts = [ct for cts in self.compressed if cts for ct in cts]   # groups of experts
        if not experts:
            return
        # NOTE: the k-th host group of the model decodes from slot k % HOST_STAGING_SLOTS; its copies follow
        # the decode of the group before it in that slot on the same copy stream, so the slot is free.
        staging = [{name: torch.empty(max(getattr(ct, name).numel() for ct in experts),
                                      dtype=getattr(experts[0], name).dtype, device=self.device) for name in names}
                   for _ in range(HOST_STAGING_SLOTS)]
        self.staging_bytes = sum(t.numel() * t.element_size() for st in staging for t in st.values())
        # NOTE: CUDA-graph warm-ups decode without copying (ExpertPager.no_host_copies): the slots must hold
        # a real group's arrays, or the decoder would follow garbage bit offsets out of its buffers. The group
        # with the most parts: every view's blocks are a prefix of its blocks, their offsets inside its stream.
        fill = max(experts, key=lambda ct: (ct.num_parts, ct.stream.numel()))
        for slot in staging:
            for name in names:
                src = getattr(fill, name).reshape(-1)
                slot[name][:src.numel()].copy_(src)
        k = 0
        for layer, cts in enumerate(self.compressed):
            if not cts:
                continue
            views = []
            for ct in cts:
                slot = staging[k % HOST_STAGING_SLOTS]
                k += 1
                view = CompressedTensor(ct.shape, ct.num_parts, ct.layout, ct.code_lengths, ct.fill_exponent, **{
                    name: slot[name][:getattr(ct, name).numel()].view(getattr(ct, name).shape) for name in names})
                if self.device.type == "cuda":
                    from pagedmoe.kernels.lossless_decode import prepare_launch  # triton: optional

                    prepare_launch(view)  # NOTE: host work, before any CUDA-graph capture
                views.append(view)
            self.staging[layer] = views

    @property
    def nbytes(self) -> int:
        raw = sum(t.numel() * t.element_size() for t in self.rows if t is not None)
        return raw + sum(ct.nbytes for cts in self.compressed if cts for ct in cts)


def mapped_layer(groups: list, device: torch.device) -> MappedLayer:
    """The groups of one layer (compress_layer's, views of one tensor per array kind) as one CompressedTensor of all their
    parts, for the indexed decode of fetch path (b): the stream, lane bits and raw bytes are the groups' own host
    memory (the groups follow each other in it); the block bit offsets, rebased per group by `parts`, are made
    absolute again in a (mapped pinned, on CUDA) copy; the decode table is built on `device` now (host work:
    never inside a CUDA-graph capture)."""
    first = groups[0]
    lay, bpp = first.layout, first.blocks_per_part

    def whole(name):   # the one tensor the groups' `name` arrays are consecutive views of
        t = getattr(first, name)
        n = sum(getattr(g, name).numel() for g in groups)
        return t.as_strided((n,), (1,), t.storage_offset())

    word0 = [g.stream.storage_offset() - first.stream.storage_offset() for g in groups]
    offsets = torch.cat([g.block_bit_offsets + 32 * w for g, w in zip(groups, word0)])
    words = torch.cat([g.part_word_offsets[:-1] + w for g, w in zip(groups, word0)]
                      + [groups[-1].part_word_offsets[-1:] + word0[-1]])
    if device.type == "cuda":
        pinned = pinned_empty(tuple(offsets.shape), offsets.dtype, mapped=True)
        offsets = pinned.copy_(offsets)
    parts = sum(g.num_parts for g in groups)
    lane_bits = whole("lane_bits").view(parts * bpp, lay.lanes)
    ct = CompressedTensor((parts * first.part_size,), parts, lay, first.code_lengths, first.fill_exponent,
                          whole("stream"), words, offsets, lane_bits, whole("raw"))
    # a part's stored words run to the next part's (or the stream's end: the pad words after each group are stored)
    ends = torch.cat([words[1:-1], torch.tensor([ct.stream.numel()], dtype=words.dtype)])
    stored = (ends - words[:-1]) * 4 + bpp * (8 + lay.lanes * first.lane_bits.element_size()) + first.part_size
    if device.type == "cuda":
        from pagedmoe.kernels.lossless_decode import prepare_launch  # triton: optional

        prepare_launch(ct, device)
    return MappedLayer(ct, stored.to(device))
