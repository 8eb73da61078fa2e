"""Routed fetching (--expert-fetch routed): the router's experts are paged into the GPU expert cache; what the
model computes never changes, and far fewer bytes move than with stream-all."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # fetch path (b) runs its Triton gather on the interpreter: set before the kernels' import (jit decoration)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tiny_models import greedy_logits, make_tiny_checkpoint  # noqa: E402
from pagedmoe.engine.expert_stats import dtype_label  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=50 + FAMILIES.index(request.param))
    return path


@pytest.fixture(scope="module")
def resident_refs():
    return {}   # (checkpoint, lengths, dtype) -> resident placement's logits: computed once per module


def _trace(path, lengths, **flags):
    from pagedmoe import LLM

    llm = LLM(str(path), device="cpu", max_model_len=96, **flags)
    captured, _ = greedy_logits(llm, lengths, max_tokens=6, seed=5)
    return captured, llm.engine


def _resident(refs, path, lengths, dtype="auto"):
    key = (str(path), lengths, dtype)
    if key not in refs:
        refs[key] = _trace(path, lengths, dtype=dtype)[0]
    return refs[key]


@pytest.mark.parametrize("lengths", [(11,), (7, 19, 3, 30)], ids=["batch1", "mixed"])
@pytest.mark.parametrize("flags", [dict(cpu_moe=True), dict(num_gpu_experts=3, expert_prefetch=True)],
                         ids=["cpu_moe", "n3-prefetch"])
def test_routed_logits_bit_identical_to_resident(ckpt, resident_refs, lengths, flags):
    ref = _resident(resident_refs, ckpt, lengths)
    got, engine = _trace(ckpt, lengths, expert_fetch="routed", **flags)
    assert len(ref) == len(got) > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    pager = engine.pager
    st = pager.cache.stats
    assert st.hits + st.misses > 0 and st.misses > 0
    # on demand (misses) and by prediction (prefetched: layer l+1's router on layer l's input)
    assert st.bytes_moved == (st.misses + st.prefetched) * engine.expert_store.expert_numel * 4
    assert 0 <= st.prefetch_hits <= st.prefetched
    assert (st.prefetched > 0) == flags.get("expert_prefetch", False)
    # every expert's master copy is in the host tier; the cache holds pages of at most E per layer
    stats = engine.get_stats()
    num_moe = len(engine.model.moe_layers())
    # labelled with the dtype the experts are held in (fp32 here)
    assert stats["experts"].get(f"host/{dtype_label(engine.expert_store.dtype)}", 0) == 8 * num_moe
    assert stats["expert_bytes_h2d"] == st.bytes_moved
    assert stats["expert_cache_hits"] == st.hits and stats["expert_cache_misses"] == st.misses


@pytest.mark.parametrize("lengths", [(11,), (7, 19, 3, 30)], ids=["batch1", "mixed"])
def test_routed_lossless_tiers_decode_only_the_routed_misses(ckpt, resident_refs, lengths):
    """A compressed host tier (--host-compression lossless) and the compressed GPU tier (--num-compressed-experts):
    a miss moves only its expert's compressed bytes (none from the GPU tier) and decodes only that expert into its
    page; the logits equal resident placement's, bit for bit (bf16)."""
    ref = _resident(resident_refs, ckpt, lengths, "bfloat16")
    got, engine = _trace(ckpt, lengths, dtype="bfloat16", expert_fetch="routed", expert_placement="paged",
                         num_gpu_experts=0, num_compressed_experts=3, host_compression="lossless",
                         expert_prefetch=True)
    assert len(ref) == len(got) > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    num_moe = len(engine.model.moe_layers())
    stats = engine.get_stats()
    assert stats["experts"] == {"compressed/bf16": 3 * num_moe, "host/bf16": 5 * num_moe}
    st, store = engine.pager.cache.stats, engine.expert_store
    expert = store.expert_numel * 2
    fetched = st.misses + st.prefetched
    assert st.misses > 0 and st.bytes_decoded == fetched * expert   # every fill decodes exactly one expert
    # what one fill of each kind moves: its compressed arrays from the host, nothing from the GPU tier
    fill = engine.pager._fill
    per_host = [fill.moved_bytes(l, e) for l in range(num_moe) for e in range(3, 8)]
    assert all(0 < b < expert for b in per_host)
    assert all(fill.moved_bytes(l, e) == 0 for l in range(num_moe) for e in range(3))
    assert 0 < st.bytes_moved < fetched * expert
    assert stats["expert_bytes_h2d"] == st.bytes_moved and stats["expert_bytes_decoded"] == st.bytes_decoded
    # nothing raw is kept in host memory: the host tier is the compressed groups, one expert each
    assert all(store.host[l] is None and len(store.host_groups[l]) == 5 for l in range(num_moe))


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lengths", [(11,), (7, 19, 3, 30)], ids=["batch1", "mixed"])
def test_sync_free_uva_path_bit_identical_to_resident(ckpt, resident_refs, lengths):
    """Fetch path (b) (--expert-fetch-path uva, experts/routed_uva.py): forwards of up to max_num_seqs (4) tokens
    plan their misses on the device and gather them into the miss area with the Triton kernel (here on the
    interpreter), no host sync; the prefills (more tokens) take path (a) and fill the LRU pages path (b) then hits.
    The logits equal resident placement's, bit for bit."""
    ref = _resident(resident_refs, ckpt, lengths)
    got, engine = _trace(ckpt, lengths, expert_fetch="routed", expert_fetch_path="uva", cpu_moe=True,
                         max_num_seqs=4)
    assert len(ref) == len(got) > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    pager = engine.pager
    assert pager.graph_max_seqs == 4 and pager.sync_free.num_steps > 0
    st = pager.cache.stats
    assert st.misses > 0 and st.hits > 0   # the decode steps hit the pages the prefill's path (a) fetched
    assert st.bytes_moved == engine.get_stats()["expert_bytes_h2d"]
    assert st.bytes_routed == (st.hits + st.misses) * engine.expert_store.expert_numel * 4


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_sync_free_refresh_pages_in_what_keeps_missing(tmp_path):
    """4 MoE layers x 8 experts against 14 LRU pages: path (b)'s decode steps keep missing; every 8 steps the
    experts missed twice or more are paged into the cache between steps, and the logits stay resident's."""
    make_tiny_checkpoint("mixtral", tmp_path, seed=3, num_hidden_layers=4)
    from pagedmoe import LLM

    def run(**flags):
        llm = LLM(str(tmp_path), device="cpu", max_model_len=96, **flags)
        return greedy_logits(llm, (9,), max_tokens=12, seed=5)[0], llm.engine

    ref, _ = run()
    got, engine = run(expert_fetch="routed", expert_fetch_path="uva", cpu_moe=True, max_num_seqs=1)
    assert len(ref) == len(got) == 12
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    pager = engine.pager
    assert pager.sync_free.num_steps >= 8 and pager.refreshed_pages > 0   # the last steps read refreshed pages
    assert pager.cache.stats.bytes_moved == engine.get_stats()["expert_bytes_h2d"]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def ckpt4(request, tmp_path_factory):
    """A 4-layer bf16 checkpoint (its MoE layers' experts outnumber the cache's LRU pages: decode steps miss)."""
    path = tmp_path_factory.mktemp(request.param + "4")
    make_tiny_checkpoint(request.param, path, seed=60, num_hidden_layers=4, dtype=torch.bfloat16)
    return path


