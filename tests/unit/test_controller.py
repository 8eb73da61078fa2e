"""DynamicPrecisionManager and the block pool's lending, on fake capacities (no torch).

The invariant under test: at every instant, KV blocks in circulation + blocks' worth of expert bytes
above the floor <= the KV cache's blocks. A demotion's blocks are released only after its version is
published; a promotion's blocks are withheld before its version is built."""
from __future__ import annotations

import pytest

from pagedmoe.experts.dynamic.controller import Watermarks
from pagedmoe.experts.dynamic.manager import DynamicPrecisionManager
from pagedmoe.kvcache.block_pool import BlockPool, KVCacheManager

BYTES = {"bf16": 100, "fp8": 52, "int8": 52, "int4": 28}


class FakeRuntime:
    """Builds 'finish' only when the test says so (like a CUDA side stream)."""

    def __init__(self, num_layers=2, num_experts=4, async_builds=False):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.keys = [(l, e) for l in range(num_layers) for e in range(num_experts)]
        self.published: dict = {}
        self.staged = None
        self.async_builds, self.done = async_builds, not async_builds

    def bytes_per_rung(self):
        return dict(BYTES)

    @property
    def device_bytes(self):
        return sum(BYTES[p] for p in self.published.values())

    def build_all(self, assignment):
        self.published = dict(assignment)

    def build(self, changes):
        assert self.staged is None
        self.staged, self.done = dict(changes), not self.async_builds

    def ready(self):
        return self.done

    def publish(self):
        self.published.update(self.staged)
        self.staged = None
        return {}


def make(async_builds=False, blocks=40, block_bytes=10, low=0.1, high=0.5, **kw):
    kv = KVCacheManager(blocks, 16)
    rt = FakeRuntime(async_builds=async_builds)
    mgr = DynamicPrecisionManager(rt, kv, block_bytes, low, high, "int4", **kw)
    return kv, rt, mgr


def check_invariant(kv, mgr):
    published = mgr.runtime.published
    surplus = sum(BYTES[p] for p in published.values()) - mgr.floor_bytes
    in_use = kv.num_blocks - kv.pool.num_withheld_blocks
    assert in_use * mgr.block_bytes + surplus <= kv.num_blocks * mgr.block_bytes
    assert kv.pool.num_withheld_blocks == mgr.withheld


def test_block_pool_withhold_release():
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.withhold(4)
    assert pool.num_free_blocks == 1 and pool.num_withheld_blocks == 4
    assert pool.usage() == pytest.approx(3 / 4)
    with pytest.raises(MemoryError):
        pool.withhold(2)
    pool.release(4)
    pool.free(a)
    assert pool.num_free_blocks == 8 and sorted(pool.allocate(8)) == list(range(8))
    with pytest.raises(ValueError):
        pool.release(1)


def test_watermarks_from_fractions():
    wm = Watermarks.from_fractions(0.05, 0.25, 200)
    assert (wm.low, wm.high, wm.mid) == (10, 50, 30)
    assert Watermarks.from_fractions(0.0, 1.0, 7).high == 7     # never exceeded: no promotion
    assert Watermarks.from_fractions(0.0, 0.0, 7).high == 1


def test_starts_exact_when_it_fits_and_lends_the_rest():
    kv, rt, mgr = make()
    # 8 experts: floor 8 * 28 = 224 B; all exact = 800 B: 58 blocks of surplus do not fit 40 - mid(12)
    assert mgr.withheld * 10 >= mgr.surplus_bytes(mgr.assignment)
    assert kv.num_free_blocks == 40 - mgr.withheld >= mgr.watermarks.mid
    check_invariant(kv, mgr)
    kv2, _, mgr2 = make(blocks=200)
    assert set(mgr2.assignment.values()) == {"bf16"} and mgr2.withheld == 58
    check_invariant(kv2, mgr2)


