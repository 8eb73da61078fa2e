"""Quality-aware expert precision: the ladder, quality costs and the budget policy (the pressure controller
that drives it at run time: experts/dynamic/controller.py).

Pure decisions on numbers (no torch): the runtime feeds in bytes per rung, quality costs, free KV
blocks and last-access steps, and applies the (expert, from, to) moves it gets back.

Ladder, most to least exact: bf16 -> lossless (exact, compressed) -> fp8 -> int8 -> int4.
A move is one step along an expert's *frontier*: the rungs it may use (not below the floor), minus
lossy rungs another lossy rung dominates (no more bytes and no more cost; fp8 and int8 take the same
bytes, so usually only the more accurate of the two stays). Exact rungs are never dropped: bf16 and
lossless differ in speed, not quality.
Ranking: exact moves first (nothing is quantised while an exact plan fits), then the lossy move with
the most bytes saved per unit of quality cost added; least recently used first on ties. Promotion is
the mirror image: most quality regained per byte first, most recently used first, exact moves last.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

LADDER = ("bf16", "lossless", "fp8", "int8", "int4")
EXACT = frozenset({"bf16", "lossless"})
ExpertKey = tuple[int, int]     # (layer_idx, expert_id)

EPS = 1e-30  # guards divisions by a quality cost of zero


def rung_index(precision: str) -> int:
    try:
        return LADDER.index(precision)
    except ValueError:
        raise ValueError(f"unknown precision {precision!r}; the ladder is {LADDER}") from None


def rung_bytes(hidden: int, inter: int, lossless_ratio: float = 0.675,
               precisions: Iterable[str] = LADDER) -> dict[str, int]:
    """Bytes of one expert per rung. Lossy rungs are exact arithmetic (codecs/quant.bytes_of, scales
    included); lossless is data dependent, so it is bf16 bytes times a measured or assumed ratio
    (0.675: the exponent-Huffman codec on N(0, 0.02) weights, docs/formats.md)."""
    n13, k13, n2, k2 = 2 * inter, hidden, hidden, inter
    out = {}
    for p in precisions:
        rung_index(p)
        if p == "bf16":
            b = 2 * 3 * inter * hidden
        elif p == "lossless":
            b = int(math.ceil(2 * 3 * inter * hidden * lossless_ratio))
        elif p in ("fp8", "int8"):
            b = n13 * k13 + 4 * n13 + n2 * k2 + 4 * n2
        else:  # int4: packed nibbles + a float32 scale per group of 128 along K
            b = n13 * ((k13 + 1) // 2) + 4 * n13 * (-(-k13 // 128)) + n2 * ((k2 + 1) // 2) + 4 * n2 * (-(-k2 // 128))
        out[p] = b
    return out


@dataclass
class QualityCosts:
    """cost(key, p) = rel_error[key][p] * activity[key]: the relative error of the expert's output on its
    routed calibration activations at precision p, times its share of the layer's routed tokens. Exact
    rungs cost 0. `activity` can be refreshed online (the activity table's EMA) without recalibrating."""
    rel_error: dict[ExpertKey, dict[str, float]]
    activity: dict[ExpertKey, float] = field(default_factory=dict)

    def cost(self, key: ExpertKey, precision: str) -> float:
        if precision in EXACT:
            return 0.0
        return self.rel_error[key][precision] * self.activity.get(key, 1.0)

    def update_activity(self, activity: Mapping[ExpertKey, float]) -> None:
        self.activity = dict(activity)

    def keys(self) -> list[ExpertKey]:
        return sorted(self.rel_error)

    @classmethod
    def from_counts(cls, rel_error: dict[ExpertKey, dict[str, float]], counts: Mapping[ExpertKey, float],
                    smoothing: float = 1.0) -> "QualityCosts":
        """Activity = share of the layer's routed tokens, add-`smoothing` so an expert unseen in
        calibration still costs something."""
        totals: dict[int, float] = {}
        for key in rel_error:
            totals[key[0]] = totals.get(key[0], 0.0) + counts.get(key, 0.0) + smoothing
        act = {k: (counts.get(k, 0.0) + smoothing) / totals[k[0]] for k in rel_error}
        return cls(rel_error, act)

    def to_json(self) -> dict:
        return {"rel_error": [[l, e, v] for (l, e), v in sorted(self.rel_error.items())],
                "activity": [[l, e, v] for (l, e), v in sorted(self.activity.items())]}

    @classmethod
    def from_json(cls, data: dict) -> "QualityCosts":
        return cls({(l, e): dict(v) for l, e, v in data["rel_error"]},
                   {(l, e): float(v) for l, e, v in data["activity"]})


@dataclass(frozen=True)
class Move:
    key: ExpertKey
    src: str
    dst: str
    bytes_delta: int          # dst bytes - src bytes (negative for a demotion)


class PrecisionPolicy:
    """Frontiers and move ranking shared by the static planner (`plan`) and the PressureController."""

    def __init__(self, bytes_per_rung: Mapping[str, int], costs: QualityCosts, min_precision: str = "int4",
                 max_precision: str = "bf16") -> None:
        lo, hi = rung_index(min_precision), rung_index(max_precision)
        if hi > lo:
            raise ValueError(f"--min-expert-precision {min_precision} is above the top rung {max_precision}")
        self.bytes_per_rung = dict(bytes_per_rung)
        self.costs = costs
        self.allowed = tuple(p for p in LADDER[hi:lo + 1] if p in self.bytes_per_rung)
        if not self.allowed:
            raise ValueError("no rung between the top and the floor has a byte size")
        self.top, self.floor = self.allowed[0], self.allowed[-1]

    # -- per-expert frontier ----------------------------------------------------------------------
    def frontier(self, key: ExpertKey) -> list[str]:
        # Memoised on what it depends on: the expert's relative errors, whether its activity is zero
        # (activity scales every lossy cost of an expert alike, so it cannot reorder them) and the bytes.
        rel = self.costs.rel_error.get(key, {})
        memo = (tuple(rel.get(p) for p in self.allowed), self.costs.activity.get(key, 1.0) == 0,
                tuple(self.bytes_per_rung[p] for p in self.allowed))
        cache = self.__dict__.setdefault("_frontiers", {})
        hit = cache.get(key)
        if hit is not None and hit[0] == memo:
            return hit[1]
        out = self._frontier(key)
        cache[key] = (memo, out)
        return out

    def _frontier(self, key: ExpertKey) -> list[str]:
        b, c = self.bytes_per_rung, self.costs.cost
        lossy = [p for p in self.allowed if p not in EXACT]

        def dominated(p: str) -> bool:
            for q in lossy:
                if q == p:
                    continue
                no_worse = b[q] <= b[p] and c(key, q) <= c(key, p)
                strictly = b[q] < b[p] or c(key, q) < c(key, p)
                # an exact tie keeps the rung higher on the ladder
                if no_worse and (strictly or rung_index(q) < rung_index(p)):
                    return True
            return False

        rungs = [p for p in self.allowed if p in EXACT or not dominated(p)]
        # Keep only rungs that save bytes going down (a step that saves nothing is never worth taking).
        out: list[str] = []
        for p in rungs:
            if not out or b[p] < b[out[-1]]:
                out.append(p)
        return out

    def neighbour(self, key: ExpertKey, current: str, step: int) -> Optional[str]:
        f = self.frontier(key)
        if current in f:
            j = f.index(current) + step
            return f[j] if 0 <= j < len(f) else None
        # Off the frontier (a floor or costs changed): go to the nearest frontier rung in that direction.
        idx = rung_index(current)
        cands = [p for p in f if (rung_index(p) > idx if step > 0 else rung_index(p) < idx)]
        if not cands:
            return None
        return cands[0] if step > 0 else cands[-1]

    def demotion(self, key: ExpertKey, current: str) -> Optional[Move]:
        dst = self.neighbour(key, current, +1)
        if dst is None:
            return None
        return Move(key, current, dst, self.bytes_per_rung[dst] - self.bytes_per_rung[current])

    def promotion(self, key: ExpertKey, current: str) -> Optional[Move]:
        dst = self.neighbour(key, current, -1)
        if dst is None:
            return None
        return Move(key, current, dst, self.bytes_per_rung[dst] - self.bytes_per_rung[current])

    def demote_rank(self, m: Move, last_access: Mapping[ExpertKey, int]) -> tuple:
        """Smaller is demoted first."""
        dcost = self.costs.cost(m.key, m.dst) - self.costs.cost(m.key, m.src)
        lossy = m.dst not in EXACT
        saved_per_cost = -m.bytes_delta / max(dcost, EPS) if lossy else 0.0
        return (lossy, -saved_per_cost, last_access.get(m.key, -1), m.key)

    def promote_rank(self, m: Move, last_access: Mapping[ExpertKey, int]) -> tuple:
        """Smaller is promoted first."""
        gain = self.costs.cost(m.key, m.src) - self.costs.cost(m.key, m.dst)
        exact_only = m.src in EXACT
        return (exact_only, -gain / max(m.bytes_delta, 1), -last_access.get(m.key, -1), m.key)

    def total_bytes(self, assignment: Mapping[ExpertKey, str]) -> int:
        return sum(self.bytes_per_rung[p] for p in assignment.values())

    def total_cost(self, assignment: Mapping[ExpertKey, str]) -> float:
        return sum(self.costs.cost(k, p) for k, p in assignment.items())

    def min_bytes(self, keys: Iterable[ExpertKey]) -> int:
        return sum(self.bytes_per_rung[self.frontier(k)[-1]] for k in keys)

    # -- static plan under a byte budget -----------------------------------------------------------
    def plan(self, budget_bytes: int, keys: Optional[Iterable[ExpertKey]] = None,
             last_access: Optional[Mapping[ExpertKey, int]] = None) -> dict[ExpertKey, str]:
        """Every expert at the top rung, then the best-ranked demotion one rung at a time until the
        experts fit `budget_bytes`. Refuses a budget that even the floor does not fit."""
        keys = list(self.costs.keys() if keys is None else keys)
        last_access = last_access or {}
        need = self.min_bytes(keys)
        if need > budget_bytes:
            raise ValueError(f"expert budget {budget_bytes} B is below the minimum {need} B with every "
                             f"expert at the floor ({self.floor})")
        assignment = {k: self.top for k in keys}
        total = self.total_bytes(assignment)
        candidates = {k: self.demotion(k, self.top) for k in keys}
        while total > budget_bytes:
            best = min((m for m in candidates.values() if m is not None),
                       key=lambda m: self.demote_rank(m, last_access))
            assignment[best.key] = best.dst
            total += best.bytes_delta
            candidates[best.key] = self.demotion(best.key, best.dst)
        return assignment

