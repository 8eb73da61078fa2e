"""Expert paging changes where expert bytes live, never what the model computes."""
from __future__ import annotations

import pytest
import torch

from tiny_models import greedy_logits, make_tiny_checkpoint

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=30 + FAMILIES.index(request.param))
    return path


def _logits_trace(path, device="cpu", **flags):
    """Logits of every sampling step for a small batch, plus the engine."""
    from pagedmoe import LLM

    llm = LLM(str(path), device=device, max_model_len=96, **flags)
    captured, _ = greedy_logits(llm, (7, 19, 3, 30), max_tokens=6, seed=5)
    return captured, llm.engine


@pytest.mark.parametrize("flags", [dict(cpu_moe=True), dict(num_gpu_experts=3), dict(num_gpu_experts=7),
                                   dict(expert_placement="paged", num_gpu_experts=8)])
def test_paged_logits_bit_identical_to_resident(ckpt, flags):
    ref, _ = _logits_trace(ckpt)
    got, engine = _logits_trace(ckpt, **flags)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    stats = engine.get_stats()
    n_res = flags.get("num_gpu_experts", 0)
    num_moe = len(engine.model.moe_layers())
    assert stats["experts"].get("resident/fp32", 0) == n_res * num_moe     # float32 weights
    assert stats["experts"].get("host/fp32", 0) == (8 - n_res) * num_moe
    # Every forward streams every host-tier expert of every layer.
    per_forward = engine.pager.bytes_per_forward
    assert per_forward == (8 - n_res) * num_moe * engine.expert_store.expert_numel * 4  # float32
    assert stats["expert_bytes_h2d"] == per_forward * engine.num_steps


def test_paged_under_preemption_matches_resident(ckpt):
    from pagedmoe import LLM, SamplingParams

    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (20, 28, 12, 33, 9, 25)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name, flags in (("resident", {}), ("paged", dict(num_gpu_experts=2))):
        llm = LLM(str(ckpt), device="cpu", max_model_len=48, block_size=8, num_kv_blocks=8, **flags)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
        assert llm.engine.scheduler.num_preemptions_total > 0
    assert outs["resident"] == outs["paged"]


def test_placement_flags_that_cannot_take_effect(ckpt):
    from pagedmoe import LLM

    with pytest.raises(ValueError, match="cannot take effect"):
        LLM(str(ckpt), device="cpu", expert_placement="resident", cpu_moe=True)
    with pytest.raises(ValueError, match="exceeds the model's 8 experts"):
        LLM(str(ckpt), device="cpu", num_gpu_experts=9)
    with pytest.raises(ValueError, match="contradicts"):
        LLM(str(ckpt), device="cpu", expert_placement="paged", cpu_moe=True, num_gpu_experts=2)
    with pytest.raises(ValueError, match="vmm"):
        LLM(str(ckpt), device="cpu", cpu_moe=True, expert_placement="paged", expert_buffers="vmm")
    with pytest.raises(ValueError, match="'vmm-ring' need a CUDA device"):
        LLM(str(ckpt), device="cpu", cpu_moe=True, expert_placement="paged", expert_buffers="vmm-ring")


def test_paging_frees_device_memory_for_kv(tmp_path):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=1, num_hidden_layers=6)
    probe = LLM(str(tmp_path), device="cpu", max_model_len=64).engine.plan
    # A budget that leaves the resident placement 20 KV blocks.
    budget = (probe.weight_bytes + probe.activation_bytes + 20 * probe.kv_bytes_per_block + 100) / 1024 ** 3
    resident = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=budget,
                   expert_placement="resident").engine
    assert resident.plan.num_kv_blocks == 20
    paged = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=budget, cpu_moe=True).engine
    # Two layers' buffers instead of all six layers' experts: the difference goes to KV blocks.
    freed = resident.expert_store.device_bytes - paged.expert_store.device_bytes
    assert freed == 4 * paged.expert_store.row_bytes * 8
    assert paged.plan.num_kv_blocks - resident.plan.num_kv_blocks == freed // paged.plan.kv_bytes_per_block


