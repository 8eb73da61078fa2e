"""The compressed GPU tier: experts kept losslessly compressed in device memory (bf16 only), decoded into
their layer's compute rows before it runs (experts/pager.py; codecs/lossless.py, the exponent-Huffman
format). One CompressedTensor per layer, one part per expert in slot (= expert id) order: a shared
codebook, and a run of consecutive experts decodes with one kernel launch.

Loading: the raw rows are staged in host memory (`staging[l]` [n, 3*I*H]) until every part of the layer
is written, then encoded on the device and the staging freed.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedmoe.codecs.lossless import encode
from pagedmoe.experts.table import COMPRESSED


class CompressedTier:
    def __init__(self, table, expert_numel: int, dtype: torch.dtype, device: torch.device, paged: bool) -> None:
        L = table.num_layers
        self.device = device
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

    def encode(self, layer: int, rows: Optional[torch.Tensor] = None) -> None:
        """Encode the layer's compressed experts: their staged rows, or `rows` (device, slot order) given."""
        staged = self.staging[layer] if rows is None else rows
        # One tensor per layer, one part per expert: a shared codebook, and a run of experts decodes
        # with one kernel launch. Checksums guard files, not device memory: skipped.
        ct = self.layers[layer] = encode(staged.to(self.device), num_parts=staged.shape[0], checksum=False)
        if self.device.type == "cuda":
            from pagedmoe.kernels.lossless_decode import prepare_launch  # triton: optional

            prepare_launch(ct)  # NOTE: host work, before any CUDA-graph capture
        self.staging[layer] = None
        self.staged_parts[layer] = set()

    @property
    def nbytes(self) -> int:
        """Device bytes (0 until encoded)."""
        return sum(ct.nbytes for ct in self.layers if ct is not None)
