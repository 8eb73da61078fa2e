"""The pressure controller of dynamic expert precision: a pure decision, free KV blocks in, (expert, from,
to) moves out (the manager that runs it between steps and lends KV blocks: experts/dynamic/manager.py).

No torch (numpy for the ranking).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Mapping, Optional

import numpy as np

from pagedmoe.experts.dynamic.precision import (EPS, EXACT, LADDER, ExpertKey, Move, PrecisionPolicy,
                                                rung_index)

# Relative output error assumed for an expert before its lossy form was ever built (then measured on
# its weights); N(0, 0.02)-like weights give about these. Only their order matters much for ranking.
PRIOR_REL_ERROR = {"fp8": 0.025, "int8": 0.004, "int4": 0.07}
_EXACT_RUNG = np.array([p in EXACT for p in LADDER])     # by ladder index


def _take_greedy(sizes: list[int], limit: int, enough: float = math.inf) -> list[int]:
    """Indices of `sizes` (in ranked order) taken greedily while their sum stays within `limit`, skipping any
    that would pass it, until the sum reaches `enough`."""
    take, total = [], 0
    smallest = min(sizes, default=0)
    for j, size in enumerate(sizes):
        if total >= enough:
            break
        if total + size > limit:
            if limit - total < smallest:
                break           # nothing left fits under the limit: the rest would all be skipped
            continue
        take.append(j)
        total += size
    return take


@dataclass(frozen=True)
class Watermarks:
    """On free KV blocks: once free drops below `low`, demote (over as many steps as the per-step cap
    needs) until free reaches the midpoint; above `high`, promote while free stays at or above the
    midpoint. Otherwise nothing moves (hysteresis)."""
    low: int
    high: int

    def __post_init__(self):
        if not 0 <= self.low < self.high:
            raise ValueError(f"watermarks need 0 <= low < high (got low={self.low}, high={self.high})")

    @property
    def mid(self) -> int:
        return (self.low + self.high) // 2

    @classmethod
    def from_fractions(cls, low: float, high: float, num_blocks: int) -> "Watermarks":
        """`--kv-low-watermark`/`--kv-high-watermark` are fractions of the KV cache's blocks. high=1.0
        can never be exceeded (free <= blocks): it switches promotion off."""
        lo = int(math.floor(low * num_blocks))
        hi = max(lo + 1, int(math.ceil(high * num_blocks)))
        return cls(lo, hi)


class PressureController:
    """Reads free KV blocks every N steps and returns (expert, from, to) moves; the runtime builds the
    new versions asynchronously and publishes them, then calls `applied`. Each expert moves at most one
    rung per step and the bytes changed per step are capped, so quality degrades progressively.

    Ranking is PrecisionPolicy.demote_rank / promote_rank over every expert's one-rung move, computed on
    numpy arrays: a tick that acts must stay well under a millisecond at thousands of experts (a Move
    object and a rank tuple per expert per tick cost ~7 ms on the GPU host at 2048 experts). Each
    expert's neighbours on its frontier are cached and re-read only when they can change: its
    precision moved (`applied`), its relative errors changed (`costs_changed`), its activity became
    zero or non-zero, or the bytes per rung changed.
    NOTE: whoever updates `policy.costs.rel_error[key]` in place must call `costs_changed([key])`
    (DynamicPrecisionManager._publish does); replacing the whole rel_error dict is noticed."""

    def __init__(self, policy: PrecisionPolicy, watermarks: Watermarks, block_bytes: int,
                 max_bytes_per_step: int, assignment: Mapping[ExpertKey, str]) -> None:
        if block_bytes <= 0 or max_bytes_per_step <= 0:
            raise ValueError("block_bytes and max_bytes_per_step must be positive")
        self.policy, self.watermarks = policy, watermarks
        self.block_bytes, self.max_bytes_per_step = block_bytes, max_bytes_per_step
        self.assignment = assignment
        self.demoting = False     # between crossing `low` and reaching the midpoint

    # -- the assignment and its array view -------------------------------------------------------------
    @property
    def assignment(self) -> dict[ExpertKey, str]:
        """Expert -> precision now. Read-only in place (moves go through `applied`); assigning a new
        map is allowed and resets the cached view."""
        return self._assignment

    @assignment.setter
    def assignment(self, assignment: Mapping[ExpertKey, str]) -> None:
        self._assignment = dict(assignment)
        self.keys = list(self._assignment)
        n = len(self.keys)
        self._index = {k: i for i, k in enumerate(self.keys)}
        # position of each key in sorted order: the rank tuples' last element (the tie-break)
        self._key_rank = np.empty(n, dtype=np.int64)
        self._key_rank[sorted(range(n), key=self.keys.__getitem__)] = np.arange(n)
        self._cur = np.array([rung_index(p) for p in self._assignment.values()], dtype=np.int64)
        self._down = np.full(n, -1, dtype=np.int64)     # ladder index of the demotion's rung; -1: none
        self._up = np.full(n, -1, dtype=np.int64)       # ladder index of the promotion's rung; -1: none
        self._rel = np.full((n, len(LADDER)), np.nan)   # rel_error per ladder rung (nan: none given)
        self._dirty: set[int] = set(range(n))           # experts whose cached view must be re-read
        self._zero = np.zeros(n, dtype=bool)            # activity == 0 when last read
        self._seen = None                               # (costs, rel_error, bytes) the cache was built on

    def _rung_bytes(self) -> np.ndarray:
        b = self.policy.bytes_per_rung
        return np.array([b.get(p, 0) for p in LADDER], dtype=np.int64)

    def total_bytes(self) -> int:
        """policy.total_bytes(self.assignment), without a pass over a dict."""
        return int(self._rung_bytes()[self._cur].sum())

    def num_below(self, precision: str) -> int:
        """How many experts sit at a rung below `precision`."""
        return int(np.count_nonzero(self._cur > rung_index(precision)))

    def costs_changed(self, keys: Optional[Iterable[ExpertKey]] = None) -> None:
        """These experts' relative errors changed (None: all of them)."""
        self._dirty.update(range(len(self.keys)) if keys is None else
                           (self._index[k] for k in keys if k in self._index))

    def _refresh(self) -> np.ndarray:
        """Bring the cached neighbours up to date; returns the activity per expert (in `keys` order)."""
        pol, n = self.policy, len(self.keys)
        seen = (pol.costs, pol.costs.rel_error, tuple(self._rung_bytes().tolist()))
        if self._seen is None or seen[0] is not self._seen[0] or seen[1] is not self._seen[1] \
                or seen[2] != self._seen[2]:
            self._dirty.update(range(n))
            self._seen = seen
        act = np.fromiter(map(pol.costs.activity.get, self.keys, repeat(1.0)), dtype=np.float64, count=n)
        # The frontier depends on activity only through whether it is zero (policy.frontier's memo).
        zero = act == 0
        self._dirty.update(np.flatnonzero(zero != self._zero).tolist())
        self._zero = zero
        for i in self._dirty:
            k, p = self.keys[i], LADDER[self._cur[i]]
            down, up = pol.neighbour(k, p, +1), pol.neighbour(k, p, -1)
            self._down[i] = -1 if down is None else rung_index(down)
            self._up[i] = -1 if up is None else rung_index(up)
            rel = pol.costs.rel_error.get(k, {})
            self._rel[i] = [rel.get(q, np.nan) for q in LADDER]
        self._dirty.clear()
        return act

    def _cost(self, idx: np.ndarray, rung: np.ndarray, act: np.ndarray) -> np.ndarray:
        """QualityCosts.cost for experts `idx` at ladder rungs `rung`: the same float operations."""
        return np.where(_EXACT_RUNG[rung], 0.0, self._rel[idx, rung] * act[idx])

    def _last_access(self, last_access) -> np.ndarray:
        n = len(self.keys)
        if not last_access:
            return np.full(n, -1.0)
        return np.fromiter(map(last_access.get, self.keys, repeat(-1)), dtype=np.float64, count=n)

    def _moves(self, idx, src, dst, delta) -> list[Move]:
        return [Move(self.keys[i], LADDER[s], LADDER[d], b)
                for i, s, d, b in zip(idx.tolist(), src.tolist(), dst.tolist(), delta.tolist())]

    # -- decisions ----------------------------------------------------------------------------------------
    def step(self, num_free_blocks: int, last_access: Mapping[ExpertKey, int],
             max_grow_bytes: Optional[int] = None) -> list[Move]:
        """`max_grow_bytes`: at most this many more expert bytes (the lender's own bound), else the watermarks'."""
        wm = self.watermarks
        if num_free_blocks < wm.low:
            self.demoting = True
        elif num_free_blocks >= wm.mid:
            self.demoting = False
        if self.demoting:
            return self.demote((wm.mid - num_free_blocks) * self.block_bytes, last_access)
        if num_free_blocks > wm.high:
            room = (num_free_blocks - wm.mid) * self.block_bytes
            return self._promote(room if max_grow_bytes is None else min(room, max_grow_bytes), last_access)
        return []

    def demote(self, need_bytes: int, last_access: Mapping[ExpertKey, int]) -> list[Move]:
        """The best-ranked demotions (one rung each) that free `need_bytes`, within the per-step cap:
        candidates in PrecisionPolicy.demote_rank order, taken greedily, skipping any that would pass
        the cap (tests/unit/test_controller.py checks this against the per-Move reference)."""
        if need_bytes <= 0:
            return []
        act = self._refresh()
        idx = np.flatnonzero(self._down >= 0)
        dst, src = self._down[idx], self._cur[idx]
        # Exact rungs first across steps too: no lossy demotion while an exact one is still possible.
        exact = _EXACT_RUNG[dst]
        if exact.any():
            idx, dst, src = idx[exact], dst[exact], src[exact]
        b = self._rung_bytes()
        delta = b[dst] - b[src]
        lossy = ~_EXACT_RUNG[dst]
        dcost = self._cost(idx, dst, act) - self._cost(idx, src, act)
        saved_per_cost = np.where(lossy, -delta / np.maximum(dcost, EPS), 0.0)
        last = self._last_access(last_access)[idx]
        # demote_rank = (lossy, -saved_per_cost, last access, key); lexsort's last key is the primary
        order = np.lexsort((self._key_rank[idx], last, -saved_per_cost, lossy))
        idx, src, dst, delta = idx[order], src[order], dst[order], delta[order]
        take = _take_greedy((-delta).tolist(), self.max_bytes_per_step, need_bytes)
        return self._moves(idx[take], src[take], dst[take], delta[take])

    def _promote(self, room_bytes: int, last_access) -> list[Move]:
        act = self._refresh()
        idx = np.flatnonzero(self._up >= 0)
        dst, src = self._up[idx], self._cur[idx]
        # Mirror image: lossless -> bf16 only once no expert is lossy.
        lossy_src = ~_EXACT_RUNG[src]
        if lossy_src.any():
            idx, dst, src = idx[lossy_src], dst[lossy_src], src[lossy_src]
        b = self._rung_bytes()
        delta = b[dst] - b[src]
        gain = self._cost(idx, src, act) - self._cost(idx, dst, act)
        last = self._last_access(last_access)[idx]
        # promote_rank = (exact only, -gain per byte, -last access, key)
        order = np.lexsort((self._key_rank[idx], -last, -gain / np.maximum(delta, 1), _EXACT_RUNG[src]))
        idx, src, dst, delta = idx[order], src[order], dst[order], delta[order]
        # NOTE: promotion takes memory from the KV cache; the cap and the room both bound it, so a
        # promotion never pushes free blocks below the midpoint (no demote/promote oscillation).
        take = _take_greedy(delta.tolist(), min(room_bytes, self.max_bytes_per_step))
        return self._moves(idx[take], src[take], dst[take], delta[take])

    def applied(self, moves: Iterable[Move]) -> None:
        """The runtime published these moves' new versions."""
        for m in moves:
            if self._assignment.get(m.key) != m.src:
                raise ValueError(f"move {m} does not start from the expert's current precision "
                                 f"{self._assignment.get(m.key)}")
            self._assignment[m.key] = m.dst
            i = self._index[m.key]
            self._cur[i] = rung_index(m.dst)
            self._dirty.add(i)