def test_auto_placement_follows_the_planner(tmp_path):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=1, num_hidden_layers=6)
    big = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=8).engine
    assert not big.expert_store.paged  # everything fits: resident wins
    probe = big.plan
    tight = (probe.weight_bytes + probe.activation_bytes + 8 * probe.kv_bytes_per_block) / 1024 ** 3
    small = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tight).engine
    plan = small.placement_plan
    assert plan is not None and small.expert_store.paged == (plan.mode != "resident")
    assert small.expert_store.table.count(0, "resident") == plan.placement.num_gpu_experts[0]


# -- the lossless compressed tier (issue 6) ------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_bf16")
    make_tiny_checkpoint("mixtral", path, seed=41, dtype=torch.bfloat16, num_hidden_layers=3)
    return path


def test_compressed_tier_logits_bit_identical_to_resident(bf16_ckpt):
    ref, resident = _logits_trace(bf16_ckpt, dtype="bfloat16")
    got, engine = _logits_trace(bf16_ckpt, dtype="bfloat16", num_gpu_experts=2, num_compressed_experts=4)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    store, num_moe = engine.expert_store, len(engine.model.moe_layers())
    stats = engine.get_stats()
    assert stats["experts"] == {"resident/bf16": 2 * num_moe, "compressed/bf16": 4 * num_moe,
                                "host/bf16": 2 * num_moe}
    # Every forward decodes every compressed expert (bf16 output bytes) and copies every host one.
    numel = store.expert_numel
    assert engine.pager.decoded_bytes_per_forward == 4 * num_moe * numel * 2
    assert stats["expert_bytes_decoded"] == engine.pager.decoded_bytes_per_forward * engine.num_steps
    assert stats["expert_bytes_h2d"] == 2 * num_moe * numel * 2 * engine.num_steps
    # The compressed copy is on the device and smaller than the same experts resident.
    assert all(ct is not None and ct.device == store.device for ct in store.compressed)
    assert 0 < store.compressed_bytes < 4 * num_moe * store.row_bytes
    assert stats["expert_compressed_bytes"] == store.compressed_bytes
    _, six_resident = _logits_trace(bf16_ckpt, dtype="bfloat16", num_gpu_experts=6)
    assert store.device_bytes < six_resident.expert_store.device_bytes
    assert store.device_bytes == store.resident_bytes + store.compressed_bytes + store.buffer_bytes


def test_compressed_tier_into_padded_rows(bf16_ckpt, monkeypatch):
    """Buffer rows longer than an expert (VMM rounds them up to 2 MiB): each layer's compressed experts still
    decode in one launch, each into its own row, and the logits stay those of resident placement."""
    import pagedmoe.experts.build as manager

    ref, _ = _logits_trace(bf16_ckpt, dtype="bfloat16")
    monkeypatch.setattr(manager, "STRIDE_ALIGN_BYTES", 8192)
    got, engine = _logits_trace(bf16_ckpt, dtype="bfloat16", num_gpu_experts=1, num_compressed_experts=5)
    store = engine.expert_store
    assert store.stride > store.expert_numel  # rows are padded
    assert all(len(runs) == 1 for runs in engine.pager.fill.decodes)  # one decode per layer
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


def test_table_places_three_tiers():
    from pagedmoe.experts.table import ExpertKey, ExpertTable

    table = ExpertTable(2, 6)
    table.place([{0, 4}, ()], [{1, 5}, range(6)])
    assert [(e.tier, e.slot) for e in (table.entry(ExpertKey(0, i)) for i in range(6))] == [
        ("resident", 0), ("compressed", 0), ("host", 0), ("host", 1), ("resident", 1), ("compressed", 1)]
    assert table.count(1, "compressed") == 6 and table.count(1, "host") == 0
    assert table.counts()[("compressed", "bf16")] == 8
    with pytest.raises(ValueError, match="both resident and compressed"):
        table.place([{0, 1}, ()], [{1}, ()])
    with pytest.raises(ValueError, match="out of range"):
        table.place([(), ()], [{6}, ()])


