"""How one layer's experts are laid out in memory: one row per expert, [w13_e | w2_e | padding].

Shapes: E experts, H hidden, I expert intermediate size.
  packed [E, stride]  with stride >= 3*I*H elements
  w13 = view [E, 2I, H] (gate rows then up rows), strides (stride, H, 1)
  w2  = view [E, H, I], strides (stride, I, 1), starting at element 2*I*H of each row
One expert is one contiguous row, so a single copy moves it between tiers. The GEMMs read the
views directly; resident and paged placements use the same layout, so their results are identical.
"""
from __future__ import annotations

import torch

VMM_GRANULARITY_BYTES = 2 << 20  # CUDA VMM mapping granularity on the H200


def expert_numel(hidden: int, inter: int) -> int:
    return 3 * inter * hidden


def expert_stride(hidden: int, inter: int, elem_bytes: int, align_bytes: int = 16) -> int:
    """Row length in elements: the expert's weights rounded up to `align_bytes`."""
    row_bytes = expert_numel(hidden, inter) * elem_bytes
    row_bytes = -(-row_bytes // align_bytes) * align_bytes
    return row_bytes // elem_bytes


def consecutive_runs(ids, max_len: int = 0) -> list[tuple[int, int, int]]:
    """Sorted expert ids cut into runs of consecutive ids (at most `max_len` each, when > 0), as (index in
    `ids` of the run's first, its first id, its length): the rows [first, first + length) of a packed buffer,
    one decode launch each."""
    runs: list[list[int]] = []
    for i, e in enumerate(ids):
        if runs and e == runs[-1][1] + runs[-1][2] and (max_len <= 0 or runs[-1][2] < max_len):
            runs[-1][2] += 1
        else:
            runs.append([i, e, 1])
    return [(i, e, k) for i, e, k in runs]


def expert_views(packed: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) views into packed [E, stride]."""
    E, stride = packed.shape
    assert packed.stride(1) == 1 and packed.stride(0) == stride, "packed rows must be dense"
    base = packed.storage_offset()
    w13 = packed.as_strided((E, 2 * inter, hidden), (stride, hidden, 1), base)
    w2 = packed.as_strided((E, hidden, inter), (stride, inter, 1), base + 2 * inter * hidden)
    return w13, w2


def row_part(row: torch.Tensor, hidden: int, inter: int, kind: str) -> torch.Tensor:
    """The slice of one expert row [stride] that holds 'gate' [I, H], 'up' [I, H] or 'down' [H, I]."""
    n = inter * hidden
    if kind == "gate":
        return row[:n].view(inter, hidden)
    if kind == "up":
        return row[n:2 * n].view(inter, hidden)
    if kind == "down":
        return row[2 * n:3 * n].view(hidden, inter)
    if kind == "w13":
        return row[:2 * n].view(2 * inter, hidden)
    if kind == "w2":
        return row[2 * n:3 * n].view(hidden, inter)
    raise ValueError(f"unknown expert tensor kind {kind!r}")