def _uva_matches_resident(path, refs, lengths, **flags):
    """Path (b) (max_num_seqs 4) over N=0, C=3 of 8 (bf16) and `flags`: its greedy logits equal resident placement's,
    bit for bit; (engine, pager, what path (b) collected per step)."""
    from pagedmoe import LLM

    ref = _resident(refs, path, lengths, "bfloat16")
    llm = LLM(str(path), device="cpu", max_model_len=96, dtype="bfloat16", expert_fetch="routed",
              expert_fetch_path="uva", expert_placement="paged", num_gpu_experts=0, num_compressed_experts=3,
              max_num_seqs=4, **flags)
    pager = llm.engine.pager
    collected = []
    collect = pager.sync_free.collect
    pager.sync_free.collect = lambda: collected.append(collect()) or collected[-1]
    got, _ = greedy_logits(llm, lengths, max_tokens=6, seed=5)
    assert len(ref) == len(got) > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    return llm.engine, pager, collected


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("lengths", [(11,), (7, 19, 3, 30)], ids=["batch1", "mixed"])
def test_sync_free_uva_path_with_the_compressed_gpu_tier(ckpt4, resident_refs, lengths):
    """Fetch path (b) with the compressed GPU tier (--num-compressed-experts 3 of 8): the decode steps' misses from
    that tier are decoded into their miss pages on the device (the indexed lossless decode, here on the
    interpreter), the others gathered from the raw host rows (which hold only the 5 host experts); no host sync.
    The logits equal resident placement's, bit for bit (bf16); path (b)'s misses count as moved bytes (host) or
    decoded bytes (compressed tier), never both."""
    engine, pager, collected = _uva_matches_resident(ckpt4, resident_refs, lengths)
    num_moe = len(engine.model.moe_layers())
    assert engine.get_stats()["experts"] == {"compressed/bf16": 3 * num_moe, "host/bf16": 5 * num_moe}
    assert all(engine.expert_store.host[l].shape[0] == 5 for l in range(num_moe))   # host rows: host slots only
    assert pager.graph_max_seqs == 4 and pager.sync_free.num_steps > 0
    decoded = sum(c.decoded for c in collected)
    gathered = sum(c.misses - c.decoded for c in collected)
    assert decoded > 0 and gathered > 0          # path (b) read both tiers
    st, expert = pager.cache.stats, engine.expert_store.expert_numel * 2
    # every fill (a miss of either path, or a page refreshed between steps) moved or decoded exactly one expert
    assert st.bytes_moved + st.bytes_decoded == (st.misses + pager.refreshed_pages) * expert
    assert st.bytes_decoded >= decoded * expert and st.bytes_moved >= gathered * expert
    stats = engine.get_stats()
    assert stats["expert_bytes_h2d"] == st.bytes_moved and stats["expert_bytes_decoded"] == st.bytes_decoded


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_sync_free_uva_path_decodes_a_compressed_host_tier(ckpt4, resident_refs):
    """Fetch path (b) with both lossless tiers (--num-compressed-experts 3, --host-compression lossless): the decode
    steps' host misses are decoded straight from the layer's compressed host arrays (on the GPU: mapped pinned
    memory, read over PCIe) into their miss pages, the GPU tier's decoded as before; no host sync, no raw host rows.
    The logits equal resident placement's, bit for bit (bf16), in a mixed batch; every path (b) miss is a decode,
    and the bytes it moved are the compressed bytes of the host misses (below their bf16 bytes)."""
    engine, pager, collected = _uva_matches_resident(ckpt4, resident_refs, (7, 19, 3, 30),
                                                     host_compression="lossless")
    store = engine.expert_store
    assert all(rows is None for rows in store.host) and all(m is not None for m in store.host_tier.uva)
    assert pager.graph_max_seqs == 4 and pager.sync_free.num_steps > 0
    misses = sum(c.misses for c in collected)
    decoded, moved = sum(c.decoded for c in collected), sum(c.moved for c in collected)
    # only the host misses moved bytes (their compressed parts: below the bf16 bytes of every miss)
    assert misses > 0 and decoded == misses and 0 < moved < misses * store.expert_numel * 2