def test_store_encodes_a_layer_once_its_rows_are_complete():
    from pagedmoe.codecs.lossless import decode_reference
    from pagedmoe.experts.store import ExpertStore
    from pagedmoe.experts.table import ExpertTable

    H, I = 16, 8
    table = ExpertTable(2, 4)
    table.place([{0}, {0}], [{1, 3}, {2}])
    store = ExpertStore(table, H, I, torch.bfloat16, torch.device("cpu"), paged=True)
    gen = torch.Generator().manual_seed(3)
    w = {(l, e): torch.randn(3 * I * H, generator=gen).to(torch.bfloat16) for l in range(2) for e in range(4)}
    for e in (1, 3):
        store.write(0, e, "w13", w[0, e][:2 * I * H].view(2 * I, H))
    store.write(0, 1, "w13", w[0, 1][:2 * I * H].view(2 * I, H))  # written twice: still incomplete
    assert store.compressed[0] is None
    store.write(0, 1, "w2", w[0, 1][2 * I * H:].view(H, I))
    assert store.compressed[0] is None
    store.write(0, 3, "down", w[0, 3][2 * I * H:].view(H, I))
    assert store.compressed[0] is not None  # encoded on the last part, staging freed
    with pytest.raises(RuntimeError, match="no raw row"):
        store.row(0, 1)
    assert torch.equal(decode_reference(store.compressed[0]).view(2, -1), torch.stack([w[0, 1], w[0, 3]]))
    store.write(1, 2, "gate", w[1, 2][:I * H].view(I, H))
    assert store.compressed[1] is None
    store.finalize()  # encodes what is staged
    assert store.compressed[1] is not None and store.compressed_bytes > 0


def test_compressed_tier_decodes_the_written_rows(bf16_ckpt):
    """Each compressed expert decodes to the raw row the loader wrote (first-N ids, any split)."""
    from pagedmoe import LLM
    from pagedmoe.codecs.lossless import decode_reference

    resident = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", max_model_len=32).engine.expert_store
    for n, c in ((0, 8), (3, 1), (5, 3)):
        store = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", max_model_len=32, num_gpu_experts=n,
                    num_compressed_experts=c).engine.expert_store
        assert store.table.ids(0, "compressed") == list(range(n, n + c))
        for layer, ct in enumerate(store.compressed):
            rows = decode_reference(ct).view(c, -1)
            want = resident.resident[layer][n:n + c, :store.expert_numel]
            assert torch.equal(rows, want)


def test_compressed_tier_flags(bf16_ckpt, tmp_path):
    from pagedmoe import LLM

    with pytest.raises(ValueError, match="exceeds the model's 8 experts"):
        LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", num_gpu_experts=5, num_compressed_experts=4)
    with pytest.raises(ValueError, match="cannot take effect"):
        LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", expert_placement="resident",
            num_compressed_experts=2)
    with pytest.raises(ValueError, match="cannot take effect"):
        LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", expert_placement="resident",
            expert_compression="lossless")
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(str(bf16_ckpt), device="cpu", dtype="float32", num_compressed_experts=2)
    with pytest.raises(ValueError, match="cannot take effect"):
        LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", expert_compression="lossless")
    # --num-compressed-experts alone: paged, nothing else resident.
    store = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", max_model_len=32,
                num_compressed_experts=3).engine.expert_store
    assert store.paged and store.table.count(0, "resident") == 0 and store.table.count(0, "compressed") == 3


