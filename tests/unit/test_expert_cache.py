"""The GPU expert cache (experts/cache.py): pages, LRU eviction over layers, slot maps, the page table; the
fetch cost model (planning/fetch_cost.py); the cache's metrics."""
from __future__ import annotations

import pytest
import torch

from pagedmoe.experts.cache import ExpertCache
from pagedmoe.experts.table import ExpertTable


def _cache(num_layers=3, num_experts=4, slots=6):
    table = ExpertTable(num_layers, num_experts)
    table.place([()] * num_layers)
    return ExpertCache(table, slots, 8, torch.float32, torch.device("cpu")), table


def test_misses_get_free_slots_then_hit():
    cache, table = _cache()
    hits, misses = cache.lookup(0, [1, 3])
    assert hits == [] and [e for e, _ in misses] == [1, 3]
    slots = {e: s for e, s in misses}
    assert len(set(slots.values())) == 2
    cache.publish(0)
    assert cache.slot_maps[0].tolist() == [-1, slots[1], -1, slots[3]]
    assert table.lookup(0, 1).cache_slot == slots[1] and table.lookup(0, 0).cache_slot == -1
    hits, misses = cache.lookup(0, [3, 1])
    assert sorted(hits) == [1, 3] and misses == []


def test_lru_evicts_the_least_recent_page_of_any_layer():
    cache, table = _cache(slots=4)
    for layer, ids in ((0, [0, 1]), (1, [0, 1]), (0, [1])):   # one step each: the cache fills at the second
        cache.begin_step()
        cache.lookup(layer, ids)  # (0, 1) used again last: (0, 0) is now the least recent page
    cache.begin_step()
    _, misses = cache.lookup(2, [2])
    assert len(misses) == 1
    assert cache.host_maps[0][0] == -1 and table.lookup(0, 0).cache_slot == -1   # evicted
    assert cache.host_maps[0][1] >= 0 and cache.host_maps[1][0] >= 0
    assert table.lookup(2, 2).last_access == cache.tick
    # a layer routing to all its experts evicts older pages, never its own routed ones
    cache.begin_step()
    _, misses = cache.lookup(1, [0, 1, 2, 3])
    assert sorted(cache.cached(1)) == [0, 1, 2, 3]
    assert len({s for s in cache.host_maps[1]}) == 4


def test_publish_unmaps_a_victim_in_its_own_layer_and_the_miss_area_is_no_lru_page():
    """Fetch path (b) trusts every device slot-map entry (a cached expert keeps its page), so publishing a fetch
    also writes the slot map of the layer that lost a page; the miss area's pages are never handed out."""
    table = ExpertTable(2, 2)
    table.place([()] * 2)
    cache = ExpertCache(table, 4, 8, torch.float32, torch.device("cpu"), miss_rows=1)
    assert cache.miss_base == 3
    cache.begin_step()
    cache.lookup(0, [0, 1])
    cache.publish(0)
    cache.begin_step()
    _, misses = cache.lookup(1, [0, 1])   # 3 LRU pages: layer 0's least recent page goes
    cache.publish(1)
    assert all(slot < 3 for _, slot in misses)
    assert cache.slot_maps[0].tolist() == cache.host_maps[0] and cache.host_maps[0].count(-1) == 1
    assert cache.slot_maps[1].tolist() == cache.host_maps[1]


def test_cache_must_hold_one_layer():
    with pytest.raises(ValueError, match="cannot hold one layer"):
        _cache(num_experts=4, slots=3)


def test_fetch_cost_prefers_routed_at_small_batch_on_qwen3_shape():
    from pagedmoe.planning.cost_model import HardwareProfile
    from pagedmoe.planning.fetch_cost import choose_fetch, fetch_step_s, fetch_table
    from pagedmoe.planning.model_shape import ModelShape

    shape = ModelShape(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                       head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=768,
                       dense_intermediate_size=0, num_moe_layers=48)
    hw = HardwareProfile()
    b1 = fetch_step_s(shape, hw, 26, 1, 512)
    assert b1["resident"] is None and b1["routed"] < b1["stream"]
    # at batch 256 nearly every expert is routed: streaming behind compute wins
    b256 = fetch_step_s(shape, hw, 26, 256, 512)
    assert choose_fetch(b256) == "stream"
    rows = fetch_table(shape, hw, 26, 512)
    assert [r["batch"] for r in rows] == [1, 8, 32] and rows[0]["choice"] == "routed"
    assert choose_fetch(fetch_step_s(shape, hw, 128, 1, 512)) == "resident"


def _qwen3_shape():
    from pagedmoe.planning.model_shape import ModelShape

    return ModelShape(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                      head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=768,
                      dense_intermediate_size=0, num_moe_layers=48)