def _decode_bytes(path, fetch):
    """Bytes moved and routed per decode step of one sequence (prefill excluded), and the engine."""
    from pagedmoe import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", max_model_len=96, cpu_moe=True, expert_fetch=fetch)
    eng = llm.engine
    eng.add_request("r", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.step()                    # prefill
    before = eng.get_stats()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    after = eng.get_stats()
    moved = (after["expert_bytes_h2d"] - before["expert_bytes_h2d"]) / steps
    routed = (after.get("expert_cache_bytes_routed", 0) - before.get("expert_cache_bytes_routed", 0)) / steps
    return moved, routed, eng


def test_tiny_mixtral_cpu_moe_moves_little_more_than_routed(tmp_path):
    # 6 MoE layers x 8 experts against a cache of 2 x 8 pages: most routed experts are misses
    make_tiny_checkpoint("mixtral", tmp_path, seed=3, num_hidden_layers=6)
    moved, routed, eng = _decode_bytes(tmp_path, "routed")
    expert = eng.expert_store.expert_numel * 4
    num_moe = len(eng.model.moe_layers())
    assert routed == 2 * num_moe * expert   # batch 1, top-2: two distinct experts per layer
    assert 0 < moved <= 1.5 * routed
    print(f"tiny Mixtral, --cpu-moe, batch 1: {moved:.0f} B moved per decode step for {routed:.0f} B routed")
    stream_moved, _, _ = _decode_bytes(tmp_path, "stream")
    assert stream_moved == 8 * num_moe * expert   # stream-all: every expert of every layer
    assert moved < stream_moved / 2


def test_routed_flags_that_cannot_take_effect(tmp_path):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=4)
    with pytest.raises(ValueError, match="needs paged placement"):
        LLM(str(tmp_path), device="cpu", expert_placement="resident", expert_fetch="routed")
    with pytest.raises(ValueError, match="cannot take effect with --expert-precision static-int8"):
        LLM(str(tmp_path), device="cpu", expert_fetch="routed", expert_precision="static-int8")
    with pytest.raises(ValueError, match="expert_fetch must be one of"):
        LLM(str(tmp_path), device="cpu", cpu_moe=True, expert_fetch="sometimes")
    with pytest.raises(ValueError, match="holds every expert in host memory"):
        LLM(str(tmp_path), device="cpu", num_gpu_experts=7, expert_fetch="routed", host_memory_gb=1e-4)
    with pytest.raises(ValueError, match="cannot take effect with --expert-fetch stream"):
        LLM(str(tmp_path), device="cpu", cpu_moe=True, expert_fetch="stream", expert_fetch_path="uva")
    with pytest.raises(ValueError, match="--expert-prefetch prefetches"):
        LLM(str(tmp_path), device="cpu", cpu_moe=True, expert_prefetch=True)
    # auto on CPU keeps the stream-all pipeline
    llm = LLM(str(tmp_path), device="cpu", cpu_moe=True, expert_fetch="auto")
    assert llm.engine.expert_plan.fetch == "stream"