def test_async_build_releases_after_publish_and_withholds_before_build():
    kv, rt, mgr = make(async_builds=True, blocks=200)
    kv.allocate("r", (200 - 58 - 5) * 16)          # fill the cache: free 5 < low 20
    assert mgr.tick() == [] and rt.staged           # demotions started, not published
    withheld = mgr.withheld
    check_invariant(kv, mgr)
    assert mgr.tick() == [] and mgr.withheld == withheld and mgr.stats.builds_waited == 1
    rt.done = True
    moves = mgr.tick()
    assert moves and all(m.bytes_delta < 0 for m in moves)
    assert mgr.withheld < withheld                  # released only now
    check_invariant(kv, mgr)
    # pressure eases: promotions withhold first, while their build is still running
    kv.free("r")
    before = mgr.withheld
    assert mgr.tick() == [] and rt.staged and mgr.withheld > before
    check_invariant(kv, mgr)
    rt.done = True
    assert all(m.bytes_delta > 0 for m in mgr.tick())
    check_invariant(kv, mgr)


def test_demote_to_a_byte_target():
    kv, rt, mgr = make(blocks=200)
    mgr.demote_to(400)
    assert mgr.policy.total_bytes(mgr.assignment) <= 400
    assert mgr.assignment == rt.published
    check_invariant(kv, mgr)
    with pytest.raises(ValueError, match="cannot demote"):
        mgr.demote_to(100)


