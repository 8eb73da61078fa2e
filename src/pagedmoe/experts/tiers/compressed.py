"""The compressed GPU tier: experts kept losslessly compressed in device memory (bf16 only), decoded into
their layer's compute rows before it runs (experts/pager.py; codecs/lossless.py, the exponent-Huffman
format). One CompressedTensor per layer, one part per expert in slot (= expert id) order: a shared
codebook, and a run of consecutive experts decodes with one kernel launch.

With `fused` (--compressed-gemm fused, issue 23) a layer is held in the tiled format (version 2,
codecs/tiled.py) instead, as a TiledExperts pair: w13 [n, 2I, H] and w2 [n, H, I], one part per expert in slot
order, which the MoE GEMMs read directly (kernels/fused_moe_lossless.py): never decoded into the buffers. With
fused-hibyte(-exact) the pair is in format version 3 (codecs/hibyte.py) in its tile_major byte order, the one copy
its kernel reads (kernels/fused_moe_hibyte.py, the tier's `fused_kernel`: "fast" or "exact").

Loading: the raw rows are staged in host memory (`staging[l]` [n, 3*I*H]) until every part of the layer
is written, then encoded on the device and the staging freed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from pagedmoe.codecs import hibyte, tiled
from pagedmoe.codecs.lossless_groups import Reader, encode_groups, rows_reader
from pagedmoe.experts.table import COMPRESSED


@dataclass(frozen=True)
class TiledExperts:
    """A layer's compressed experts in format version 2 (or version 3, hibyte, tile_major order): the two GEMMs'
    weights, one part per expert."""
    w13: "tiled.TiledTensor | hibyte.HiByteTensor"   # [n, 2I, H]
    w2: "tiled.TiledTensor | hibyte.HiByteTensor"    # [n, H, I]
    kernel: str = "exact"  # hibyte: the kernel fused_moe_mixed runs on them (config_sections.FUSED_KERNELS)

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def gemm_operands(self) -> tuple:
        """(w13, w2) as fused_moe_mixed takes them: version 2 tensors as they are, hibyte ones as launchers of the
        tier's kernel (kernels/fused_moe_hibyte.TIER_KERNELS)."""
        if self.w13.version != hibyte.FORMAT_VERSION:
            return self.w13, self.w2
        from pagedmoe.kernels.fused_moe_hibyte import TIER_KERNELS, HiByteExperts  # triton: optional

        k = TIER_KERNELS[self.kernel]
        return HiByteExperts(self.w13, **k), HiByteExperts(self.w2, **k)


class CompressedTier:
    def __init__(self, table, expert_numel: int, dtype: torch.dtype, device: torch.device, paged: bool,
                 hidden: int = 0, inter: int = 0, fused: bool = False, fused_format: str = "tiled",
                 fused_kernel: str = "exact") -> None:
        L = table.num_layers
        self.table, self.expert_numel, self.device = table, expert_numel, device
        self.hidden, self.inter, self.fused = hidden, inter, fused
        self.codec = hibyte if fused_format == "hibyte" else tiled  # the fused tier's format
        self.fused_kernel = fused_kernel
        self.layers: list = [None] * L          # CompressedTensor per layer
        self.staging: list[Optional[torch.Tensor]] = [None] * L  # raw rows [n_comp, 3*I*H] until encoded
        self.staged_parts: list[set] = [set() for _ in range(L)]  # (slot, 'gate'|'up'|'down') written
        if not paged:
            return
        for layer in range(L):
            n_comp = table.count(layer, COMPRESSED)
            if n_comp:
                if dtype != torch.bfloat16:
                    raise ValueError(f"the lossless compressed tier holds bf16 weights; the model runs in {dtype} "
                                     "(use --dtype bfloat16)")
                self.staging[layer] = torch.empty(n_comp, expert_numel, dtype=dtype)

    def stage(self, layer: int, slot: int, parts) -> bool:
        """Row parts written (a part written twice counts once); True once the layer's rows are complete."""
        self.staged_parts[layer].update((slot, p) for p in parts)
        return len(self.staged_parts[layer]) == 3 * self.staging[layer].shape[0]

    def encode(self, layer: int, rows: Optional[torch.Tensor] = None, read: Optional[Reader] = None) -> None:
        """Encode the layer's compressed experts: their staged rows, `rows` (slot order) given, or (not fused)
        what `read(slot, a, b)` gives: elements [a, b) of the expert in that slot, bf16 on the device."""
        staged = self.staging[layer] if rows is None else rows
        if self.fused:  # the GEMMs' weights as the rows hold them (experts/layout.py): w13 then w2
            if read is not None:
                raise ValueError("the tiled (fused) compressed tier encodes rows, not a reader")
            n, H, I = staged.shape[0], self.hidden, self.inter
            dev = staged.to(self.device)
            self.layers[layer] = TiledExperts(self._held(dev[:, :2 * I * H].reshape(n, 2 * I, H)),
                                              self._held(dev[:, 2 * I * H:].reshape(n, H, I)), self.fused_kernel)
            del dev
            self.staging[layer] = None
            self.staged_parts[layer] = set()
            return
        # One tensor per layer, one part per expert: a shared codebook, and a run of experts decodes with one
        # kernel launch. Encoded as one group (codecs/lossless_groups.py): beside the tier's own arrays the device
        # holds the layer's exponents (1 byte per weight) and chunk temporaries, never its bf16 rows (the
        # whole-layer encode held them and ~7 bytes per weight more). Checksums guard files, not device memory.
        n, P = self.table.count(layer, COMPRESSED), self.expert_numel
        if read is None:
            read = rows_reader(staged, self.device)
        [ct] = encode_groups(read, n, P, [(0, n)], device=self.device,
                             alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype, device=self.device))
        ct = self.layers[layer] = dataclasses.replace(ct, shape=(n, P))   # [n, 3*I*H] as encode(rows) gives
        if self.device.type == "cuda":
            from pagedmoe.kernels.lossless_decode import prepare_launch  # triton: optional

            prepare_launch(ct)  # NOTE: host work, before any CUDA-graph capture
        self.staging[layer] = None
        self.staged_parts[layer] = set()

    def _held(self, w: torch.Tensor):
        """One GEMM's weights [n, rows, K] encoded as the fused tier holds them: hibyte in the tile_major order
        alone (its row-order arrays freed on return: one copy held, as many bytes)."""
        if self.codec is hibyte:   # a chunk of experts at a time, each chunk rearranged before the next
            return hibyte.encode(w, num_parts=w.shape[0], checksum=False, order="tile_major")
        return self.codec.encode(w, num_parts=w.shape[0], checksum=False)

    @property
    def nbytes(self) -> int:
        """Device bytes (0 until encoded)."""
        return sum(ct.nbytes for ct in self.layers if ct is not None)
