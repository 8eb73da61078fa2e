"""--load-format dummy's expert weights: N(0, std), generated on the device a chunk at a time, each chunk from
its own seed (seed, layer, expert, chunk), so any expert's elements can be generated again, in any order and
in bounded memory: the same weights whatever tier an expert lands in (placements compare bit for bit), and a
compressed host tier encodes straight from the generator (codecs/lossless_groups.py reads every expert twice)
without a layer ever existing whole on the device (a Mixtral-8x7B layer is 2.6 GiB of bf16).
"""
from __future__ import annotations

import torch

from pagedmoe.codecs.lossless_groups import READ_ELEMS

# Elements generated per seed: the encoder's read size, so each of its reads generates one chunk.
CHUNK_ELEMS = READ_ELEMS
_MIX = 1_000_003   # a prime: distinct (seed, layer, expert, chunk) give distinct seeds for any model's counts


class DummyExperts:
    def __init__(self, seed: int, std: float, dtype: torch.dtype, device: torch.device) -> None:
        self.seed, self.std, self.dtype, self.device = seed, std, dtype, device
        self.gen = torch.Generator(device=device)

    def _chunk(self, layer: int, expert: int, c: int, numel: int) -> torch.Tensor:
        self.gen.manual_seed((((self.seed * _MIX + layer) * _MIX + expert) * _MIX + c) % (1 << 63))
        return torch.empty(numel, dtype=self.dtype, device=self.device).normal_(0.0, self.std, generator=self.gen)

    def read(self, layer: int, expert: int, a: int, b: int, numel: int) -> torch.Tensor:
        """Elements [a, b) of the expert's first `numel` (its weights), on the device."""
        c0, c1 = a // CHUNK_ELEMS, -(-b // CHUNK_ELEMS)
        parts = [self._chunk(layer, expert, c, min(CHUNK_ELEMS, numel - c * CHUNK_ELEMS)) for c in range(c0, c1)]
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        return whole[a - c0 * CHUNK_ELEMS:b - c0 * CHUNK_ELEMS]

    def fill(self, layer: int, expert: int, out: torch.Tensor) -> None:
        """The expert's weights written into `out` [numel] (any device), a chunk at a time."""
        n = out.numel()
        for a in range(0, n, CHUNK_ELEMS):
            b = min(n, a + CHUNK_ELEMS)
            out[a:b].copy_(self.read(layer, expert, a, b, n))