def test_auto_placement_uses_the_compressed_tier_only_when_asked(tmp_path, monkeypatch):
    """The planner sees a compression ratio only under --expert-compression lossless, and the engine
    carries out the compressed counts of the placement it picks."""
    import dataclasses

    from pagedmoe import LLM
    from pagedmoe.planning import planner
    from pagedmoe.planning.placement import LOSSLESS_PLANNING_RATIO
    from pagedmoe.planning.placement import Placement

    make_tiny_checkpoint("mixtral", tmp_path, seed=2, dtype=torch.bfloat16, num_hidden_layers=4)
    common = dict(device="cpu", dtype="bfloat16", max_model_len=64)
    probe = LLM(str(tmp_path), **common).engine.plan
    tight = (probe.weight_bytes + probe.activation_bytes + 8 * probe.kv_bytes_per_block) / 1024 ** 3
    seen, real = [], planner.plan_memory

    def plan_memory(shape, *args, **kwargs):
        plan = real(shape, *args, **kwargs)
        ratio = kwargs.get("compression_ratio")
        seen.append(ratio)
        if not ratio:
            return plan
        # The tiny model never needs the compressed tier (its experts stream in no time): impose one.
        return dataclasses.replace(plan, placement=Placement(8, (1, 2, 1, 2), (3, 2, 0, 6), ratio))

    monkeypatch.setattr(planner, "plan_memory", plan_memory)
    plain = LLM(str(tmp_path), gpu_memory_gb=tight, **common).engine
    assert seen == [None] and plain.expert_store.compressed_bytes == 0
    comp = LLM(str(tmp_path), gpu_memory_gb=tight, expert_compression="lossless", **common).engine
    assert seen[1] == LOSSLESS_PLANNING_RATIO
    table = comp.expert_store.table
    assert [table.count(l, "resident") for l in range(4)] == [1, 2, 1, 2]
    assert [table.count(l, "compressed") for l in range(4)] == [3, 2, 0, 6]
    assert comp.expert_store.compressed[2] is None and comp.expert_store.compressed_bytes > 0
    ref, _ = _logits_trace(tmp_path, dtype="bfloat16")
    got, engine = _logits_trace(tmp_path, dtype="bfloat16", gpu_memory_gb=tight, expert_compression="lossless")
    assert engine.expert_store.table.count(3, "compressed") == 6
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("buffers", ["plain", "vmm"])
def test_compressed_tier_triton_decode_on_cuda(bf16_ckpt, eager, buffers):
    """On CUDA the pager decodes with the Triton kernel on its copy stream (inside the decode CUDA
    graphs when not eager); logits stay identical to resident, with plain and VMM buffers."""
    # prefill_graph_tokens=0: the resident reference prefills eager, as paged engines do
    ref, _ = _logits_trace(bf16_ckpt, device="cuda", dtype="bfloat16", enforce_eager=eager, prefill_graph_tokens=0)
    got, engine = _logits_trace(bf16_ckpt, device="cuda", dtype="bfloat16", enforce_eager=eager,
                                expert_buffers=buffers, num_gpu_experts=2, num_compressed_experts=4)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    store, stats = engine.expert_store, engine.get_stats()
    assert all(ct.device.type == "cuda" for ct in store.compressed)
    assert stats["expert_bytes_decoded"] == engine.pager.decoded_bytes_per_forward * engine.num_steps > 0
    assert stats["expert_compressed_bytes"] == store.compressed_bytes > 0
    if eager:
        assert stats["expert_copy_s"] > 0


def test_warm_ups_skip_host_copies_and_count_nothing():
    """CUDA-graph warm-ups run under pager.no_host_copies(): with every expert on the host the compute
    buffers keep what they held and the traffic counters stay; after it, a forward fills them again
    (CPU: plain double buffer)."""
    import torch

    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(device="cpu", expert_placement="paged", num_gpu_experts=0, max_model_len=64))
    pager, store = engine.model.pager, engine.expert_store
    for layer in range(2):
        store.buffers.packed(layer).zero_()
    stats = pager.stats.as_dict()
    with pager.no_host_copies():
        pager.begin_forward()
        for layer in range(store.table.num_layers):
            pager.before_layer(layer)
            pager.weights(layer)
            pager.done(layer)
    assert pager.stats.as_dict() == stats
    assert all(not store.buffers.packed(layer).any() for layer in range(2))
    pager.begin_forward()
    pager.weights(0)
    n = store.expert_numel
    expected = torch.stack([store.row(0, e)[:n] for e in range(store.table.num_experts)])
    assert torch.equal(store.buffers.packed(0)[:, :n], expected)
    assert pager.stats.as_dict()["bytes_h2d"] > stats["bytes_h2d"]


