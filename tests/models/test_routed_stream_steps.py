"""Stream steps of routed fetching (experts/routed.py): forwards of at least `stream_min_tokens` tokens prefetch every
expert of each layer a layer ahead on the copy stream, with no host sync of the routed ids; the logits stay resident
placement's, bit for bit. Off CUDA the cost model settles the threshold to 0, so these tests set the pager's
attribute directly. The threshold function itself: planning/fetch_cost.py::stream_step_min_tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import greedy_logits, make_tiny_checkpoint


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=70)
    return path


@pytest.fixture(scope="module")
def refs():
    return {}   # (checkpoint, lengths) -> resident placement's logits


def _run(path, lengths, stream_min_tokens=0, **flags):
    from pagedmoe import LLM

    llm = LLM(str(path), device="cpu", max_model_len=96, **flags)
    if stream_min_tokens:
        llm.engine.pager.stream_min_tokens = stream_min_tokens
    captured, _ = greedy_logits(llm, lengths, max_tokens=6, seed=5)
    return captured, llm.engine


def _resident(refs, path, lengths):
    key = (str(path), lengths)
    if key not in refs:
        refs[key] = _run(path, lengths)[0]
    return refs[key]


@pytest.mark.parametrize("lengths", [(11,), (7, 19, 3, 30)], ids=["batch1", "mixed"])
@pytest.mark.parametrize("threshold", [1, 8], ids=["every-forward", "prefills"])
@pytest.mark.parametrize("flags", [dict(cpu_moe=True), dict(num_gpu_experts=3, expert_prefetch=True)],
                         ids=["cpu_moe", "n3-prefetch"])
def test_stream_steps_bit_identical_to_resident(ckpt, refs, lengths, threshold, flags, monkeypatch):
    from pagedmoe.experts import routed

    ref = _resident(refs, ckpt, lengths)
    syncs = []   # forwards of path (a) (and prediction) read the routed ids on the host
    ids_of = routed.routed_ids
    monkeypatch.setattr(routed, "routed_ids", lambda t: syncs.append(1) or ids_of(t))
    got, engine = _run(ckpt, lengths, threshold, expert_fetch="routed", **flags)
    assert len(ref) == len(got) > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    st, expert = engine.pager.cache.stats, engine.expert_store.expert_numel * 4
    assert st.streamed > 0
    # every fill is a miss (on demand or by a stream step) or a prediction; each moved one expert
    assert st.bytes_moved == (st.misses + st.prefetched) * expert == engine.get_stats()["expert_bytes_h2d"]
    if threshold == 1:   # every forward a stream step: no sync, no prediction, every fill a stream step's
        assert not syncs and st.prefetched == 0 and st.streamed == st.misses
    else:                # the prefill streams, the decode steps (1 to 4 tokens) fetch what is routed
        assert syncs


@pytest.mark.parametrize("threshold", [1, 8], ids=["every-forward", "prefills"])
def test_stream_steps_with_the_lossless_tiers(tmp_path, threshold):
    """Stream steps over a compressed host tier and the compressed GPU tier (bf16): each prefetched page is decoded
    from its expert's compressed arrays (copied from the host, or the GPU tier's part); the logits equal resident
    placement's, bit for bit; every fill decoded exactly one expert."""
    make_tiny_checkpoint("qwen3_moe", tmp_path, seed=71, dtype=torch.bfloat16)
    lengths = (7, 19, 3, 30)
    ref, _ = _run(tmp_path, lengths, dtype="bfloat16")
    got, engine = _run(tmp_path, lengths, threshold, dtype="bfloat16", expert_fetch="routed",
                       expert_placement="paged", num_gpu_experts=0, num_compressed_experts=3,
                       host_compression="lossless")
    assert len(ref) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(ref, got))
    st = engine.pager.cache.stats
    assert st.streamed > 0 and st.bytes_decoded == (st.misses + st.prefetched) * engine.expert_store.expert_numel * 2
    assert 0 < st.bytes_moved < st.bytes_decoded   # compressed host bytes only; the GPU tier's move none