def test_fetch_cost_per_bucket_path_and_lossless_tiers():
    from pagedmoe.planning.cost_model import HardwareProfile
    from pagedmoe.planning.fetch_cost import (FetchTiers, fetch_step_s, graph_fetch_max_seqs, routed_path,
                                              settle_fetch_path)
    from pagedmoe.planning.kv_sizing import decode_buckets

    shape, hw = _qwen3_shape(), HardwareProfile()
    raw = fetch_step_s(shape, hw, 25, 8, 512)
    # a compressed host tier moves 0.683 of the bytes (and decodes them), by either path: path (b)'s decoder reads
    # it from mapped host memory at UVA_DECODE_PCIE_SHARE of the gather's rate (or the decoder's, if slower)
    import pagedmoe.planning.fetch_cost as fc

    comp = fetch_step_s(shape, hw, 25, 8, 512, FetchTiers(host_ratio=0.683))
    assert comp["routed"] < raw["routed"] and comp["routed_uva"] < raw["routed_uva"] and comp["stream"] < raw["stream"]
    raw_read = raw["routed_uva"] - fetch_step_s(shape, hw, 128, 8, 512)["resident"] - 48 * fc.ROUTED_UVA_LAYER_S
    assert comp["routed_uva"] - raw["routed_uva"] == pytest.approx(raw_read * (0.683 / fc.UVA_DECODE_PCIE_SHARE - 1))
    # the compressed GPU tier's misses cross no PCIe at all, by either path (path (b) decodes them on the device)
    gpu = fetch_step_s(shape, hw, 25, 8, 512, FetchTiers(num_compressed=64))
    assert gpu["routed"] < raw["routed"] and gpu["routed_uva"] < raw["routed_uva"]
    # path (b) pays the decode of the compressed misses: 64 of 128 experts compressed, half the misses decoded
    base = fetch_step_s(shape, hw, 128, 8, 512)["resident"]
    routed_misses = 48 * shape.routed_experts(8) * (1 - min(1.0, (48 * 25 + 2 * 103) / (48 * 128)))
    decode_s = routed_misses * 64 / 128 * shape.expert_bytes / hw.lossless_decode_bytes_per_s
    gather_s = routed_misses * 64 / 128 * shape.expert_bytes / (fc.UVA_PCIE_SHARE * hw.pcie_h2d_bytes_per_s)
    assert gpu["routed_uva"] - base == pytest.approx(decode_s + gather_s + 48 * fc.ROUTED_UVA_LAYER_S, rel=1e-6)
    # uva: no sync and no eager host work, and its reads ran at 0.98 of the copy engine's rate on the H200: it wins
    # at every bucket on raw host rows; with the estimates used before the fit (60 us per layer, nothing per miss,
    # reads at 0.86 of the copy engine's rate) copy wins where many bytes move, and only small buckets take uva
    assert all(routed_path(fetch_step_s(shape, hw, 25, b, 512)) == "uva" for b in (1, 8, 32, 64))
    # ... but from 64 sequences a stream step (every missed expert copied a layer ahead, overlapped) models faster
    # than path (b)'s unoverlapped reads, and those buckets leave path (b) (N=0: too few pages for stream steps)
    from pagedmoe.planning.fetch_cost import stream_step_s

    assert stream_step_s(shape, hw, 25, 64, 512) < fetch_step_s(shape, hw, 25, 64, 512)["routed_uva"]
    assert stream_step_s(shape, hw, 25, 48, 512) > fetch_step_s(shape, hw, 25, 48, 512)["routed_uva"]
    assert graph_fetch_max_seqs(shape, hw, 25, 64, 512) == 48
    assert graph_fetch_max_seqs(shape, hw, 0, 64, 512) == 64
    saved = fc.ROUTED_LAYER_SYNC_S, fc.ROUTED_MISS_HOST_S, fc.UVA_PCIE_SHARE
    fc.ROUTED_LAYER_SYNC_S, fc.ROUTED_MISS_HOST_S, fc.UVA_PCIE_SHARE = 60e-6, 0.0, 0.86
    try:
        assert routed_path(fetch_step_s(shape, hw, 25, 32, 512)) == "copy"
        top = graph_fetch_max_seqs(shape, hw, 25, 64, 512)
        assert top in decode_buckets(64) and 1 <= top < 32
        assert all(routed_path(fetch_step_s(shape, hw, 25, b, 512)) == "uva" for b in decode_buckets(top))
    finally:
        fc.ROUTED_LAYER_SYNC_S, fc.ROUTED_MISS_HOST_S, fc.UVA_PCIE_SHARE = saved
    settle = lambda req, fetch="routed", dev="cuda", graphs=True, tiers=FetchTiers(), interp=False: \
        settle_fetch_path(req, fetch, shape, 25, tiers, 64, 512, dev, graphs, interp)  # noqa: E731
    assert settle("auto") == 48 and settle("copy") == 0 and settle("uva") == 64
    assert settle("auto", graphs=False) == 0 and settle("auto", dev="cpu") == 0
    assert settle("auto", tiers=FetchTiers(host_ratio=0.683)) == graph_fetch_max_seqs(
        shape, hw, 25, 64, 512, FetchTiers(host_ratio=0.683)) > 0 and settle("auto", fetch="stream") == 0
    assert settle("uva", dev="cpu", interp=True) == 64
    with pytest.raises(ValueError, match="needs a CUDA device"):
        settle("uva", dev="cpu")
    with pytest.raises(ValueError, match="cannot take effect with --expert-fetch stream"):
        settle("copy", fetch="stream")
    # both lossless tiers go with path (b) (decoded on the device)
    assert settle("uva", tiers=FetchTiers(num_compressed=3)) == 64
    assert settle("auto", tiers=FetchTiers(num_compressed=64)) >= top
    assert settle("uva", tiers=FetchTiers(num_compressed=3, host_ratio=0.683)) == 64