@pytest.mark.parametrize("fetch", ["stream", "routed"])
def test_bench_latency_reports_moved_and_routed_bytes(tmp_path, capsys, fetch):
    import json

    from pagedmoe.cli import main

    make_tiny_checkpoint("mixtral", tmp_path, seed=4)
    out = tmp_path / "l.json"
    assert main(["bench", "latency", str(tmp_path), "--batch-size", "1", "--input-len", "10", "--output-len", "5",
                 "--max-model-len", "64", "--device", "cpu", "--cpu-moe", "--expert-fetch", fetch,
                 "--hbm-bandwidth", "1e12", "--output-json", str(out)]) == 0
    assert "experts moved" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    expert = 3 * 32 * 64 * 4   # tiny Mixtral: I=32, H=64, float32
    num_moe = 2
    assert r["expert_fetch"] == fetch
    assert r["routed_expert_bytes_per_step"] == 2 * num_moe * expert   # batch 1, top-2
    assert r["expert_bytes_decoded_per_step"] == 0   # no lossless tier
    if fetch == "stream":
        assert r["expert_bytes_moved_per_step"] == 8 * num_moe * expert
        assert "expert_cache_hits_per_step" not in r
    else:
        # the cache (2 x 8 pages) holds this 2-layer model whole once the prefill routed to every expert
        assert 0 <= r["expert_bytes_moved_per_step"] <= 1.5 * r["routed_expert_bytes_per_step"]
        # every routed (layer, expert) of a decode step is a hit or a miss; a miss moves one expert's bytes
        hits, misses = r["expert_cache_hits_per_step"], r["expert_cache_misses_per_step"]
        assert hits + misses == pytest.approx(2 * num_moe)
        assert r["expert_bytes_moved_per_step"] == pytest.approx(misses * expert)