def test_compressed_host_tier_with_dummy_weights(bf16_ckpt):
    """--load-format dummy fills the compressed host tier layer by layer (init_random): logits equal the
    raw host tier's with the same seed, and no raw host row is left."""
    ref, _ = _logits_trace(bf16_ckpt, dtype="bfloat16", load_format="dummy", cpu_moe=True)
    got, engine = _logits_trace(bf16_ckpt, dtype="bfloat16", load_format="dummy", cpu_moe=True,
                                host_compression="lossless")
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(h is None for h in engine.expert_store.host) and engine.expert_store.host_bytes > 0


@pytest.mark.parametrize("flags", [dict(cpu_moe=True), dict(num_gpu_experts=5)])
def test_compressed_host_tier_logits_bit_identical_to_resident(bf16_ckpt, flags):
    """--host-compression lossless: the host tier holds compressed bytes, copied into a staging copy and
    decoded into the compute buffer each step; logits equal resident placement, the bytes that cross
    'PCIe' are the compressed ones, and the raw host rows are gone."""
    ref, _ = _logits_trace(bf16_ckpt, dtype="bfloat16")
    got, engine = _logits_trace(bf16_ckpt, dtype="bfloat16", host_compression="lossless", **flags)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    store, stats = engine.expert_store, engine.get_stats()
    comp = [ct for cts in store.host_compressed if cts for ct in cts]   # one group of experts per layer here
    n_host = sum(store.table.count(layer, "host") for layer in range(store.table.num_layers))
    assert sum(ct.num_parts for ct in comp) == n_host and all(h is None for h in store.host)
    assert len(comp) == sum(1 for cts in store.host_compressed if cts)
    per_forward = sum(ct.stream.nbytes + ct.block_bit_offsets.nbytes + ct.lane_bits.nbytes + ct.raw.nbytes
                      for ct in comp)
    assert stats["expert_bytes_h2d"] == per_forward * engine.num_steps
    raw = n_host * store.expert_numel * 2
    assert stats["expert_bytes_decoded"] == raw * engine.num_steps and per_forward < raw
    assert store.host_bytes < raw and stats["expert_buffer_bytes"] > store.buffers.nbytes  # + staging
    with pytest.raises(RuntimeError, match="compressed in host memory"):
        store.row(0, store.table.ids(0, "host")[0])


def test_compressed_host_tier_in_groups_into_padded_rows(bf16_ckpt, monkeypatch):
    """A layer's compressed host experts move and decode in groups of consecutive experts (at most
    HOST_GROUP_BYTES of bf16 each; one copy per array and one decode per group), into rows padded past the
    expert: logits equal resident placement."""
    import pagedmoe.experts.build as manager
    import pagedmoe.experts.tiers.host as store_mod

    ref, _ = _logits_trace(bf16_ckpt, dtype="bfloat16")
    monkeypatch.setattr(manager, "STRIDE_ALIGN_BYTES", 8192)
    monkeypatch.setattr(store_mod, "host_group_experts", lambda expert_bytes: 3)
    got, engine = _logits_trace(bf16_ckpt, dtype="bfloat16", host_compression="lossless", num_gpu_experts=1)
    store = engine.expert_store
    assert store.stride > store.expert_numel
    assert all(g == [(1, 3), (4, 3), (7, 1)] for g in store.host_groups)        # 7 host experts per layer
    assert [ct.num_parts for ct in store.host_compressed[0]] == [3, 3, 1]
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    stats = engine.get_stats()
    assert stats["expert_bytes_decoded"] == 7 * len(store.host_groups) * store.expert_numel * 2 * engine.num_steps