def test_stream_step_issues_no_host_sync_and_counts_its_fills(ckpt, refs, monkeypatch):
    """Every forward a stream step, with 2 x E pages (each prefetch covers its layer), the router's ids int32: the
    routed ids never reach the host (routed_ids fails if called); the bytes moved are the fills', and the routed bytes (a device counter
    read after each step) are the distinct routed (layer, expert) pairs of every step, as the activity table counts
    them."""
    from pagedmoe.experts import routed

    lengths = (7, 19, 3, 30)
    ref = _resident(refs, ckpt, lengths)

    def no_sync(topk_ids):
        raise AssertionError("a stream step synced on the routed ids")

    monkeypatch.setattr(routed, "routed_ids", no_sync)
    fills = []
    fill_pages = routed.RoutedPager._fill_pages
    monkeypatch.setattr(routed.RoutedPager, "_fill_pages",
                        lambda self, layer, misses: fills.append(len(misses)) or fill_pages(self, layer, misses))
    from pagedmoe import LLM

    llm = LLM(str(ckpt), device="cpu", max_model_len=96, expert_fetch="routed", cpu_moe=True)
    engine = llm.engine
    engine.pager.stream_min_tokens = 1
    for moe in engine.model.moe_layers():   # as the fused router (kernels/router_topk.py) gives them on the GPU
        moe.route = lambda x, counts=None, count_rows=None, route=moe.route: (
            (lambda w, i: (w, i.to(torch.int32)))(*route(x, counts, count_rows)))
    got, _ = greedy_logits(llm, lengths, max_tokens=6, seed=5)
    assert len(ref) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(ref, got))
    pager, expert = engine.pager, engine.expert_store.expert_numel * 4
    st = pager.cache.stats
    assert pager.cache.num_slots == 2 * pager.cache.num_experts
    assert st.streamed == st.misses == sum(fills) > 0 and st.bytes_moved == sum(fills) * expert
    # the first step fills every page; later ones keep the pages of some layers
    num_moe = len(engine.model.moe_layers())
    steps = pager.stats.steps
    assert st.hits + st.misses == steps * num_moe * pager.cache.num_experts and st.hits > 0
    assert st.bytes_routed == int(engine.activity.distinct_routed) * expert > 0
    assert pager.stats.layers_loaded == steps * num_moe


def test_stream_step_falls_back_on_path_a_where_pages_run_short(tmp_path, monkeypatch):
    """A cache of E + 3 pages: a prefetch under protect (the layer before keeps its E pages) covers at most 3 experts
    of the next layer, so that layer fetches the rest of what it routes to by path (a) (one sync) before the next
    prefetch starts; the logits stay resident's."""
    from pagedmoe.experts import build, routed

    make_tiny_checkpoint("mixtral", tmp_path, seed=9, num_hidden_layers=4)
    ref, _ = _run(tmp_path, (9, 4))
    monkeypatch.setattr(build, "cache_slots", lambda n, layers, E: E + 3)
    calls = []
    ids_of = routed.routed_ids
    monkeypatch.setattr(routed, "routed_ids", lambda t: calls.append(1) or ids_of(t))
    got, engine = _run(tmp_path, (9, 4), 1, expert_fetch="routed", cpu_moe=True)
    assert len(ref) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(ref, got))
    pager = engine.pager
    st = pager.cache.stats
    assert pager.cache.num_slots == pager.cache.num_experts + 3
    assert calls and len(calls) <= pager.stats.steps * (len(engine.model.moe_layers()) - 1)  # never layer 0
    assert st.streamed == st.misses > 0
    assert st.bytes_moved == st.misses * engine.expert_store.expert_numel * 4