def test_default_model_routed_hit_rate_and_bytes_per_token(capsys):
    """The default model's real (skewed) routing: the cache hits and routed fetching moves a fraction of what
    stream-all moves (benchmarks/routed_cpu.py prints the full table; docs/benchmarks.md has it)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from routed_cpu import measure

    stream = measure("stream", 0, 1, 12)
    routed = measure("routed", 0, 1, 12, predict=True)
    assert stream["moved_bytes_per_step"] == 6 * 32 * stream["expert_bytes"]   # every expert, every step
    assert routed["hits"] > 0 and routed["moved_bytes_per_step"] <= routed["routed_bytes_per_step"]
    assert routed["moved_bytes_per_token"] < stream["moved_bytes_per_token"] / 4
    assert 0 < routed["prediction_recall"] <= 1
    with capsys.disabled():
        print(f"\ndefault model, --cpu-moe, batch 1: hit rate {routed['hit_rate']:.3f}, "
              f"{routed['moved_bytes_per_token'] / 1e6:.3f} MB/token routed vs "
              f"{stream['moved_bytes_per_token'] / 1e6:.3f} MB/token stream-all; prediction recall "
              f"{routed['prediction_recall']:.3f}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)   # issue 21: every family, on the GPU too
@pytest.mark.parametrize("tiers", [dict(cpu_moe=True, expert_fetch_path="copy"),
                                   dict(expert_placement="paged", num_gpu_experts=0, num_compressed_experts=3,
                                        host_compression="lossless", expert_prefetch=True, max_num_seqs=4),
                                   dict(cpu_moe=True, expert_fetch_path="uva", max_num_seqs=4),
                                   dict(expert_placement="paged", num_gpu_experts=0, num_compressed_experts=3,
                                        expert_fetch_path="uva", max_num_seqs=4),
                                   dict(expert_placement="paged", num_gpu_experts=0, num_compressed_experts=3,
                                        host_compression="lossless", expert_fetch_path="uva", max_num_seqs=4)],
                         ids=["host", "lossless-tiers", "uva-graphs", "uva-compressed-graphs", "uva-lossless-tiers-graphs"])
def test_routed_on_cuda_matches_resident(tmp_path, family, tiers):
    """On the GPU: pinned host rows copied (or compressed ones copied and decoded, or GPU-compressed ones decoded)
    on the compute stream, the slot map written, eager steps (the runner turns CUDA graphs off for the per-layer
    sync); or, uva, the decode steps gather their misses from mapped pinned memory inside CUDA graphs (the
    prefills take path (a)), and with the compressed GPU tier decode that tier's misses there too (the indexed
    lossless decode), and with the host tier compressed decode its misses straight from mapped host memory;
    logits equal resident placement's, bf16."""
    from pagedmoe import LLM

    make_tiny_checkpoint(family, tmp_path, seed=8, num_hidden_layers=4)
    runs = {}
    # the resident reference prefills eager, as paged engines do (no prefill CUDA graphs: their padded steps may
    # round differently)
    for name, flags in (("resident", dict(prefill_graph_tokens=0)), ("routed", dict(expert_fetch="routed", **tiers))):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=96, gpu_memory_gb=4, **flags)
        collected = []   # what path (b) counted per step (graph replays included)
        if name == "routed" and llm.engine.pager.sync_free is not None:
            sf = llm.engine.pager.sync_free
            sf.collect = lambda collect=sf.collect: collected.append(collect()) or collected[-1]
        runs[name], _ = greedy_logits(llm, (11, 5, 23), max_tokens=6, seed=5)
        if name == "routed":
            # auto (lossless-tiers, with prefetch for the prefills): the cost model gives the decode buckets path (b)
            # when they run in CUDA graphs; MLA (deepseek) runs eager steps, where auto keeps path (a) and an
            # explicit uva still takes path (b)
            mla = llm.engine.model.dims.mla is not None
            uva = tiers.get("expert_fetch_path", "auto") == "uva" or (not mla and "expert_fetch_path" not in tiers)
            assert (llm.engine.expert_plan.sync_free_max_seqs > 0) == uva
            assert (llm.engine.runner.graphs is not None) == (uva and not mla)
            assert llm.engine.pager.cache.stats.misses > 0
            if uva and not mla:
                assert llm.engine.runner.graphs.buckets[:3] == [1, 2, 4]
            if uva:
                assert llm.engine.pager.sync_free.num_steps > 0 and llm.engine.pager.cache.stats.hits > 0
            if uva and tiers.get("host_compression"):   # path (b) decoded every miss, the host's read over PCIe
                assert sum(c.decoded for c in collected) == sum(c.misses for c in collected) > 0
                assert sum(c.moved for c in collected) > 0
            elif uva and tiers.get("num_compressed_experts"):   # path (b) decoded some misses, gathered others
                assert sum(c.decoded for c in collected) > 0 and sum(c.misses - c.decoded for c in collected) > 0
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(runs["resident"], runs["routed"]):
        assert torch.equal(a, b)