def test_host_compression_flags(bf16_ckpt):
    from pagedmoe import LLM

    with pytest.raises(ValueError, match="cannot take effect with --expert-placement resident"):
        LLM(str(bf16_ckpt), device="cpu", host_compression="lossless", expert_placement="resident")
    with pytest.raises(ValueError, match="contradicts --expert-precision static-int8"):
        LLM(str(bf16_ckpt), device="cpu", host_compression="lossless", expert_precision="static-int8")
    with pytest.raises(ValueError, match="bf16"):
        LLM(str(bf16_ckpt), device="cpu", dtype="float32", host_compression="lossless", cpu_moe=True)


def test_planner_models_the_compressed_host_tier():
    from pagedmoe.planning.kv_sizing import GiB
    from pagedmoe.planning.model_shape import ModelShape
    from pagedmoe.planning.placement import Placement
    from pagedmoe.planning.planner import PlanInputs, plan_placement

    shape = ModelShape.from_hf_config("benchmarks/configs/mixtral-8x7b", dtype_bytes=2)
    plans = {}
    for ratio in (0.0, 0.683):
        inputs = PlanInputs(shape, 64 * GiB, 2 * GiB, 2048, workload=(1024, 1024), host_compression_ratio=ratio)
        plans[ratio] = plan_placement(inputs, Placement.uniform(32, 8, 0))
    raw, comp = plans[0.0], plans[0.683]
    assert comp.traffic.h2d_bytes == 256 * int(shape.expert_bytes * 0.683)
    assert comp.traffic.decode_out_bytes == 256 * shape.expert_bytes
    assert comp.estimate.decode.pcie_s == pytest.approx(0.683 * raw.estimate.decode.pcie_s, rel=1e-3)
    # the staging slots (two compressed experts) come out of the KV cache
    assert comp.buffer_bytes - raw.buffer_bytes == 2 * int(shape.expert_bytes * 0.683)
    assert comp.host_tier_bytes < raw.host_tier_bytes and comp.num_kv_blocks < raw.num_kv_blocks
    assert comp.estimate.output_throughput > 1.2 * raw.estimate.output_throughput


def test_host_compression_auto_follows_the_planner(bf16_ckpt, monkeypatch):
    """--host-compression auto: the planner models the placement with and without the compressed host tier
    and the engine builds the faster one; explicit lossless where the plan is resident fails loudly."""
    from pagedmoe import LLM
    from pagedmoe.planning import planner

    picked = {}
    real = planner.plan_memory

    def spy(*a, host_compression_ratio=0.0, **kw):
        plan = real(*a, host_compression_ratio=host_compression_ratio, **kw)
        picked[host_compression_ratio] = plan.estimate.output_throughput
        return plan

    monkeypatch.setattr(planner, "plan_memory", spy)
    llm = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", gpu_memory_gb=0.02, max_model_len=96,
              host_compression="auto", expert_placement="paged")
    assert set(picked) == {0.0, 0.683}
    best = "lossless" if picked[0.683] > picked[0.0] else "none"
    assert llm.engine.host_compression == best
    assert any(llm.engine.expert_store.host_compressed) == (best == "lossless")
    # On a machine with a slow host link the compressed host tier wins and is what the engine builds.
    from pagedmoe.planning.cost_model import HardwareProfile

    slow = HardwareProfile(pcie_h2d_bytes_per_s=1e6)
    monkeypatch.setattr(planner, "plan_memory", lambda *a, **kw: real(*a, hw=slow, **kw))
    llm = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", gpu_memory_gb=0.02, max_model_len=96,
              host_compression="auto", expert_placement="paged")
    assert llm.engine.host_compression == "lossless"
    assert any(llm.engine.expert_store.host_compressed)
    with pytest.raises(ValueError, match="cannot take effect: at this budget the planner keeps every expert"):
        LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", gpu_memory_gb=4.0, max_model_len=96,
            host_compression="lossless")


