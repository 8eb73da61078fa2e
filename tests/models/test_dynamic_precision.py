"""--expert-precision dynamic end to end on CPU (issue 7): exact experts stay bit-identical to resident
placement; under KV pressure the controller demotes experts and their bytes become KV blocks (no
preemption where a static exact plan of the same budget preempts), and promotes them back when pressure
eases; a forward never sees a half-built version; --expert-stats round trip."""
from __future__ import annotations

import json

import pytest
import torch

from tiny_models import make_tiny_checkpoint

COMMON = dict(device="cpu", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=16)
# A budget (GiB, CPU-simulated) where the static exact plan holds 103 KV blocks and the burst below
# needs about 120: static preempts, dynamic lends the experts' bytes above int4 (41 blocks) to KV.
BUDGET_GB = 0.0040


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_dynamic")
    make_tiny_checkpoint("mixtral", path, seed=7, num_hidden_layers=4)
    return path


def _llm(path, **flags):
    from pagedmoe import LLM

    return LLM(str(path), **{**COMMON, **flags})


def _burst(llm):
    from pagedmoe import SamplingParams

    prompts = [[(7 * i + j) % 100 + 3 for j in range(150)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=90, ignore_eos=True, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 90 for o in outs)
    return llm.engine.get_stats()


def test_exact_dynamic_is_bit_identical_to_resident(ckpt):
    ids = list(range(3, 90))
    ref = _llm(ckpt, expert_placement="resident").engine.score(ids)
    dyn = _llm(ckpt, expert_precision="dynamic")
    e = dyn.engine
    assert e.get_stats()["precision_counts"]["bf16"] == 4 * 8      # no pressure: all exact
    assert torch.equal(e.score(ids), ref)


def test_burst_preempts_under_static_exact_not_under_dynamic(ckpt):
    static = _burst(_llm(ckpt, gpu_memory_gb=BUDGET_GB, expert_placement="paged", num_gpu_experts=8))
    llm = _llm(ckpt, gpu_memory_gb=BUDGET_GB, expert_precision="dynamic")
    kv = llm.engine.kv
    start_withheld = llm.engine.precision.withheld
    assert start_withheld > 0 and kv.num_blocks > static["num_kv_blocks"]
    dyn = _burst(llm)
    assert static["num_preemptions_total"] > 0
    assert dyn["num_preemptions_total"] == 0
    # the controller demoted under pressure and promoted back as requests finished
    assert dyn["precision_demotions"] > 0 and dyn["precision_promotions"] > 0
    mgr = llm.engine.precision
    # lending invariant: withheld blocks cover the experts' bytes above the floor
    assert mgr.withheld * mgr.block_bytes >= mgr.surplus_bytes(mgr.assignment)
    assert kv.pool.num_withheld_blocks == mgr.withheld
    # idle: keep ticking until every expert is exact again (pressure eased)
    for _ in range(20):
        mgr.tick()
    assert set(mgr.assignment.values()) == {"bf16"} and mgr.withheld == start_withheld
    # the table and the published versions agree with the controller's map
    table = llm.engine.expert_store.table
    assert table.precision_map() == mgr.precision_map()
    # each entry also holds its activity and the step it was last routed to (the activity table's view)
    ema, last = llm.engine.activity.host_view()
    entries = [table._entries[l][e] for l in range(table.num_layers) for e in range(table.num_experts)]
    assert [x.last_access for x in entries] == [t for row in last for t in row]
    assert max(x.last_access for x in entries) >= 0 and all(x.activity >= 0 for x in entries)


def test_forward_never_sees_a_half_built_version(ckpt):
    """A build is invisible until publish(): a forward between build and publish gives the old logits;
    after publish, the table, the versions and the logits all change together."""
    llm = _llm(ckpt, expert_precision="dynamic")
    e = llm.engine
    rt, ids = e.expert_store.dynamic, list(range(5, 70))
    before = e.score(ids)
    rt.build({(l, x): "int4" for l in range(4) for x in range(8)})
    assert rt._staged and e.expert_store.table.precision_map()[0][0] == "bf16"
    assert torch.equal(e.score(ids), before)            # still the published (exact) version
    measured = rt.publish()
    assert e.expert_store.table.precision_map()[0] == ["int4"] * 8
    assert set(measured[(0, 0)]) == {"int4"} and 0 < measured[(0, 0)]["int4"] < 0.5
    after = e.score(ids)
    assert not torch.equal(after, before)
    # the published int4 logits are what fake-quantised exact weights give
    from pagedmoe.codecs.quant import fake_quantize
    from pagedmoe.experts.layout import row_part

    ref = _llm(ckpt, expert_placement="resident")
    store = ref.engine.expert_store
    for layer in range(4):
        for x in range(8):
            for kind in ("w13", "w2"):
                w = row_part(store.row(layer, x), store.hidden, store.inter, kind)
                w.copy_(fake_quantize(w.clone(), "int4"))
    assert torch.equal(ref.engine.score(ids), after)
    with pytest.raises(RuntimeError, match="still waiting"):
        rt.build({(0, 0): "int8"})
        rt.build({(0, 1): "int8"})


def test_expert_stats_round_trip(ckpt, tmp_path):
    path = tmp_path / "stats.json"
    llm = _llm(ckpt, expert_precision="dynamic", expert_stats=str(path))
    llm.generate([[3, 4, 5, 6, 7]], __import__("pagedmoe").SamplingParams(max_tokens=4))
    e = llm.engine
    mgr = e.precision
    mgr.demote_to(mgr.policy.total_bytes(mgr.assignment) // 2)
    saved_map, total = mgr.precision_map(), e.activity.total.clone()
    assert total.sum() > 0
    e._stats_saver()                                    # what happens at exit
    data = json.loads(path.read_text())
    assert data["precision_map"] == saved_map and len(data["rel_error"]) == 32
    again = _llm(ckpt, expert_precision="dynamic", expert_stats=str(path)).engine
    assert torch.equal(again.activity.total, total)
    assert again.precision.precision_map() == saved_map   # fits the budget: the starting point
    with pytest.raises(ValueError, match="do not fit"):
        path.write_text(json.dumps({"total": [[0.0]], "ema": [[0.0]], "decay": 0.9}))
        _llm(ckpt, expert_precision="dynamic", expert_stats=str(path))
    path.write_text("not json")
    with pytest.raises(ValueError, match="not an expert stats file"):
        _llm(ckpt, expert_precision="dynamic", expert_stats=str(path))


def test_dynamic_flags_fail_loudly():
    from pagedmoe.config import EngineConfig

    for kw, msg in ((dict(min_expert_precision="int8"), "only takes effect"),
                    (dict(kv_low_watermark=0.1), "only takes effect"),
                    (dict(expert_precision="dynamic", kv_low_watermark=0.3, kv_high_watermark=0.2), "watermarks"),
                    (dict(expert_precision="dynamic", kv_high_watermark=1.5), "watermarks"),
                    (dict(expert_precision="dynamic", min_expert_precision="int2"), "min_expert_precision"),
                    (dict(expert_precision="dynamic", cpu_moe=True), "contradicts --cpu-moe"),
                    (dict(expert_precision="dynamic", expert_buffers="vmm"), "contradicts --expert-buffers"),
                    (dict(expert_precision="dynamic", expert_placement="resident"), "contradicts")):
        with pytest.raises(ValueError, match=msg):
            EngineConfig(**kw)
    c = EngineConfig(expert_precision="dynamic", min_expert_precision="int8", kv_low_watermark=0.1,
                     kv_high_watermark=1.0)
    assert c.watermarks() == (0.1, 1.0) and c.placement() == ("paged", 0)


def test_a_kv_pool_with_nothing_to_lend_is_refused(ckpt):
    """--num-kv-blocks 16 is one max_model_len=256 sequence: no block is left to lend, no expert could ever leave the
    floor. Refused in one line; one block more (16 KiB, more than int4 -> int8 of one expert) starts."""
    with pytest.raises(ValueError, match=r"^--expert-precision dynamic cannot take effect with --num-kv-blocks 16: "
                                         r".* give --num-kv-blocks 17 or more, or use --expert-precision static-int4$"):
        _llm(ckpt, expert_precision="dynamic", num_kv_blocks=16)
    assert _llm(ckpt, expert_precision="dynamic", num_kv_blocks=17).engine.precision.withheld == 1


@pytest.mark.gpu
def test_gpu_dynamic_exact_and_side_stream_publish(ckpt):
    """On CUDA: exact dynamic equals resident (bf16, eager), and a build on the side stream is invisible
    to forwards until it is published after its event."""
    flags = dict(device="cuda", dtype="bfloat16", enforce_eager=True)
    ids = list(range(3, 90))
    ref = _llm(ckpt, expert_placement="resident", **flags).engine.score(ids)
    e = _llm(ckpt, expert_precision="dynamic", num_kv_blocks=4096, **flags).engine
    assert set(e.precision.assignment.values()) == {"bf16"}
    assert torch.equal(e.score(ids), ref)
    rt = e.expert_store.dynamic
    rt.build({(l, x): "int4" for l in range(4) for x in range(8)})
    assert torch.equal(e.score(ids), ref)        # not published yet, whatever the side stream did
    while not rt.ready():
        pass
    rt.publish()
    assert not torch.equal(e.score(ids), ref)


# -- the lossless rung (bf16 weights) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_dynamic_bf16")
    make_tiny_checkpoint("mixtral", path, seed=8, num_hidden_layers=4, dtype=torch.bfloat16)
    return path


def test_lossless_rung_is_exact_and_demoted_to_first(bf16_ckpt, tmp_path):
    """bf16 -> lossless is the first rung down (exact: logits stay bit-identical to resident placement); the
    controller counts a lossless expert at the sampled compressed size, and the version holds the experts in
    one CompressedTensor per run of consecutive ids."""
    ids = list(range(3, 90))
    ref = _llm(bf16_ckpt, dtype="bfloat16", expert_placement="resident").engine.score(ids)
    pmap = [["bf16", "lossless", "lossless", "bf16", "lossless", "lossless", "lossless", "bf16"],
            ["lossless"] * 8, ["bf16"] * 8, ["lossless"] + ["bf16"] * 7]
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"total": [[0.0] * 8] * 4, "ema": [[0.0] * 8] * 4, "decay": 0.99,
                                 "precision_map": pmap}))
    llm = _llm(bf16_ckpt, dtype="bfloat16", expert_precision="dynamic", expert_stats=str(stats),
               kv_low_watermark=0.0, kv_high_watermark=1.0)
    e = llm.engine
    rt, mgr = e.expert_store.dynamic, e.precision
    assert mgr.precision_map() == pmap and e.expert_store.table.precision_map() == [
        [p if p == "bf16" else "bf16" for p in row] for row in pmap]     # compressed tier, exact: bf16
    assert e.expert_store.table.count(1, "compressed") == 8
    assert [(e0, ct.num_parts) for e0, ct in rt.versions[0].lossless] == [(1, 2), (4, 3)]
    assert torch.equal(e.score(ids), ref)
    bpr = rt.bytes_per_rung()
    actual = max(ct.nbytes / ct.num_parts for v in rt.versions for _, ct in v.lossless)
    assert actual <= bpr["lossless"] < 0.8 * bpr["bf16"]
    # under pressure the first moves are exact ones: bf16 -> lossless before anything is quantised
    fresh = _llm(bf16_ckpt, dtype="bfloat16", expert_precision="dynamic").engine.precision
    assert set(fresh.assignment.values()) == {"bf16"}
    fresh.demote_to(fresh.policy.total_bytes(fresh.assignment) - 3 * (bpr["bf16"] - bpr["lossless"]))
    counts = fresh.precision_counts()
    assert counts["lossless"] >= 3 and counts["fp8"] + counts["int8"] + counts["int4"] == 0


