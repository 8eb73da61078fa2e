"""Expert activity: routed-token counts per (MoE layer, expert), kept on the device.

The router's top-k ids are added with one index_add per layer (no host sync); the host reads the
table only when asked (stats, plots, the precision controller every N steps). `ema` is an
exponential moving average of tokens per step, updated by `end_step`.

`counted_rows` (int64 [1] on the device): only the first counted_rows[0] tokens of a forward are counted. A CUDA
graph's replay sets it to the step's real tokens (worker/cuda_graph.py: `padding_excluded`) so that its padding
rows, routed like any, are not; eager forwards leave it at ALL_ROWS.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

ALL_ROWS = 1 << 40   # times top-k stays inside int64


@contextlib.contextmanager
def padding_excluded(table, rows: int):
    """Count only the first `rows` tokens of the forwards inside (a graph replay of a padded step); no-op for None."""
    if table is None:
        yield
        return
    table.counted_rows.fill_(rows)
    try:
        yield
    finally:
        table.counted_rows.fill_(ALL_ROWS)


class ActivityTable:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device, decay: float = 0.99) -> None:
        self.num_layers, self.num_experts, self.decay = num_layers, num_experts, decay
        self.step_counts = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)
        self.total = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.ema = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)
        self.last_step = torch.full((num_layers, num_experts), -1, dtype=torch.int64, device=device)
        self.num_steps = 0
        # (layer, expert) pairs routed to at least once in a step, summed over the steps: the distinct experts
        # a step needs (bytes routed per step = this x expert bytes / steps; bench latency reports it)
        self.distinct_routed = torch.zeros((), dtype=torch.int64, device=device)
        self.step_distinct = torch.zeros((), dtype=torch.int64, device=device)   # the last ended step's pairs
        self.counted_rows = torch.full((1,), ALL_ROWS, dtype=torch.int64, device=device)
        self._slots = torch.arange(4096, dtype=torch.int64, device=device)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Called by the experts object (experts/interface.py) with a MoE layer's [T, A] routed expert ids."""
        flat = topk_ids.reshape(-1)
        n = flat.numel()
        slots = self._slots[:n] if n <= self._slots.numel() else torch.arange(n, device=flat.device)
        # slot i is token i // A's: counted while that token is below counted_rows[0]
        ones = (slots < self.counted_rows * topk_ids.shape[-1]).to(torch.float32)
        self.step_counts[layer].index_add_(0, flat, ones)

    def reset(self) -> None:
        for t in (self.step_counts, self.total, self.ema, self.distinct_routed, self.step_distinct):
            t.zero_()
        self.last_step.fill_(-1)
        self.num_steps = 0

    def end_step(self) -> None:
        routed = self.step_counts > 0
        self.last_step.masked_fill_(routed, self.num_steps)  # LRU: the last step routed to
        self.step_distinct = routed.sum()
        self.distinct_routed += self.step_distinct
        self.num_steps += 1
        self.total += self.step_counts
        self.ema.mul_(self.decay).add_(self.step_counts, alpha=1.0 - self.decay)
        self.step_counts.zero_()

    def host_view(self) -> tuple[list[list[float]], list[list[int]]]:
        """(ema, last step routed to) per [layer][expert], read to the host (between steps only)."""
        return self.ema.cpu().tolist(), self.last_step.cpu().tolist()

    def snapshot(self) -> dict:
        return {"total": self.total.cpu().tolist(), "ema": self.ema.cpu().tolist(), "decay": self.decay}

    def save(self, path: str, extra: dict | None = None) -> None:
        """`extra` (e.g. the dynamic precision map and measured errors) is stored alongside."""
        Path(path).write_text(json.dumps({**self.snapshot(), **(extra or {})}))

    def load(self, path: str) -> dict:
        """Loads the counts; returns the whole file (its extra keys are for the precision manager)."""
        data = json.loads(Path(path).read_text())
        total = torch.tensor(data["total"], dtype=torch.float64)
        if tuple(total.shape) != (self.num_layers, self.num_experts):
            raise ValueError(f"{path}: expert stats of shape {tuple(total.shape)} do not fit this model "
                             f"({self.num_layers} MoE layers x {self.num_experts} experts)")
        self.total.copy_(total)
        self.ema.copy_(torch.tensor(data["ema"], dtype=torch.float32))
        return data


def busiest_quarter_share(counts: list[list[float]]) -> list[float]:
    """Per layer: the share of routed tokens taken by the busiest 25% of experts (uniform = 0.25)."""
    shares = []
    for row in counts:
        total = sum(row)
        k = max(1, len(row) // 4)
        shares.append(sum(sorted(row, reverse=True)[:k]) / total if total else 0.0)
    return shares