def test_cache_counters_are_exported():
    from pagedmoe.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.attach_engine(lambda: {"expert_cache_hits": 7, "expert_cache_misses": 3}, {("resident", "bf16"): 8})
    text = metrics.render().decode()
    assert 'pagedmoe:expert_cache_hits_total{model_name="m"} 7.0' in text
    assert 'pagedmoe:expert_cache_misses_total{model_name="m"} 3.0' in text


def test_plan_prints_the_fetch_table(capsys, tmp_path):
    import json
    from pathlib import Path

    from pagedmoe.cli import main

    cfg = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-30b-a3b"
    out = tmp_path / "p.json"
    assert main(["plan", str(cfg), "--gpu-memory-gb", "24", "60", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "expert fetch for" in text and "routed" in text
    fetch = json.loads(out.read_text())["budgets"][0]["fetch"]
    assert [r["batch"] for r in fetch["batches"]] == [1, 8, 32]
    b1 = fetch["batches"][0]
    assert b1["choice"] == "routed" and b1["routed_s"] < b1["stream_s"]
    # both routed paths per bucket, and the one the bucket gets
    assert all(r["routed_path"] in ("copy", "uva") and r["routed_uva_s"] > 0 for r in fetch["batches"])
    assert "(uva)" in text and "(copy)" in text
    # routed fetching's stream steps: at 24 GiB (N=0) the cache's 256 pages less path (b)'s miss area (128) leave
    # no room to prefetch a layer beside the one computing; at 60 GiB the threshold the engine settles
    assert fetch["stream_min_tokens"] == 0 and "stream steps: none" in text
    t = json.loads(out.read_text())["budgets"][1]["fetch"]["stream_min_tokens"]
    assert 1 < t <= 8192 and t & (t - 1) == 0 and f"forwards of {t}+ tokens" in text


def test_a_step_larger_than_the_cache_evicts_the_newest_page_of_another_layer():
    """Layers cycle; LRU would evict what the next step needs first (0 hits when a step routes to more pages
    than the cache holds); the newest page of another layer is evicted instead, so some pages survive."""
    cache, _ = _cache(num_layers=3, num_experts=4, slots=6)
    hits = 0
    for _ in range(5):
        cache.begin_step()
        for layer in range(3):
            h, _ = cache.lookup(layer, [0, 1, 2])   # 9 pages per step, 6 slots
            hits += len(h)
    assert hits >= 4 * 3   # at least three pages hit in each step after the first (LRU: none)


def test_routed_ids_dedup_on_host_or_device_alike():
    from pagedmoe.experts import routed

    g = torch.Generator().manual_seed(3)
    for rows in (1, 8, routed.HOST_UNIQUE_MAX_IDS // 8 + 1):   # the host path, and the device path past the limit
        ids = torch.randint(0, 128, (rows, 8), generator=g)
        assert routed.routed_ids(ids) == torch.unique(ids).tolist()


def test_a_prefetch_takes_only_the_pages_it_may_evict():
    """A prefetch for layer l+1 (protect=l) never evicts layer l's pages (its GEMMs may still be pending): where the
    pages left are too few (a pool of fewer than 2 x E pages outside the miss area) it gets what there is and the
    rest are fetched on demand, by a lookup without protection, which may take the protected layer's pages."""
    from pagedmoe.experts.cache import ExpertCache
    from pagedmoe.experts.table import ExpertTable

    table = ExpertTable(3, 4)
    table.place([()] * 3)
    cache = ExpertCache(table, 6, 8, torch.float32, torch.device("cpu"))
    cache.begin_step()
    assert len(cache.lookup(0, [0, 1, 2, 3])[1]) == 4
    _, got = cache.lookup(1, [0, 1, 2, 3], protect=0)
    assert [e for e, _ in got] == [0, 1] and cache.cached(0) == [0, 1, 2, 3]   # two free pages, layer 0 untouched
    hits, misses = cache.lookup(1, [0, 1, 2, 3])       # on demand: layer 0's pages may go now
    assert hits == [0, 1] and [e for e, _ in misses] == [2, 3] and len(cache.cached(0)) == 2
