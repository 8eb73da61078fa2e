"""The manager that runs dynamic precision between engine steps and owns the lending of KV blocks.

The KV cache is sized as if every expert sat at the floor (`--min-expert-precision`), and the bytes the
experts hold above the floor are *withheld* from the block pool, block for block:

    withheld blocks = ceil((expert bytes now - expert bytes at the floor) / KV bytes per block)

A demotion is published first and its blocks are released after (the pool grows); a promotion takes
its blocks out of the free list first and is built after (the pool shrinks), so at every instant
usable KV blocks + expert bytes fit the budget. The builds run off the forward path
(experts/dynamic/versions.py::DynamicExperts: a side stream on CUDA, between steps on CPU) and are published
at a step boundary, whole layers at a time. The decisions are the PressureController's (controller.py).

No torch (numpy for the ranking): the runtime and the KV manager are passed in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from pagedmoe.experts.dynamic.controller import PRIOR_REL_ERROR, PressureController, Watermarks
from pagedmoe.experts.dynamic.precision import ExpertKey, Move, PrecisionPolicy, QualityCosts


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

    `runtime` is an experts/dynamic/versions.py::DynamicExperts; `kv` a kvcache KVCacheManager (its pool
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

    def grow_room_bytes(self) -> int:
        """How many more bytes the experts may take: the pool keeps `min_usable_blocks` blocks usable (one
        max_model_len sequence), whatever the watermarks allow."""
        lendable = (self.num_blocks - self.min_usable_blocks) * self.block_bytes
        return lendable - (self.controller.total_bytes() - self.floor_bytes)

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
        # NOTE: promotions are bounded by what the pool can lend too: where one sequence's blocks are more than the
        # watermarks' midpoint (a small pool), a batch sized by the watermarks alone never fit and none happened
        grow = self.grow_room_bytes()
        promote = free > wm.high and grow > 0 and ctl.num_below(self.policy.top) > 0
        if not (demote or promote):
            ctl.demoting = ctl.demoting and free < wm.mid
            return []
        moves = ctl.step(free, self._refresh_activity(), max_grow_bytes=grow)
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

