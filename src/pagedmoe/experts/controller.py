"""The pressure controller of dynamic expert precision, and the manager that wires it to the runtime.

`PressureController` is a pure decision: free KV blocks in, (expert, from, to) moves out.
`DynamicPrecisionManager` runs it between engine steps. It owns the lending of KV blocks: the KV
cache is sized as if every expert sat at the floor (`--min-expert-precision`), and the bytes the
experts hold above the floor are *withheld* from the block pool, block for block:

    withheld blocks = ceil((expert bytes now - expert bytes at the floor) / KV bytes per block)

A demotion is published first and its blocks are released after (the pool grows); a promotion takes
its blocks out of the free list first and is built after (the pool shrinks), so at every instant
usable KV blocks + expert bytes fit the budget. The builds run off the forward path
(experts/quantized.py::DynamicExperts: a side stream on CUDA, between steps on CPU) and are published
at a step boundary, whole layers at a time.

No torch (numpy for the ranking): the runtime and the KV manager are passed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Mapping, Optional

import numpy as np

from pagedmoe.experts.precision import (_EPS, EXACT, LADDER, ExpertKey, Move, PrecisionPolicy, QualityCosts,
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
            down, up = pol._neighbour(k, p, +1), pol._neighbour(k, p, -1)
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
    def step(self, num_free_blocks: int, last_access: Mapping[ExpertKey, int]) -> list[Move]:
        wm = self.watermarks
        if num_free_blocks < wm.low:
            self.demoting = True
        elif num_free_blocks >= wm.mid:
            self.demoting = False
        if self.demoting:
            return self.demote((wm.mid - num_free_blocks) * self.block_bytes, last_access)
        if num_free_blocks > wm.high:
            return self._promote((num_free_blocks - wm.mid) * self.block_bytes, last_access)
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
        saved_per_cost = np.where(lossy, -delta / np.maximum(dcost, _EPS), 0.0)
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


@dataclass
class ControllerStats:
    demotions: int = 0
    promotions: int = 0
    bytes_changed: int = 0      # sum of |bytes_delta| over published moves
    publishes: int = 0          # step boundaries at which a new version went live
    builds_waited: int = 0      # ticks that found the previous build still running (CUDA)
    ticks: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DynamicPrecisionManager:
    """Between engine steps: publish finished builds, read pressure, start the next moves.

    `runtime` is an experts/quantized.py::DynamicExperts; `kv` a kvcache KVCacheManager (its pool
    withholds and releases blocks); `activity` the ActivityTable (read on the host on ticks that act)."""

    def __init__(self, runtime, kv, block_bytes: int, low: float, high: float, min_precision: str,
                 activity=None, min_usable_blocks: int = 1, max_bytes_per_step: Optional[int] = None,
                 initial: Optional[Mapping[ExpertKey, str]] = None,
                 rel_error: Optional[Mapping[ExpertKey, Mapping[str, float]]] = None) -> None:
        self.runtime, self.kv, self.activity = runtime, kv, activity
        self.block_bytes = block_bytes
        self.num_blocks = kv.num_blocks
        keys = runtime.keys
        errors = {k: dict(PRIOR_REL_ERROR) for k in keys}
        for k, v in (rel_error or {}).items():
            if k in errors:
                errors[k].update(v)
        self.costs = QualityCosts(errors, {k: 1.0 for k in keys})
        bpr = runtime.bytes_per_rung()
        self.policy = PrecisionPolicy(bpr, self.costs, min_precision)
        self.floor_bytes = len(keys) * bpr[min_precision]
        self.watermarks = Watermarks.from_fractions(low, high, self.num_blocks)
        layer_top = runtime.num_experts * bpr["bf16"]
        self.max_bytes_per_step = max_bytes_per_step or max(layer_top, block_bytes)
        self.stats = ControllerStats()
        self.min_usable_blocks = min_usable_blocks
        # Start as exact as the budget allows while leaving the watermarks' midpoint (and one
        # full-length sequence) free: nothing is quantised while an exact plan fits.
        # A precision map given at start (--expert-stats) is kept as long as one full-length sequence
        # still fits beside it (so a map can be held: watermarks 0 and 1 never move it).
        keep_free = max(self.watermarks.mid, min_usable_blocks)
        budget = self.floor_bytes + max(0, self.num_blocks - keep_free) * block_bytes
        room = self.floor_bytes + max(0, self.num_blocks - min_usable_blocks) * block_bytes
        if initial is not None and set(initial) == set(keys) and self.policy.total_bytes(initial) <= room \
                and all(p in self.policy.allowed for p in initial.values()):
            start = dict(initial)
        else:
            start = self.policy.plan(budget, keys)
        self.withheld = 0
        if not self._withhold_for(start):
            raise RuntimeError(f"dynamic precision: the starting map needs {self._blocks_for(start)} of "
                               f"{self.num_blocks} KV blocks")
        runtime.build_all(start)
        self.controller = PressureController(self.policy, self.watermarks, block_bytes, self.max_bytes_per_step,
                                             start)
        self._pending: list[Move] = []
        self._keys_by_layer = None      # [(layer, expert)] in the activity table's row-major order

    # -- KV lending -----------------------------------------------------------------------------
    def surplus_bytes(self, assignment: Mapping[ExpertKey, str]) -> int:
        return self.policy.total_bytes(assignment) - self.floor_bytes

    def _blocks_for(self, assignment) -> int:
        return self._blocks_for_bytes(self.policy.total_bytes(assignment))

    def _blocks_for_bytes(self, total_bytes: int) -> int:
        return -(-max(0, total_bytes - self.floor_bytes) // self.block_bytes)

    def _withhold_for(self, assignment=None, total_bytes: Optional[int] = None) -> bool:
        if total_bytes is None:
            total_bytes = self.policy.total_bytes(assignment)
        need = self._blocks_for_bytes(total_bytes) - self.withheld
        if need <= 0:
            return True
        # the pool lends its highest blocks (their memory goes back to the device): they must be free
        if not self.kv.can_withhold(need) or self.num_blocks - self.withheld - need < self.min_usable_blocks:
            return False
        self.kv.withhold(need)
        self.withheld += need
        return True

    def _release_to(self, total_bytes: int) -> None:
        """Give back the blocks the experts no longer need. Fewer come back when their memory cannot be
        mapped yet (torch still caching the experts' old forms); `tick` tries again."""
        extra = self.withheld - self._blocks_for_bytes(total_bytes)
        if extra > 0:
            self.withheld -= self.kv.release(extra)

    # -- one tick per engine step ----------------------------------------------------------------
    def tick(self) -> list[Move]:
        """Publish a finished build; else read pressure and start new moves. Returns what was published."""
        self.stats.ticks += 1
        if not self._pending:                         # a release the device could not map before
            self._release_to(self.controller.total_bytes())
        if self._pending:
            if not self.runtime.ready():
                self.stats.builds_waited += 1
                return []
            return self._publish()
        free, wm, ctl = self.kv.num_free_blocks, self.watermarks, self.controller
        # Rank experts only when the controller would act (the hysteresis band costs nothing).
        demote = free < wm.low or (ctl.demoting and free < wm.mid)
        promote = free > wm.high and ctl.num_below(self.policy.top) > 0
        if not (demote or promote):
            ctl.demoting = ctl.demoting and free < wm.mid
            return []
        moves = ctl.step(free, self._refresh_activity())
        return self._start(moves)

    def demote_to(self, target_bytes: int, bytes_per_rung: Optional[Mapping[str, int]] = None) -> int:
        """Demote through the controller's own ranking and per-step cap until the experts take at most
        `target_bytes` (counted with `bytes_per_rung` if given, e.g. bf16 sizes for a float32 CPU run).
        For studies at a fixed expert-memory budget. Returns the number of rounds."""
        bpr = dict(bytes_per_rung or self.policy.bytes_per_rung)
        rounds = 0
        while True:
            total = sum(bpr[p] for p in self.controller.assignment.values())
            if total <= target_bytes:
                return rounds
            ratio = self.policy.bytes_per_rung["bf16"] / bpr["bf16"]
            moves = self.controller.demote(int((total - target_bytes) * ratio), {})
            if not moves:
                raise ValueError(f"cannot demote below {total} B (target {target_bytes} B)")
            self._start(moves)
            while self._pending:
                if self.runtime.ready():
                    self._publish()
            rounds += 1

    def _start(self, moves: list[Move]) -> list[Move]:
        if not moves:
            return []
        new_total = self.controller.total_bytes() + sum(m.bytes_delta for m in moves)
        if any(m.bytes_delta > 0 for m in moves) and not self._withhold_for(total_bytes=new_total):
            moves = [m for m in moves if m.bytes_delta <= 0]   # no room for the promotions now
            if not moves:
                return []
        if getattr(self.runtime, "layer_by_layer", False):
            return self._build_layer_by_layer(moves)
        self.runtime.build({m.key: m.dst for m in moves})
        self._pending = moves
        return self._publish() if self.runtime.ready() else []

    def _build_layer_by_layer(self, moves: list[Move]) -> list[Move]:
        """Build and publish the moves one layer after another, within this step boundary: a build holds its
        layer's old and new versions side by side, so one layer at a time bounds the transient by one layer
        (the room the budget keeps: ExpertStore.dynamic_build_bytes). Every move still lands this tick, so
        the demotion cascade takes as many steps as one build of every layer would (979f178 reverted a cap
        that left the other layers to later ticks: the cascade then needed a step per layer and Mixtral's
        fill outran its sequences)."""
        by_layer: dict[int, list[Move]] = {}
        for m in moves:
            by_layer.setdefault(m.key[0], []).append(m)
        published = []
        for layer_moves in by_layer.values():
            self.runtime.build({m.key: m.dst for m in layer_moves})
            self.runtime.wait()      # the GPU is idle between steps: the build runs alone
            self._pending = layer_moves
            # NOTE: blocks withheld for the later layers' promotions must stay withheld: release once, at the end
            published += self._publish(release=False)
        self._release_to(self.controller.total_bytes())
        return published

    def _publish(self, release: bool = True) -> list[Move]:
        moves, self._pending = self._pending, []
        measured = self.runtime.publish()
        self.controller.applied(moves)
        for k, errs in measured.items():
            self.costs.rel_error[k].update(errs)
        self.controller.costs_changed(measured)
        if release:
            self._release_to(self.controller.total_bytes())
        s = self.stats
        s.publishes += 1
        s.demotions += sum(m.bytes_delta < 0 for m in moves)
        s.promotions += sum(m.bytes_delta > 0 for m in moves)
        s.bytes_changed += sum(abs(m.bytes_delta) for m in moves)
        return moves

    def _refresh_activity(self) -> dict:
        """Costs follow the activity EMA (each expert's share of its layer's routed tokens, add-a-little
        smoothed); last access steps break ties. One small device->host read between steps; runs only
        on ticks where the controller acts, vectorised (a Python loop over thousands of experts cost
        about a millisecond per tick)."""
        if self.activity is None:
            return {}
        ema, last = self.activity.host_view()
        self.runtime.store.table.record_activity(ema, last)
        if self._keys_by_layer is None:
            self._keys_by_layer = [(l, e) for l in range(len(ema)) for e in range(len(ema[0]) if ema else 0)]
        # NOTE: row totals with Python's sum (left to right), not numpy's pairwise sum, and the same
        # elementwise float operations as before: the costs, and so the ranking, stay bit for bit.
        totals = np.array([sum(row) + 1e-3 * len(row) for row in ema], dtype=np.float64)
        act = (np.asarray(ema, dtype=np.float64) + 1e-3) / totals[:, None]
        self.costs.update_activity(dict(zip(self._keys_by_layer, act.ravel().tolist())))
        return dict(zip(self._keys_by_layer, (v for row in last for v in row)))

    # -- reporting ---------------------------------------------------------------------------------
    @property
    def assignment(self) -> dict[ExpertKey, str]:
        return self.controller.assignment

    def precision_counts(self) -> dict[str, int]:
        out = {p: 0 for p in self.policy.allowed}
        for p in self.controller.assignment.values():
            out[p] = out.get(p, 0) + 1
        return out

    def as_dict(self) -> dict:
        return {"precision_counts": self.precision_counts(),
                "expert_dynamic_bytes": self.runtime.device_bytes,
                "precision_offline_forms_used": getattr(self.runtime, "offline_hits", 0),
                "expert_precision_changes_total": {"up": self.stats.promotions, "down": self.stats.demotions},
                "precision_total_bytes": self.policy.total_bytes(self.controller.assignment),
                "precision_floor_bytes": self.floor_bytes,
                "kv_blocks_withheld": self.withheld, "kv_low_watermark_blocks": self.watermarks.low,
                "kv_high_watermark_blocks": self.watermarks.high,
                **{f"precision_{k}": v for k, v in self.stats.as_dict().items()}}

    def precision_map(self) -> list[list[str]]:
        L, E = self.runtime.num_layers, self.runtime.num_experts
        return [[self.controller.assignment[(l, e)] for e in range(E)] for l in range(L)]

    def state_json(self) -> dict:
        return {"precision_map": self.precision_map(),
                "rel_error": [[l, e, v] for (l, e), v in sorted(self.costs.rel_error.items())]}


def parse_state(data: dict, num_layers: int, num_experts: int) -> tuple[Optional[dict], Optional[dict]]:
    """(initial assignment, rel_error) from an --expert-stats file, each None when absent."""
    initial = rel = None
    pm = data.get("precision_map")
    if pm is not None:
        if len(pm) != num_layers or any(len(r) != num_experts for r in pm):
            raise ValueError(f"expert stats: precision map does not fit {num_layers} x {num_experts} experts")
        initial = {(l, e): p for l, r in enumerate(pm) for e, p in enumerate(r)}
    if data.get("rel_error") is not None:
        rel = {(int(l), int(e)): dict(v) for l, e, v in data["rel_error"]}
    return initial, rel