def test_lossless_rung_not_offered_where_it_cannot_run(ckpt, bf16_ckpt):
    # float32 weights: the codec holds bf16 only
    assert "lossless" not in _llm(ckpt, expert_precision="dynamic").engine.expert_store.dynamic.bytes_per_rung()
    rt = _llm(bf16_ckpt, dtype="bfloat16", expert_precision="dynamic").engine.expert_store.dynamic
    assert "lossless" in rt.bytes_per_rung()
    rt.lossless = False      # as under --quantized-gemm direct: the GEMMs read the version's parts, no fill
    with pytest.raises(ValueError, match="lossless rung needs"):
        rt.build({(0, 0): "lossless"})


@pytest.mark.gpu
def test_gpu_lossless_rung_is_exact(bf16_ckpt):
    """On CUDA: experts published at the lossless rung (encoded on the side stream, decoded by the Triton
    decoder into the double buffer) give the resident logits bit for bit."""
    flags = dict(device="cuda", dtype="bfloat16", enforce_eager=True)
    ids = list(range(3, 90))
    ref = _llm(bf16_ckpt, expert_placement="resident", **flags).engine.score(ids)
    e = _llm(bf16_ckpt, expert_precision="dynamic", num_kv_blocks=4096, **flags).engine
    rt = e.expert_store.dynamic
    rt.build({(l, x): "lossless" for l in range(4) for x in range(8) if (l + x) % 3})
    while not rt.ready():
        pass
    rt.publish()
    assert sum(ct.num_parts for v in rt.versions for _, ct in v.lossless) == sum(
        1 for l in range(4) for x in range(8) if (l + x) % 3)
    assert torch.equal(e.score(ids), ref)
