"""DynamicPrecisionManager and the block pool's lending, on fake capacities (no torch).

The invariant under test: at every instant, KV blocks in circulation + blocks' worth of expert bytes
above the floor <= the KV cache's blocks. A demotion's blocks are released only after its version is
published; a promotion's blocks are withheld before its version is built."""
from __future__ import annotations

import pytest

from pagedmoe.experts.controller import DynamicPrecisionManager, Watermarks
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