def test_stream_step_threshold_from_the_cost_model():
    """The smallest power of two at which path (a) models slower than a stream step: for Qwen3-30B-A3B at N=0 the
    prefill chunks (8192 tokens) and large decode batches stream, batch 1 does not; a threshold of 0 where every
    expert is resident, where path (b)'s miss area leaves fewer than 2 x E LRU pages, off CUDA and under
    stream-all."""
    from pagedmoe.planning.cost_model import H200
    from pagedmoe.planning.fetch_cost import (FetchTiers, fetch_step_s, settle_stream_steps, stream_step_min_tokens,
                                              stream_step_s)
    from pagedmoe.planning.model_shape import ModelShape

    shape = ModelShape.from_hf_config(Path(__file__).resolve().parents[2] / "benchmarks/configs/qwen3-30b-a3b")
    for n, tiers in ((0, FetchTiers()), (64, FetchTiers()), (0, FetchTiers(0, 0.683))):
        t = stream_step_min_tokens(shape, H200, n, 8192, 1024, tiers)
        assert 1 < t <= 8192 and t & (t - 1) == 0
        routed = lambda b: fetch_step_s(shape, H200, n, b, 1024, tiers)["routed"]  # noqa: E731
        assert routed(t) > stream_step_s(shape, H200, n, t, 1024, tiers)
        assert routed(t // 2) <= stream_step_s(shape, H200, n, t // 2, 1024, tiers)
        # at 8192 tokens both move every missed expert; path (a) adds its syncs and does not overlap
        assert routed(8192) > stream_step_s(shape, H200, n, 8192, 1024, tiers)
    assert stream_step_min_tokens(shape, H200, 0, 1, 1024) == 0          # batch 1 keeps path (a)
    assert stream_step_min_tokens(shape, H200, 128, 8192, 1024) == 0     # every expert resident
    # N=0: 2 x E pages; path (b)'s miss area (min(E, 16 x 8) pages) leaves only E, the computing layer's
    assert stream_step_min_tokens(shape, H200, 0, 8192, 1024, sync_free_max_seqs=16) == 0
    assert stream_step_min_tokens(shape, H200, 64, 8192, 1024, sync_free_max_seqs=16) == \
        stream_step_min_tokens(shape, H200, 64, 8192, 1024) > 0
    n0 = stream_step_min_tokens(shape, H200, 0, 8192, 1024)
    assert settle_stream_steps("routed", shape, 0, FetchTiers(), 8192, 1024, "cuda") == n0
    assert settle_stream_steps("routed", shape, 0, FetchTiers(), 8192, 1024, "cpu") == 0
    assert settle_stream_steps("stream", shape, 0, FetchTiers(), 8192, 1024, "cuda") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("tiers", [dict(cpu_moe=True, expert_fetch_path="copy"),
                                   dict(expert_placement="paged", num_gpu_experts=0, num_compressed_experts=3,
                                        host_compression="lossless", expert_fetch_path="copy"),
                                   dict(cpu_moe=True, expert_fetch_path="uva", max_num_seqs=4)],
                         ids=["host", "lossless-tiers", "uva-graphs"])
@pytest.mark.parametrize("threshold", [1, 8])
def test_stream_steps_on_cuda_match_resident(tmp_path, family, tiers, threshold):
    """On the GPU: a stream step's fills run on the copy stream a layer ahead of the GEMMs (ordered by events, never
    into the computing layer's pages); the logits equal resident placement's, bf16. With path (b) (uva) the decode
    buckets keep their CUDA graphs and only the prefills stream; its miss area leaves E LRU pages, so the prefetches
    under protect come short and those layers fall back on path (a)."""
    from pagedmoe import LLM

    make_tiny_checkpoint(family, tmp_path, seed=8, num_hidden_layers=4)
    runs = {}
    # the resident reference prefills eager, as paged engines do (no prefill CUDA graphs: their padded steps may
    # round differently)
    for name, flags in (("resident", dict(prefill_graph_tokens=0)), ("routed", dict(expert_fetch="routed", **tiers))):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=96, gpu_memory_gb=4, **flags)
        if name == "routed":
            llm.engine.pager.stream_min_tokens = threshold
        runs[name], _ = greedy_logits(llm, (11, 5, 23), max_tokens=6, seed=5)
        if name == "routed":
            st = llm.engine.pager.cache.stats
            assert st.streamed > 0 and st.bytes_routed > 0
        del llm
        torch.cuda.empty_cache()
    assert len(runs["resident"]) == len(runs["routed"]) > 0
    for a, b in zip(runs["resident"], runs["routed"]):
        assert torch.equal(a, b)
