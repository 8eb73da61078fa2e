"""The quantized tier of one MoE layer: its lossy experts (fp8 / int8 / int4) held on the device, stacked
so one dequantisation per weight kind fills the layer's compute buffer.

Shapes: n quantized experts of the layer (slot order = expert-id order), H hidden, I intermediate.
  w13  data [n*2I, ...] + scales [n*2I, ...]   the n experts' [2I, H] weights stacked along output channels
  w2   data [n*H, ...]  + scales [n*H, ...]    the n experts' [H, I] weights stacked likewise
Every format's scales are per output channel (fp8/int8) or per output channel and group along K
(int4), so stacking experts along N changes nothing: dequantising the stack gives, element for element,
what dequantising each expert alone gives (codecs/quant.py::dequantize, the PyTorch reference; its
on CUDA kernels/dequant.py writes the rows directly, bit-identical to it). Bytes are exactly `quant.bytes_of` per weight (data + float32 scales).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from pagedmoe.codecs.quant import QuantizedTensor, dequantize, quantize
from pagedmoe.experts.table import QUANTIZED


class QuantizedLayer:
    def __init__(self, precision: str, hidden: int, inter: int, expert_ids: Sequence[int],
                 w13: QuantizedTensor, w2: QuantizedTensor) -> None:
        self.precision, self.hidden, self.inter = precision, hidden, inter
        self.expert_ids = list(expert_ids)
        self.w13, self.w2 = w13, w2
        n = len(self.expert_ids)
        self._run = None  # (first expert, count) when the ids are consecutive: a slice, else an index
        if self.expert_ids == list(range(self.expert_ids[0], self.expert_ids[0] + n)):
            self._run = (self.expert_ids[0], n)
        # NOTE: the index lives on the data's device so the pager's writes need no host sync.
        self._index = torch.tensor(self.expert_ids, dtype=torch.long, device=w13.data.device)
        self._base_cache: dict[tuple[int, int], torch.Tensor] = {}

    def _bases(self, stride: int, lo: int) -> torch.Tensor:
        """Element offsets of each expert's weight in a packed buffer of row `stride`. Built on the first
        forward (a CUDA-graph warm-up, before any capture), then reused."""
        key = (stride, lo)
        if key not in self._base_cache:
            self._base_cache[key] = self._index * stride + lo
        return self._base_cache[key]

    @classmethod
    def quantize_rows(cls, rows: torch.Tensor, precision: str, hidden: int, inter: int,
                      expert_ids: Sequence[int], device: torch.device) -> "QuantizedLayer":
        """rows [n, >= 3*I*H] (raw expert rows, any float dtype, any device) -> the layer's quantized tier on
        `device`. Quantised where the rows are moved to (the device: fast), in float32 like the reference."""
        n, I, H = rows.shape[0], inter, hidden
        if n != len(expert_ids) or n == 0:
            raise ValueError(f"{n} rows for {len(expert_ids)} expert ids")
        # One expert at a time: the quantiser's float32 temporaries stay one expert large.
        parts13, parts2 = [], []
        for i in range(n):
            r = rows[i, :3 * I * H].to(device)
            parts13.append(quantize(r[:2 * I * H].view(2 * I, H), precision))
            parts2.append(quantize(r[2 * I * H:].view(H, I), precision))
        return cls(precision, hidden, inter, expert_ids, stack_quantized(parts13), stack_quantized(parts2))

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @property
    def device(self) -> torch.device:
        return self.w13.data.device

    def dequantize_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """[n, 3*I*H] in `dtype`: the experts' dequantised rows (w13 then w2), for tests and the CPU path."""
        n, I, H = len(self.expert_ids), self.inter, self.hidden
        return torch.cat([dequantize(self.w13, dtype).reshape(n, 2 * I * H),
                          dequantize(self.w2, dtype).reshape(n, H * I)], dim=1)

    def dequantize_into(self, packed: torch.Tensor) -> None:
        """Write the dequantised experts into their rows of a compute buffer packed [E, stride] (its dtype).
        No host sync: runs on whatever stream is current (the pager's copy stream). On CUDA one Triton launch
        per weight kind writes the rows directly (kernels/dequant.py); elsewhere the PyTorch reference."""
        I, H = self.inter, self.hidden
        if packed.is_cuda and packed.is_contiguous():
            from pagedmoe.kernels.dequant import dequantize_into  # triton: an optional package

            for qt, lo in ((self.w13, 0), (self.w2, 2 * I * H)):
                dequantize_into(qt, packed, self._bases(packed.stride(0), lo))
            return
        E, n = packed.shape[0], len(self.expert_ids)
        for qt, lo, (N, K) in ((self.w13, 0, (2 * I, H)), (self.w2, 2 * I * H, (H, I))):
            # [n*N, K] (int4: a strided slice of its padded groups): viewed per expert, copied once
            vals = dequantize(qt, packed.dtype).view(n, N, K)
            if self._run is not None:
                e0, k = self._run
                packed[e0:e0 + k, lo:lo + N * K].view(k, N, K).copy_(vals)
            else:
                packed[:, lo:lo + N * K].view(E, N, K).index_copy_(0, self._index, vals)


def stack_quantized(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Experts' quantized [N, K] weights -> one [n*N, K] QuantizedTensor (per-row scales stack with them)."""
    n_rows = sum(p.shape[0] for p in parts)
    return QuantizedTensor(parts[0].precision, (n_rows, parts[0].shape[1]),
                           torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]))


class QuantizedTier:
    """The quantized GPU tier (static --expert-precision fp8/int8/int4): one QuantizedLayer per layer.
    Loading stages raw rows in host memory until the layer's rows are complete, then quantises them on the
    device and drops the raw rows (static modes keep no bf16 master)."""

    def __init__(self, table, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                 paged: bool) -> None:
        L = table.num_layers
        self.table, self.hidden, self.inter, self.device = table, hidden, inter, device
        self.layers: list = [None] * L          # QuantizedLayer per layer
        self.staging: list[Optional[torch.Tensor]] = [None] * L  # raw rows [n_quant, 3*I*H] until quantised
        self.staged_parts: list[set] = [set() for _ in range(L)]
        if not paged:
            return
        for layer in range(L):
            n_quant = table.count(layer, QUANTIZED)
            if n_quant:
                self.staging[layer] = torch.empty(n_quant, 3 * inter * hidden, dtype=dtype)

    def stage(self, layer: int, slot: int, parts) -> bool:
        self.staged_parts[layer].update((slot, p) for p in parts)
        return len(self.staged_parts[layer]) == 3 * self.staging[layer].shape[0]

    def quantize(self, layer: int, rows: Optional[torch.Tensor] = None) -> None:
        """Quantise the layer's quantized experts: their staged rows, or `rows` (slot order) given."""
        ids = self.table.ids(layer, QUANTIZED)  # slot order = expert-id order
        precision = self.table.lookup(layer, ids[0]).precision
        self.layers[layer] = QuantizedLayer.quantize_rows(self.staging[layer] if rows is None else rows,
                                                          precision, self.hidden, self.inter, ids, self.device)
        self.staging[layer] = None
        self.staged_parts[layer] = set()

    @property
    def nbytes(self) -> int:
        """Device bytes: data + scales, exactly `quant.bytes_of` per weight."""
        return sum(q.nbytes for q in self.layers if q is not None)