def test_warm_ups_decode_valid_staging_with_a_compressed_host_tier(bf16_ckpt):
    """Warm-ups skip the host copies but still decode (their kernels compile before any capture): the
    staging slots hold a real expert's arrays from the start, so such a decode reads valid offsets."""
    from pagedmoe import LLM

    engine = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", cpu_moe=True, host_compression="lossless",
                 max_model_len=64).engine
    pager = engine.model.pager
    stats = pager.stats.as_dict()
    with pager.no_host_copies():
        pager.begin_forward()
        for layer in range(engine.expert_store.table.num_layers):
            pager.weights(layer)
            pager.done(layer)
    assert pager.stats.as_dict() == stats
    store = engine.expert_store
    view = store.host_staging[0][0]
    # the slot holds a real group's arrays (the one with the most parts; the view reads their prefix)
    nb = view.block_bit_offsets.numel()
    assert any(torch.equal(view.raw, g.raw[:view.raw.numel()])
               and torch.equal(view.block_bit_offsets, g.block_bit_offsets[:nb])
               for cts in store.host_compressed if cts for g in cts)


def test_compressing_the_host_tier_frees_the_raw_rows(bf16_ckpt, monkeypatch):
    """Each layer's raw host rows are compressed as soon as the loader has written them (not after the
    whole checkpoint) and then die (nothing else, the pager's fill plan included, holds them): a host tier
    larger than host memory in bf16 but not compressed must load."""
    import gc
    import weakref

    from pagedmoe import LLM
    from pagedmoe.experts.store import ExpertStore

    refs, writes, at_compress = [], [0], []
    real_compress, real_write = ExpertStore._compress_host_layer, ExpertStore.write

    def spy_compress(self, layer):
        if self.host[layer] is not None and self.host[layer].shape[0]:
            refs.append(weakref.ref(self.host[layer]))
            at_compress.append(writes[0])
        real_compress(self, layer)

    def spy_write(self, *args, **kw):
        writes[0] += 1
        real_write(self, *args, **kw)

    monkeypatch.setattr(ExpertStore, "_compress_host_layer", spy_compress)
    monkeypatch.setattr(ExpertStore, "write", spy_write)
    llm = LLM(str(bf16_ckpt), device="cpu", dtype="bfloat16", cpu_moe=True, host_compression="lossless",
              max_model_len=64)
    gc.collect()
    store = llm.engine.expert_store
    assert len(refs) == store.table.num_layers and all(r() is None for r in refs)
    assert at_compress[0] < writes[0]   # the first layer was compressed while later layers were loading
    assert store.host_bytes > 0 and all(h is None for h in store.host)


# -- host memory ---------------------------------------------------------------------------------

def test_init_random_encodes_each_layer_as_it_is_staged(monkeypatch):
    """Dummy init encodes (quantises) a layer's compressed (quantized) experts from the device rows before the
    next layer is written, never staging them in host memory (only resident and host experts are written
    through row()), with the same result as staging every layer first."""
    from pagedmoe.codecs.lossless import decode_reference
    from pagedmoe.experts.dummy import DummyExperts
    from pagedmoe.experts.store import ExpertStore
    from pagedmoe.experts.table import ExpertTable

    H, I, L = 16, 8, 3

    def store():
        table = ExpertTable(L, 6)
        table.place([{0}, {0, 5}, ()], [{1, 3}, {2}, {0, 1}], [{2}, {1, 3}, {4, 5}], "int8")
        return ExpertStore(table, H, I, torch.bfloat16, torch.device("cpu"), paged=True)

    new, events = store(), []
    real_row, real_encode, real_quant = new.row, new._encode, new._quantize
    monkeypatch.setattr(new, "row", lambda l, e: (events.append(("row", l)), real_row(l, e))[1])
    monkeypatch.setattr(new, "_encode", lambda l, *a: (events.append(("encode", l)), real_encode(l, *a))[1])
    monkeypatch.setattr(new, "_quantize", lambda l, *a: (events.append(("quantize", l)), real_quant(l, *a))[1])
    new.init_random(seed=9)
    done = [(kind, l) for kind, l in events if kind != "row"]
    rows_written = [sum(1 for kind, ll in events if kind == "row" and ll == l) for l in range(L)]
    assert rows_written == [new.table.count(l, "resident") + new.table.count(l, "host") for l in range(L)]
    assert done == [(k, l) for l in range(L) for k in ("encode", "quantize")]
    for kind, l in done:  # each layer is done before the next layer's first row
        assert all(ll <= l for _, ll in events[:events.index((kind, l))])

    old = store()  # the old order: every layer's rows first, finalize() encodes them all
    gen = DummyExperts(9 + 1, 0.02, torch.bfloat16, torch.device("cpu"))   # the weights init_random generates
    n = 3 * I * H
    for l in range(L):
        for e in range(6):
            gen.fill(l, e, old.row(l, e)[:n])
    old.finalize()
    for l in range(L):
        assert torch.equal(decode_reference(new.compressed[l]), decode_reference(old.compressed[l]))
        a, b = (torch.zeros(6, new.stride, dtype=torch.bfloat16) for _ in range(2))
        new.quantized[l].dequantize_into(a)
        old.quantized[l].dequantize_into(b)
        assert torch.equal(a, b) and torch.equal(new.host[l], old.host[l])
        assert torch.equal(new.resident[l], old.resident[l])


