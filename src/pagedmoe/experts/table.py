"""The expert table: for every (layer, expert), its tier, precision and slot. Pure Python.

Tiers: "resident" (its own GPU memory, mapped or copied into the layer's compute buffer), "compressed"
(a lossless compressed copy in GPU memory, decoded into the compute buffer before its layer runs; its
precision stays "bf16": the decode is exact) and "host" (pinned host memory, streamed into the compute
buffer before its layer runs) and "quantized" (a lossy fp8/int8/int4 copy in GPU memory, dequantised into
the compute buffer before its layer runs; its precision is that format). Under --expert-precision
dynamic the tiers mix within a layer and change at run time: "resident" experts are exact rows on the
device, "quantized" ones lossy forms; both slots are the expert id (experts/dynamic/versions.py::DynamicExperts).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

RESIDENT = "resident"
COMPRESSED = "compressed"
HOST = "host"
QUANTIZED = "quantized"
TIERS = (RESIDENT, COMPRESSED, HOST, QUANTIZED)
QUANTIZED_PRECISIONS = ("fp8", "int8", "int4")


@dataclass(frozen=True)
class ExpertKey:
    layer_idx: int   # index among the MoE layers (not the decoder layer index)
    expert_id: int


@dataclass
class ExpertEntry:
    tier: str
    slot: int                 # row in that tier's store for this layer
    precision: str = "bf16"
    activity: float = 0.0     # moving average of routed tokens (filled by the activity table)
    last_access: int = -1     # engine step the expert was last routed to (-1: never; activity table;
                              # under --expert-fetch routed the expert cache's fetch tick of its last use)
    cache_slot: int = -1      # --expert-fetch routed: its page in the GPU expert cache (experts/cache.py), -1: none


class ExpertTable:
    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._entries: list[list[Optional[ExpertEntry]]] = [[None] * num_experts for _ in range(num_layers)]

    def place(self, resident: Sequence[Iterable[int]],
              compressed: Optional[Sequence[Iterable[int]]] = None,
              quantized: Optional[Sequence[Iterable[int]]] = None, quantized_precision: str = "int8") -> None:
        """resident[l] = the expert ids of MoE layer l kept on the GPU, compressed[l] (optional) those
        kept losslessly compressed on the GPU, quantized[l] (optional) those kept on the GPU in the lossy
        format `quantized_precision`; the rest go to the host tier. Slots number the experts of each
        tier in expert-id order."""
        if len(resident) != self.num_layers:
            raise ValueError(f"need a resident set for each of {self.num_layers} MoE layers")
        if compressed is None:
            compressed = [()] * self.num_layers
        if len(compressed) != self.num_layers:
            raise ValueError(f"need a compressed set for each of {self.num_layers} MoE layers")
        if quantized is None:
            quantized = [()] * self.num_layers
        if len(quantized) != self.num_layers:
            raise ValueError(f"need a quantized set for each of {self.num_layers} MoE layers")
        if quantized_precision not in QUANTIZED_PRECISIONS:
            raise ValueError(f"quantized precision must be one of {QUANTIZED_PRECISIONS}, got {quantized_precision!r}")
        for layer, (ids, comp, quant) in enumerate(zip(resident, compressed, quantized)):
            ids, comp, quant = set(ids), set(comp), set(quant)
            bad = [e for e in ids | comp | quant if not 0 <= e < self.num_experts]
            if bad:
                raise ValueError(f"layer {layer}: expert ids out of range: {sorted(bad)}")
            if ids & comp:
                raise ValueError(f"layer {layer}: experts {sorted(ids & comp)} are both resident and compressed")
            if (ids | comp) & quant:
                raise ValueError(f"layer {layer}: experts {sorted((ids | comp) & quant)} are quantized and in "
                                 "another tier")
            slots = dict.fromkeys(TIERS, 0)
            for e in range(self.num_experts):
                tier = RESIDENT if e in ids else COMPRESSED if e in comp else QUANTIZED if e in quant else HOST
                precision = quantized_precision if tier == QUANTIZED else "bf16"
                self._entries[layer][e] = ExpertEntry(tier, slots[tier], precision)
                slots[tier] += 1

    def place_first(self, num_gpu_experts: int) -> None:
        """The first N experts of every layer resident (used when nothing better is known)."""
        n = max(0, min(num_gpu_experts, self.num_experts))
        self.place([range(n)] * self.num_layers)

    def set_entry(self, layer: int, expert: int, tier: str, slot: int, precision: str = "bf16") -> None:
        """Dynamic precision: one expert's tier and precision change when a new version is published
        (experts/dynamic/versions.py::DynamicExperts; its slot is the expert id)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        old = self._entries[layer][expert]
        keep = (old.activity, old.last_access) if old is not None else (0.0, -1)
        self._entries[layer][expert] = ExpertEntry(tier, slot, precision, *keep, cache_slot=old.cache_slot
                                                   if old is not None else -1)

    def set_cache_slot(self, layer: int, expert: int, slot: int, tick: int = -1) -> None:
        """The expert cache (experts/cache.py) paged the expert in (`slot`) or out (-1) at fetch `tick`."""
        entry = self._entries[layer][expert]
        entry.cache_slot = slot
        if tick >= 0:
            entry.last_access = tick

    def touch(self, layer: int, expert: int, tick: int) -> None:
        """A cache hit: the page was used at fetch `tick` (its recency)."""
        self._entries[layer][expert].last_access = tick

    def record_activity(self, ema: Sequence[Sequence[float]], last_access: Sequence[Sequence[int]]) -> None:
        """Copy the activity table's host view into the entries (the controller reads it between steps),
        so each entry holds where the expert is, at what precision, and when it was last used."""
        for layer, (row_ema, row_last) in enumerate(zip(ema, last_access)):
            for e, (a, t) in enumerate(zip(row_ema, row_last)):
                entry = self._entries[layer][e]
                if entry is not None:
                    entry.activity, entry.last_access = float(a), int(t)

    def precision_map(self) -> list[list[str]]:
        """[layer][expert] -> precision (for stats and plots)."""
        return [[e.precision if e is not None else "" for e in row] for row in self._entries]

    def lookup(self, layer: int, expert: int) -> Optional[ExpertEntry]:
        """The entry of (layer, expert); None before it is placed."""
        return self._entries[layer][expert]

    def entry(self, key: ExpertKey) -> ExpertEntry:
        entry = self._entries[key.layer_idx][key.expert_id]
        if entry is None:
            raise KeyError(f"{key} has no placement yet")
        return entry

    def ids(self, layer: int, tier: str) -> list[int]:
        return [e for e, entry in enumerate(self._entries[layer]) if entry is not None and entry.tier == tier]

    def count(self, layer: int, tier: str) -> int:
        return len(self.ids(layer, tier))

    def counts(self) -> Counter:
        """(tier, precision) -> number of experts, over all layers (for metrics)."""
        return Counter((e.tier, e.precision) for row in self._entries for e in row if e is not None)