def test_promotion_waits_for_the_pool_tail_and_a_release_the_device_cannot_map_is_retried():
    """The pool lends its highest blocks (their memory goes back to the device), so a promotion waits
    while a request holds one of them; a demotion's blocks come back only once their memory maps again."""
    from test_block_pool import FakeBacking

    kv, rt, mgr = make(blocks=200)
    kv.backing = FakeBacking(200, room=0)
    kv.withhold(0)                                   # the backing follows the pool's tail from here
    assert kv.backing.mapped == -(-kv.pool.top // 4)
    kv.allocate("r", (200 - 58 - 5) * 16)            # 5 free < low 20: demote
    moves = mgr.tick()
    assert moves and all(m.bytes_delta < 0 for m in moves)
    # only the blocks of the chunk still mapped come back (142, 143 share chunk 35 with free blocks)
    assert mgr.withheld == 56 > mgr._blocks_for(mgr.assignment) and kv.pool.top == kv.backing.mapped * 4
    check_invariant(kv, mgr)
    kv.backing.room = 10**9
    mgr.tick()                                       # retried before anything else
    assert mgr.withheld == mgr._blocks_for(mgr.assignment) < 58
    check_invariant(kv, mgr)
    # a request holding the block just below the tail blocks promotions, however many blocks are free
    kv.free("r")
    kv.allocate("low", 16 * (kv.pool.top - 1))
    kv.allocate("tail", 16)
    assert kv.block_table("tail") == [kv.pool.top - 1]
    kv.free("low")
    before = dict(mgr.assignment)
    assert kv.num_free_blocks > mgr.watermarks.high and mgr.tick() == []
    assert mgr.assignment == before
    kv.free("tail")
    assert all(m.bytes_delta > 0 for m in mgr.tick()) and mgr.assignment != before
    check_invariant(kv, mgr)


def test_a_small_pool_promotes_back_within_what_it_can_lend():
    """One max_model_len sequence (min_usable_blocks 25 of 40) needs more blocks than the watermarks' midpoint (12)
    leaves free, so only 15 blocks can ever be lent. Promotions are sized by that bound too: sized by the watermarks
    alone (28 blocks' worth), every batch was refused whole and nothing was ever promoted back."""
    kv, rt, mgr = make(blocks=40, min_usable_blocks=25)
    start = mgr.withheld
    assert 0 < start <= 40 - 25
    kv.allocate("r", (40 - start - 2) * 16)          # 2 free < low 4: demote
    assert all(m.bytes_delta < 0 for m in mgr.tick())
    demoted = mgr.withheld
    assert demoted < start
    kv.free("r")
    for _ in range(10):
        mgr.tick()
    assert mgr.stats.promotions > 0 and mgr.withheld == start == 40 - 25     # as far back as the pool can lend
    assert mgr.grow_room_bytes() < BYTES["int8"] - BYTES["int4"]              # no room for the smallest move
    check_invariant(kv, mgr)


def test_precision_metrics_exported():
    """The manager's stats feed Prometheus: changes by direction and KV blocks lent to experts."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedmoe.server.metrics import EngineStatsCollector

    kv, rt, mgr = make(blocks=200)
    mgr.demote_to(400)
    stats = {**mgr.as_dict(), "experts": {"resident/bf16": 1, "quantized/int4": 7}}
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(lambda: stats, "m", {}))
    text = generate_latest(reg).decode()
    down = stats["expert_precision_changes_total"]["down"]
    assert down > 0
    assert f'pagedmoe:expert_precision_changes_total{{direction="down",model_name="m"}} {float(down)}' in text
    assert f'pagedmoe:expert_kv_blocks_lent{{model_name="m"}} {float(mgr.withheld)}' in text
    assert 'pagedmoe:experts{model_name="m",precision="int4",tier="quantized"} 7.0' in text


# -- the vectorised ranking against the per-Move reference ---------------------------------------------
def _ref_demote(ctl, need_bytes, last_access):
    """PressureController.demote as first written: a Move per expert, sorted by demote_rank."""
    from pagedmoe.experts.dynamic.precision import EXACT

    pol = ctl.policy
    cands = [m for k, p in ctl.assignment.items() if (m := pol.demotion(k, p)) is not None]
    if any(m.dst in EXACT for m in cands):
        cands = [m for m in cands if m.dst in EXACT]
    cands.sort(key=lambda m: pol.demote_rank(m, last_access))
    moves, freed, changed = [], 0, 0
    for m in cands:
        if freed >= need_bytes:
            break
        if changed - m.bytes_delta > ctl.max_bytes_per_step:
            continue
        moves.append(m)
        freed -= m.bytes_delta
        changed -= m.bytes_delta
    return moves


def _ref_promote(ctl, room_bytes, last_access):
    from pagedmoe.experts.dynamic.precision import EXACT

    pol = ctl.policy
    cands = [m for k, p in ctl.assignment.items() if (m := pol.promotion(k, p)) is not None]
    if any(m.src not in EXACT for m in cands):
        cands = [m for m in cands if m.src not in EXACT]
    cands.sort(key=lambda m: pol.promote_rank(m, last_access))
    moves, used = [], 0
    for m in cands:
        if used + m.bytes_delta > min(room_bytes, ctl.max_bytes_per_step):
            continue
        moves.append(m)
        used += m.bytes_delta
    return moves


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_selection_matches_reference(seed):
    """Same moves in the same order as the per-Move implementation, on random costs, activities (zeros
    and ties included), assignments (off-frontier rungs included), last accesses (ties, missing keys),
    byte caps and needs; over several rounds of applied moves, re-measured errors and new activity."""
    import random

    from pagedmoe.experts.dynamic.controller import PressureController
    from pagedmoe.experts.dynamic.precision import PrecisionPolicy, QualityCosts

    rng = random.Random(seed)
    L, E = rng.choice([(1, 5), (2, 8), (3, 17)])
    keys = [(l, e) for l in range(L) for e in range(E)]
    rung_bytes = {"bf16": 100, "lossless": rng.choice([68, 70]), "fp8": 52, "int8": 52, "int4": rng.choice([28, 52])}
    floor = rng.choice(["int4", "int8", "fp8"])
    small = [0.001, 0.004, 0.01, 0.025, 0.07]     # few values: ties between experts and rungs

    def rel():
        return {p: rng.choice(small) for p in ("fp8", "int8", "int4")}

    def activity():
        return {k: rng.choice([0.0, 0.05, 0.125, 0.5, 1.0, rng.random()]) for k in keys if rng.random() < 0.9}

    costs = QualityCosts({k: rel() for k in keys}, activity())
    pol = PrecisionPolicy(rung_bytes, costs, floor)
    start = {k: rng.choice(pol.allowed) for k in keys}
    ctl = PressureController(pol, Watermarks(5, 15), block_bytes=8, max_bytes_per_step=rng.choice([24, 60, 150, 10**6]),
                             assignment=start)
    for _ in range(12):
        last = {k: rng.randint(0, 4) for k in keys if rng.random() < 0.8}
        if rng.random() < 0.5:
            need = rng.choice([0, 1, 30, 200, 10**6])
            got, want = ctl.demote(need, last), _ref_demote(ctl, need, last)
        else:
            room = rng.choice([0, 10, 40, 300, 10**6])
            got, want = ctl._promote(room, last), _ref_promote(ctl, room, last)
        assert got == want
        ctl.applied(got)
        assert ctl.total_bytes() == pol.total_bytes(ctl.assignment)
        # costs change the way the manager changes them: measured errors in place, new activity
        for k in rng.sample(keys, k=min(3, len(keys))):
            costs.rel_error[k].update(rel())
            ctl.costs_changed([k])
        if rng.random() < 0.5:
            costs.update_activity(activity())


class LayerByLayerRuntime(FakeRuntime):
    """Like DynamicExperts: the manager builds one layer at a time and waits for it. Records the largest
    transient: every published version plus the layer being built (its old version is still published)."""
    layer_by_layer = True

    def __init__(self, **kw):
        super().__init__(async_builds=True, **kw)
        self.layers_built, self.peak_bytes = [], 0

    def build(self, changes):
        layers = {l for l, _ in changes}
        assert len(layers) == 1, "one layer per build"
        layer = layers.pop()
        super().build(changes)
        new = {k: changes.get(k, p) for k, p in self.published.items() if k[0] == layer}
        self.peak_bytes = max(self.peak_bytes, self.device_bytes + sum(BYTES[p] for p in new.values()))
        self.layers_built.append(layer)

    def wait(self):
        self.done = True


def test_layer_by_layer_builds_land_in_the_same_tick_with_one_layer_of_transient():
    """The moves of one tick land in that tick (as many steps as one build of every layer: the cap 979f178
    reverted left later layers to later ticks), built one layer after another, so a build holds at most one
    layer's new version beside the published ones."""
    results = []
    for runtime in (FakeRuntime(), LayerByLayerRuntime()):
        kv = KVCacheManager(200, 16)
        mgr = DynamicPrecisionManager(runtime, kv, 10, 0.1, 0.5, "int4")
        kv.allocate("r", (200 - 58 - 5) * 16)      # free 5 < low 20: demote, across both layers
        moves = mgr.tick()
        check_invariant(kv, mgr)
        results.append((sorted(m.key for m in moves), dict(mgr.assignment), mgr.withheld, mgr._pending))
    assert results[0] == results[1] and results[1][0] and not results[1][3]
    rt = runtime
    assert sorted(set(rt.layers_built)) == sorted({k[0] for k in results[1][0]}) == [0, 1]
    one_layer = rt.num_experts * BYTES["bf16"]
    start = rt.num_layers * one_layer              # every expert started bf16 (200 blocks fit them)
    assert rt.peak_bytes <= start + one_layer
    # pressure eases: promotions in both layers, their blocks withheld before the first layer's build and
    # kept until the last one's is published
    kv.free("r")
    rt.layers_built.clear()
    moves = mgr.tick()
    assert moves and all(m.bytes_delta > 0 for m in moves) and sorted(set(rt.layers_built)) == [0, 1]
    check_invariant(kv, mgr)