def test_engine_bounds_the_host_tier(tmp_path, monkeypatch):
    """--host-memory-gb (else the detected host memory) reaches the planner: with too little host memory
    for any paged plan at this budget the engine refuses, naming host memory."""
    from pagedmoe import LLM
    from pagedmoe.engine import startup as llm_engine

    make_tiny_checkpoint("mixtral", tmp_path, seed=1, num_hidden_layers=6)
    probe = LLM(str(tmp_path), device="cpu", max_model_len=64).engine.plan
    tight = (probe.weight_bytes + probe.activation_bytes + 8 * probe.kv_bytes_per_block) / 1024 ** 3
    engine = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tight).engine
    assert engine.expert_store.paged and engine.placement_plan.host_tier_bytes > 0
    half = engine.placement_plan.host_tier_bytes // 2
    bounded = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tight,
                  host_memory_gb=half / 1024 ** 3).engine
    assert 0 < bounded.placement_plan.host_tier_bytes <= half
    assert bounded.expert_store.host_bytes <= half
    # too small for resident (4 KV blocks for max_model_len), and no expert fits the host
    tighter = (probe.weight_bytes + probe.activation_bytes + 2 * probe.kv_bytes_per_block) / 1024 ** 3
    limit = 1024
    with pytest.raises(ValueError, match="host memory is the limit"):
        LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tighter, host_memory_gb=limit / 1024 ** 3)
    monkeypatch.setattr(llm_engine, "detect_host_budget_bytes", lambda: limit)
    with pytest.raises(ValueError, match="--host-memory-gb"):
        LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tighter)
    monkeypatch.setattr(llm_engine, "detect_host_budget_bytes", lambda: None)  # unknown: unbounded
    assert LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tighter).engine.expert_store.paged


def test_fixed_placement_checks_the_host_tier(tmp_path):
    """--cpu-moe / --num-gpu-experts skip the planner's search but not the host limit: refused with the
    sizes and what to do, and accepted once the limit holds the host tier."""
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=1, num_hidden_layers=2)
    paged = LLM(str(tmp_path), device="cpu", max_model_len=64, cpu_moe=True).engine
    host = paged.expert_store.host_bytes
    assert host > 0
    with pytest.raises(ValueError, match="does not fit the host memory limit.*--num-gpu-experts"):
        LLM(str(tmp_path), device="cpu", max_model_len=64, cpu_moe=True, host_memory_gb=host / 2 / 1024 ** 3)
    with pytest.raises(ValueError, match="host memory limit"):
        LLM(str(tmp_path), device="cpu", max_model_len=64, num_gpu_experts=1, host_memory_gb=host / 4 / 1024 ** 3)
    ok = LLM(str(tmp_path), device="cpu", max_model_len=64, cpu_moe=True, host_memory_gb=2 * host / 1024 ** 3)
    assert ok.engine.expert_store.host_bytes == host
