"""The expert table: for every (layer, expert), its tier, precision and slot. Pure Python.

Tiers: "resident" (its own GPU memory, mapped or copied into the layer's compute buffer), "compressed"
(a lossless compressed copy in GPU memory, decoded into the compute buffer before its layer runs; its
precision stays "bf16": the decode is exact) and "host" (pinned host memory, streamed into the compute
buffer before its layer runs). The lower precisions are further tiers of the same table.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

RESIDENT = "resident"
COMPRESSED = "compressed"
HOST = "host"
TIERS = (RESIDENT, COMPRESSED, HOST)


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


class ExpertTable:
    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self._entries: list[list[Optional[ExpertEntry]]] = [[None] * num_experts for _ in range(num_layers)]

    def place(self, resident: Sequence[Iterable[int]],
              compressed: Optional[Sequence[Iterable[int]]] = None) -> None:
        """resident[l] = the expert ids of MoE layer l kept on the GPU, compressed[l] (optional) those
        kept losslessly compressed on the GPU; the rest go to the host tier. Slots number the experts
        of each tier in expert-id order."""
        if len(resident) != self.num_layers:
            raise ValueError(f"need a resident set for each of {self.num_layers} MoE layers")
        if compressed is None:
            compressed = [()] * self.num_layers
        if len(compressed) != self.num_layers:
            raise ValueError(f"need a compressed set for each of {self.num_layers} MoE layers")
        for layer, (ids, comp) in enumerate(zip(resident, compressed)):
            ids, comp = set(ids), set(comp)
            bad = [e for e in ids | comp if not 0 <= e < self.num_experts]
            if bad:
                raise ValueError(f"layer {layer}: expert ids out of range: {sorted(bad)}")
            if ids & comp:
                raise ValueError(f"layer {layer}: experts {sorted(ids & comp)} are both resident and compressed")
            slots = dict.fromkeys(TIERS, 0)
            for e in range(self.num_experts):
                tier = RESIDENT if e in ids else COMPRESSED if e in comp else HOST
                self._entries[layer][e] = ExpertEntry(tier, slots[tier])
                slots[tier] += 1

    def place_first(self, num_gpu_experts: int) -> None:
        """The first N experts of every layer resident (used when nothing better is known)."""
        n = max(0, min(num_gpu_experts, self.num_experts))
        self.place([range(n)] * self.num_layers)

    def entry(self, key: ExpertKey) -> ExpertEntry:
        entry = self._entries[key.layer_idx][key.expert_id]
        if entry is None:
            raise KeyError(f"{key} has no placement yet")
        return entry

    def ids(self, layer: int, tier: str) -> list[int]:
        return [e for e, entry in enumerate(self._entries[layer]) if entry is not None and entry.tier == tier]

    def count(self, layer: int, tier: str) -> int:
        return len(self.ids(layer, tier))

    def max_count(self, tier: str) -> int:
        return max((self.count(l, tier) for l in range(self.num_layers)), default=0)

    def counts(self) -> Counter:
        """(tier, precision) -> number of experts, over all layers (for metrics)."""
        return Counter((e.tier, e.precision) for row in self._entries for e in row if e is not None)