def test_auto_placement_for_routed_fetching_takes_the_compressed_tier(tmp_path, monkeypatch):
    """--expert-placement auto with --expert-fetch routed at a budget below resident's: the planner weighs placements
    for routed fetching (planning/routed_plan.py) and keeps experts in the compressed GPU tier (a routed miss from
    it is decoded, not copied); the logits equal resident placement's, bit for bit. --expert-compression none
    leaves only bf16 resident counts to vary, and --expert-fetch stream the stream-all search as before."""
    from pagedmoe import LLM
    from pagedmoe.planning import fetch_cost

    # the tiny model's 12 KB experts make a fill's fixed host cost (fitted on the H200 for 9 MB experts) the whole
    # of a miss's cost, which favours cache pages over compressed experts; bytes alone decide here
    monkeypatch.setattr(fetch_cost, "ROUTED_MISS_HOST_S", 0.0)
    make_tiny_checkpoint("mixtral", tmp_path, seed=2, dtype=torch.bfloat16, num_hidden_layers=4)
    common = dict(dtype="bfloat16", max_num_seqs=2)
    probe = LLM(str(tmp_path), device="cpu", max_model_len=96, **common).engine.plan
    expert = 3 * 32 * 64 * 2   # tiny Mixtral: I=32, H=64, bf16
    # two experts short of resident, with the KV of two max_model_len sequences
    budget = (probe.weight_bytes - 2 * expert + probe.activation_bytes + 12 * probe.kv_bytes_per_block) / 1024 ** 3
    ref = _trace(tmp_path, (11,), **common)[0]
    got, engine = _trace(tmp_path, (11,), gpu_memory_gb=budget, expert_fetch="routed", **common)
    plan = engine.expert_plan
    assert plan.paged and plan.fetch == "routed" and sum(plan.num_compressed or ()) > 0
    assert engine.expert_store.compressed_bytes > 0 and engine.pager.cache.stats.misses > 0
    assert len(ref) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(ref, got))
    plain = LLM(str(tmp_path), device="cpu", max_model_len=96, gpu_memory_gb=budget, expert_fetch="routed",
                expert_compression="none", **common).engine.expert_plan
    assert plain.paged and not any(plain.num_compressed or ()) and plain.host_compression == "none"
    stream = LLM(str(tmp_path), device="cpu", max_model_len=96, gpu_memory_gb=budget, expert_fetch="stream",
                 **common).engine.expert_plan
    assert stream.fetch == "stream" and not any(stream.num_compressed or ()) and stream.host_compression == "none"
