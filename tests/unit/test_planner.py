"""Memory/placement planner and cost model (planning/planner.py, cost_model.py, model_shape.py) on CPU,
with numbers checked by hand; `pagedmoe plan` on the shape-only benchmark configs."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pagedmoe.planning.kv_sizing import GiB, BudgetError
from pagedmoe.planning.cost_model import (H200, HardwareProfile, StepTraffic, expected_distinct_experts, pipeline_s,
                                         step_cost)
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import Placement
from pagedmoe.planning.planner import (PlacementBudgetError, PlanInputs, minimum_budget_bytes, plan_memory,
                                      plan_placement)

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
MIXTRAL = ModelShape(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     num_experts=8, top_k=2, moe_intermediate_size=14336, dense_intermediate_size=14336,
                     num_moe_layers=32, name="mixtral-8x7b")
ACT = 2 * GiB
KW = dict(max_model_len=2048, workload=(1024, 1024), max_num_seqs=256)
EXPERT = 3 * 4096 * 14336 * 2                         # 352,321,536 bytes = 336 MiB
BACKBONE = 1_605_636_096 * 2                          # counted by hand below


def test_mixtral_sizes_by_hand():
    attn = 4096 * 128 * (2 * 32 + 2 * 8) * 32         # q, o + k, v
    router, norms, embed_and_head = 8 * 4096 * 32, 2 * 4096 * 32 + 4096, 2 * 32000 * 4096
    assert attn + router + norms + embed_and_head == 1_605_636_096
    assert MIXTRAL.expert_bytes == EXPERT and MIXTRAL.backbone_bytes == BACKBONE
    assert MIXTRAL.all_expert_bytes == 256 * EXPERT == 90_194_313_216   # ~90 GB, 84 GiB
    assert MIXTRAL.kv_bytes_per_token == 128 * 1024                     # shared/H200.md
    assert MIXTRAL.active_params_per_token == (1_605_636_096 - 32000 * 4096 - norms) + 32 * 2 * EXPERT // 2


def test_prefill_step_flops_count_the_lm_head_at_sampled_rows_only():
    # Qwen3-30B-A3B, 8 prompts x 1024 tokens: by hand, per token 48 layers of q/k/v/o (2048 x 128 x (2 x 32 + 2 x 4)),
    # the router (128 x 2048) and 8 experts of 3 x 2048 x 768; attention 4 x 32 heads x 128 x the mean context
    q = ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b")
    per_token = 48 * (2048 * 128 * (2 * 32 + 2 * 4) + 128 * 2048 + 8 * 3 * 2048 * 768)
    attention = 4 * 48 * 32 * 128 * 512
    lm_head = 151936 * 2048
    assert q.step_flops(8192, 512, 8) == pytest.approx(8192 * (2 * per_token + attention) + 8 * 2 * lm_head)
    # a decode step samples every row: the same as flops_per_token at each of them
    assert q.step_flops(64, 300, 64) == pytest.approx(64 * q.flops_per_token(300))
    assert q.step_flops(8192, 512, 8) < 0.91 * 8192 * q.flops_per_token(512)     # the lm_head was ~10% of it


def test_from_hf_config_matches_hand_built_shape():
    assert ModelShape.from_hf_config(CONFIGS / "mixtral-8x7b") == MIXTRAL
    q = ModelShape.from_hf_config(str(CONFIGS / "qwen3-30b-a3b"))
    assert (q.num_experts, q.top_k, q.num_moe_layers, q.expert_bytes, q.qk_norm) == (128, 8, 48, 9 * 2**20, "head")


@pytest.mark.parametrize("family,overrides", [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}),
                                              ("qwen2_moe", {"mlp_only_layers": [0], "qkv_bias": True}),
                                              ("mixtral", {"tie_word_embeddings": True}), ("glm4_moe", {}),
                                              ("deepseek_v2", {}), ("deepseek_v3", {}),
                                              ("deepseek_v3", {"kv_lora_rank": 23, "attention_bias": True})])
def test_backbone_matches_the_module_tree(family, overrides):
    import torch
    from tiny_models import tiny_hf_config

    from pagedmoe.kvcache.kv_cache import kv_bytes_per_block
    from pagedmoe.models.moe_decoder import MoEForCausalLM
    from pagedmoe.models.registry import MODEL_REGISTRY

    cfg = tiny_hf_config(family, **overrides)
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}[family]
    dims, spec = MODEL_REGISTRY[arch](cfg)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg, dims, spec, 64)
    model.tie_weights()
    shape = ModelShape.from_model_dims(dims, spec, dtype_bytes=4)
    params = {n: p for n, p in model.named_parameters()}
    backbone = sum(p.numel() for n, p in params.items() if not n.endswith((".w13", ".w2")))
    assert shape.backbone_params == backbone
    assert shape.num_moe_layers == len(model.moe_layers())
    assert shape.kv_bytes_per_token * 16 == kv_bytes_per_block(dims.num_layers, dims.num_kv_heads, dims.head_dim,
                                                                16, torch.float32)


def test_expected_distinct_experts():
    assert expected_distinct_experts(8, 2, 0) == 0
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2)
    assert expected_distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))   # 3.5
    assert expected_distinct_experts(8, 2, 10_000) == pytest.approx(8)


def test_step_floors_by_hand():
    # All experts paged: every step copies all 90.19 GB over PCIe: 90.19e9 / 54.5e9 = 1.655 s.
    traffic = StepTraffic(h2d_bytes=MIXTRAL.all_expert_bytes)
    c = step_cost(MIXTRAL, H200, traffic, num_tokens=1, kv_read_bytes=0, context_len=0)
    assert c.pcie_s == pytest.approx(1.6549, abs=1e-4)
    # HBM: backbone matmuls (without the embedding table and norms) + 2 routed experts x 32 layers + the
    # copies landing in HBM + one KV token written.
    backbone_read = (1_605_636_096 - 32000 * 4096 - (2 * 4096 * 32 + 4096)) * 2
    hbm = backbone_read + 64 * EXPERT + MIXTRAL.all_expert_bytes + 128 * 1024
    assert c.hbm_s == pytest.approx(hbm / 4.19e12)
    assert c.compute_s == pytest.approx(2 * (backbone_read // 2 + 64 * EXPERT // 2) / 753e12)
    assert c.bound == "pcie" and c.floor_s == c.pcie_s
    # Fill, copies spread evenly: one layer of the shorter side. Overhead: constant + 32 layers + 1 sequence.
    assert c.fill_s == pytest.approx(c.hbm_s / 32, rel=1e-9)
    assert c.overhead_s == pytest.approx(1e-3 + 32 * 0.19e-3 + 48e-6)
    assert c.total_s == pytest.approx(c.pcie_s + c.hbm_s / 32 + c.overhead_s)
    resident = step_cost(MIXTRAL, H200, StepTraffic(), 1, 0, 0)
    assert resident.pcie_s == 0 and resident.fill_s == 0 and resident.bound == "hbm"


def test_pipeline_by_hand():
    # Even copies: the longer side plus one layer of the shorter one.
    assert pipeline_s([2.0] * 4, 1.0) == pytest.approx(8 + 1)
    assert pipeline_s([1.0] * 4, 2.0) == pytest.approx(1 + 8)
    # Layer 2's copy (5) waits for buffer 0, free once layer 0 computed (t=1): done at 6, layer 2 computes
    # 6..7, layer 3 7..8.
    assert pipeline_s([0.0, 0.0, 5.0, 0.0], 1.0) == pytest.approx(8)
    # One host expert in each of the last 3 of 32 layers (Mixtral at weights + 4 GiB): the copies start when
    # layer 27 is done and run back to back; the last layer computes after them.
    g, c = 20.7e-3 / 32, 6.2e-3
    assert pipeline_s([0.0] * 29 + [c] * 3, g) == pytest.approx(28 * g + 3 * c + g)


def test_uneven_copies_cost_more_than_even_ones():
    """The planner splits the copy side by each layer's host experts: a few host experts in a few layers
    hide less behind compute than the same bytes spread evenly."""
    from pagedmoe.planning.placement import Placement

    gpu = (8,) * 29 + (7,) * 3
    uneven = Placement(8, gpu)
    inputs = PlanInputs(MIXTRAL, int(91 * GiB), int(2 * GiB), 2048, workload=(1024, 1024))
    plan = plan_placement(inputs, uneven)
    shares = plan.traffic.layer_copy_shares
    assert len(shares) == 32 and shares[:29] == (0.0,) * 29 and shares[29:] == pytest.approx((1 / 3,) * 3)
    d = plan.estimate.decode
    even_fill = min(d.pcie_s, max(d.hbm_s, d.compute_s)) / 32
    assert d.fill_s > 2 * (d.pcie_s / 3) - 0.01 and d.fill_s > 10 * even_fill


def test_splits_add_up_and_kv_gets_the_rest():
    for gib in (24, 40, 64, 91, 139):
        for placement in (Placement.uniform(32, 8, 0), Placement.uniform(32, 8, 3), Placement.spread(32, 8, 77)):
            try:
                plan = plan_placement(PlanInputs(MIXTRAL, gib * GiB, ACT, 2048), placement)
            except PlacementBudgetError:
                continue
            parts = (plan.backbone_bytes + plan.activation_bytes + plan.resident_expert_bytes
                     + plan.compressed_expert_bytes + plan.buffer_bytes + plan.kv_bytes)
            assert parts + plan.unused_bytes == gib * GiB
            assert 0 <= plan.unused_bytes < plan.kv_bytes_per_block
            assert plan.resident_expert_bytes == placement.total_gpu * EXPERT
            assert plan.host_tier_bytes == placement.total_host * EXPERT
            assert plan.buffer_bytes == 2 * placement.max_streamed * EXPERT
            assert plan.traffic.h2d_bytes == placement.total_host * EXPERT


def test_resident_refused_with_the_right_minimum():
    need = BACKBONE + MIXTRAL.all_expert_bytes + ACT + 128 * 16 * 128 * 1024   # one 2048-token sequence
    with pytest.raises(BudgetError, match=r"needs 89\.2[0-9] GiB") as e:
        plan_memory(MIXTRAL, 64 * GiB, ACT, "resident", **KW)
    assert isinstance(e.value, ValueError) and e.value.min_budget_bytes == need
    plan = plan_memory(MIXTRAL, need, ACT, "resident", **KW)
    assert plan.num_kv_blocks == 128 and plan.unused_bytes == 0 and plan.num_seqs == 1
    with pytest.raises(BudgetError):
        plan_memory(MIXTRAL, need - 1, ACT, "resident", **KW)


def test_tiny_budget_refused_with_the_all_paged_minimum():
    # The cheapest placement pages everything: backbone + two layers of 8 expert buffers + one sequence.
    need = BACKBONE + ACT + 2 * 8 * EXPERT + 128 * 16 * 128 * 1024
    for mode in ("auto", "paged"):
        with pytest.raises(PlacementBudgetError) as e:
            plan_memory(MIXTRAL, 8 * GiB, ACT, mode, **KW)
        assert e.value.min_budget_bytes == need
    assert minimum_budget_bytes(PlanInputs(MIXTRAL, 0, ACT, 2048), Placement.uniform(32, 8, 0)) == need
    assert plan_memory(MIXTRAL, need, ACT, "auto", **KW).placement == Placement.uniform(32, 8, 0)


def test_more_budget_never_gives_less_kv_or_less_throughput():
    for mode, n in (("resident", None), ("paged", 0), ("paged", 5)):
        last = None
        for gib in range(20, 150, 7):
            try:
                plan = plan_memory(MIXTRAL, gib * GiB, ACT, mode, n, **KW)
            except BudgetError:
                assert last is None   # once it fits, a larger budget fits too
                continue
            if last is not None:
                assert plan.num_kv_blocks >= last.num_kv_blocks and plan.num_seqs >= last.num_seqs
            last = plan
    tputs = [plan_memory(MIXTRAL, gib * GiB, ACT, "auto", **KW).output_throughput for gib in range(20, 150, 7)]
    assert tputs == sorted(tputs)


@pytest.mark.parametrize("gib", [24, 40, 64, 80, 89.5, 91, 100, 120, 139])
def test_auto_never_worse_than_resident_or_paged(gib):
    auto = plan_memory(MIXTRAL, gib * GiB, ACT, "auto", **KW)
    for n in range(9):
        try:
            other = plan_memory(MIXTRAL, gib * GiB, ACT, "paged" if n < 8 else "resident", n if n < 8 else None, **KW)
        except BudgetError:
            continue
        assert auto.output_throughput >= other.output_throughput
    if gib == 139:
        assert auto.placement.is_resident and auto.mode == "resident"


def test_throughput_from_the_step_costs():
    plan = plan_memory(MIXTRAL, 64 * GiB, ACT, "paged", 0, **KW)
    e = plan.estimate
    # 64 GiB - backbone 3,211,272,192 - activations 2 GiB - buffers 16 x 336 MiB = 57,723,576,320 bytes of KV
    # = 27,524 blocks of 16 tokens x 128 KiB = 215 sequences of 2048 tokens (max_num_seqs 256).
    assert plan.num_kv_blocks == 57_723_576_320 // (16 * 128 * 1024) == 27_524
    assert plan.kv_capacity_tokens == 27_524 * 16 and e.num_seqs == 27_524 // 128 == 215
    assert e.decode.num_tokens == 215 and e.prefill_tokens == 8192
    assert e.prefill_s_per_seq == pytest.approx(e.prefill.total_s * 1024 / 8192)
    assert e.cycle_s == pytest.approx(1023 * e.decode.total_s + 215 * e.prefill_s_per_seq)
    assert plan.output_throughput == pytest.approx(215 * 1024 / e.cycle_s)
    # PCIe-bound: about 215 / 1.66 s of decode, less the prefill share.
    assert e.decode.bound == "pcie" and 120 < plan.output_throughput < 215 / 1.655


def test_vmm_slots_and_plain_buffers():
    qwen = replace(MIXTRAL, vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                   num_experts=128, top_k=8, moe_intermediate_size=768, dense_intermediate_size=6144,
                   num_moe_layers=48, qk_norm="head")
    n9 = 9 * 2**20
    inputs = PlanInputs(qwen, 64 * GiB, ACT, 2048)
    paged = plan_placement(inputs, Placement.uniform(48, 128, 100))
    assert paged.expert_slot_bytes == 10 * 2**20             # 9 MiB rounded up to the 2 MiB VMM granularity
    assert paged.buffer_bytes == 2 * 28 * 10 * 2**20 and paged.traffic.h2d_bytes == 28 * 48 * n9
    plain = plan_placement(replace(inputs, buffers="plain"), Placement.uniform(48, 128, 100))
    assert plain.expert_slot_bytes == n9 and plain.buffer_bytes == 2 * 128 * n9
    assert plain.traffic.d2d_bytes == 2 * 100 * 48 * n9      # resident rows read + written into the buffer
    resident = plan_placement(inputs, Placement.resident(48, 128))
    assert resident.expert_slot_bytes == n9 and resident.buffer_bytes == 0 and resident.buffers == "none"


def test_compressed_tier_costs_and_search():
    inputs = PlanInputs(MIXTRAL, 91 * GiB, ACT, 2048, workload=(1024, 1024))
    plan = plan_placement(inputs, Placement.uniform(32, 8, 2, 6, compression_ratio=0.5))
    assert plan.compressed_expert_bytes == 6 * 32 * EXPERT // 2 and plan.host_tier_bytes == 0
    assert plan.buffer_bytes == 2 * 6 * EXPERT
    assert plan.estimate.decode.decode_s == pytest.approx(6 * 32 * EXPERT / 1.5e12)
    assert plan.estimate.decode.pcie_s == 0
    with_c = plan_memory(MIXTRAL, 91 * GiB, ACT, "auto", compression_ratio=0.68, **KW)
    without = plan_memory(MIXTRAL, 91 * GiB, ACT, "auto", **KW)
    assert with_c.output_throughput >= without.output_throughput and with_c.placement.total_compressed > 0


def test_fixed_placements_and_bad_arguments():
    plan = plan_memory(MIXTRAL, 139 * GiB, ACT, "paged", 6, **KW)
    assert plan.placement.num_gpu_experts == (6,) * 32 and plan.mode == "paged"
    best_paged = plan_memory(MIXTRAL, 139 * GiB, ACT, "paged", **KW)
    assert not best_paged.placement.is_resident
    assert plan_memory(MIXTRAL, 139 * GiB, ACT, "paged", [8] * 31 + [7], **KW).buffer_bytes == 2 * EXPERT
    for mode, n in (("auto", 3), ("resident", 3), ("paged", 9), ("paged", [1, 2]), ("everything", None)):
        with pytest.raises(ValueError):
            plan_memory(MIXTRAL, 139 * GiB, ACT, mode, n, **KW)
    with pytest.raises(ValueError, match="max_model_len"):
        plan_memory(MIXTRAL, 139 * GiB, ACT, "auto", max_model_len=1024, workload=(1024, 1024))
    with pytest.raises(ValueError):
        Placement(8, (9,))
    with pytest.raises(ValueError):
        Placement(8, (4,), (2,))                                # compressed without a ratio
    assert Placement.spread(4, 8, 13).num_gpu_experts == (4, 3, 3, 3)


def test_max_kv_blocks_caps_the_cache():
    plan = plan_memory(MIXTRAL, 139 * GiB, ACT, "resident", max_kv_blocks=1000, **KW)
    assert plan.num_kv_blocks == 1000 and plan.unused_bytes > 0
    assert plan.summary().startswith("budget 139.00 GiB, experts resident: backbone 2.99 GiB")


def test_hardware_profile_json(tmp_path):
    hw = HardwareProfile(name="measured", pcie_h2d_bytes_per_s=50e9)
    assert HardwareProfile.from_json(hw.to_json()) == hw
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"pcie_h2d_bytes_per_s": 25e9}))
    assert HardwareProfile.from_json(path).pcie_h2d_bytes_per_s == 25e9
    assert HardwareProfile.from_json(str(path)).hbm_bytes_per_s == H200.hbm_bytes_per_s
    with pytest.raises(ValueError, match="unknown keys"):
        HardwareProfile.from_json({"pcie": 1})
    with pytest.raises(ValueError):
        HardwareProfile(hbm_bytes_per_s=0)
    with pytest.raises(FileNotFoundError):
        HardwareProfile.from_json(tmp_path / "missing.json")
    slow = plan_memory(MIXTRAL, 64 * GiB, ACT, "paged", 0, hw=HardwareProfile.from_json(path), **KW)
    assert slow.estimate.decode.pcie_s == pytest.approx(MIXTRAL.all_expert_bytes / 25e9)


def test_plan_cli_mixtral(plan_report):
    text, report = plan_report(CONFIGS / "mixtral-8x7b", "--gpu-memory-gb", "24", "64", "139", "weights+4")
    assert text.count("out tok/s") == 4 and "does not fit (needs 89.63 GiB)" in text  # weights, activations (one grouped-GEMM chunk), one sequence and the start-up reserve
    assert "*>auto: resident" in text and "*>auto: N=0 " in text and "paged N=0 (cpu-moe)" in text
    b24, b64, b139, bw4 = report["budgets"]
    assert b24["budget_bytes"] == 24 * GiB and bw4["budget_bytes"] == MIXTRAL.weight_bytes + 4 * GiB
    rows = {r["label"]: r for r in b139["rows"]}
    assert rows["resident"]["fits"] and rows["resident"]["num_kv_blocks"] > 0
    assert not {r["label"]: r for r in b24["rows"]}["resident"]["fits"]
    assert [r["label"] for r in b64["rows"] if r["auto"]] == ["auto: N=0"]


def test_plan_cli_selection_errors(capsys):
    from pagedmoe.cli import main

    mixtral = str(CONFIGS / "mixtral-8x7b")
    assert main(["plan", mixtral, "--gpu-memory-gb", "24", "--expert-placement", "resident"]) == 2
    assert "needs 89.63 GiB" in capsys.readouterr().err
    assert main(["plan", mixtral, "--gpu-memory-gb", "64", "--num-gpu-experts", "2"]) == 0
    assert " >paged N=2" in capsys.readouterr().out
    assert main(["plan", mixtral, "--gpu-memory-gb", "64", "--cpu-moe", "--expert-placement", "resident"]) == 2
    assert main(["plan", mixtral, "--gpu-memory-gb", "64", "--num-gpu-experts", "9"]) == 2
    assert main(["plan", mixtral, "--gpu-memory-gb", "lots"]) == 2
    capsys.readouterr()
    # a budget that is no size at all: one line, before any table
    for budget, expected in (("inf", "expected GiB"), ("nan", "expected GiB"), ("0", "must be > 0"),
                             ("-4", "must be > 0"), ("weights-1000", "must be > 0")):
        assert main(["plan", mixtral, "--gpu-memory-gb", "64", budget]) == 2, budget
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"pagedmoe plan: error: --gpu-memory-gb '{budget}'"), (budget, err)
        assert expected in err and "\n" not in err.strip(), err


def test_ring_wait_layers_and_the_ring_pipeline():
    from pagedmoe.planning.cost_model import ring_wait_layers

    # Uniform: the ring waits like the two-slot rotation (layer l for layer l + 2).
    assert ring_wait_layers([[0, 1], [2, 3], [4, 5], [6, 7]], 4) == [-1, -1, 0, 1]
    # Three host experts at the end (Mixtral at weights + 4 GiB): two start with the forward, the third
    # reuses layer 29's row.
    rows = [[]] * 29 + [[0], [1], [2]]
    assert ring_wait_layers(rows, 2) == [-1] * 31 + [29]
    # Row k reuses ring row k mod S: the wait is the owner of row (last row - S), not of the first row.
    assert ring_wait_layers([[0, 1, 2], [3, 4, 5], [], [6, 7, 8]], 6) == [-1, -1, -1, 0]
    g, c = 20.7e-3 / 32, 6.2e-3
    two_slot = pipeline_s([0.0] * 29 + [c] * 3, g)
    ring = pipeline_s([0.0] * 29 + [c] * 3, g, ring_wait_layers(rows, 2))
    # ring: copies of layers 29 and 30 run from t=0 behind 29 layers of compute; layer 31's copy starts
    # when layer 29 has computed (t = 30g) and the last layer follows it
    assert ring == pytest.approx(30 * g + c + g) and ring < two_slot - 10e-3


def test_vmm_ring_plan_hides_more_than_two_slots():
    from pagedmoe.planning.placement import Placement

    gpu = (8,) * 29 + (7,) * 3
    steps = {}
    for buffers in ("vmm", "vmm-ring"):
        inputs = PlanInputs(MIXTRAL, int(91 * GiB), int(2 * GiB), 2048, workload=(1024, 1024), buffers=buffers)
        plan = plan_placement(inputs, Placement(8, gpu))
        steps[buffers] = plan.estimate.decode
    assert steps["vmm-ring"].fill_s < steps["vmm"].fill_s / 2
    assert steps["vmm-ring"].floor_s == steps["vmm"].floor_s


def test_spread_arrangements():
    for total in (253, 251, 224, 100, 0):
        last, even = (Placement.spread(32, 8, total, fewer=f) for f in ("last", "even"))
        assert sum(last.num_gpu_experts) == sum(even.num_gpu_experts) == total
        assert sorted(last.num_gpu_experts) == sorted(even.num_gpu_experts)
    even = Placement.spread(32, 8, 253, fewer="even")
    assert [l for l, g in enumerate(even.num_gpu_experts) if g == 7] == [10, 21, 31]
    with pytest.raises(ValueError, match="fewer"):
        Placement.spread(32, 8, 253, fewer="first")


def test_ring_planner_spaces_the_host_experts_and_hides_their_copies():
    """With ring buffers the planner also tries the streamed experts evenly spaced: at weights + 4 GiB its
    pick (3 host experts in layers 10, 21, 31) hides every copy (fill ~0), which the two-slot pipeline
    cannot (each copy exposed but one layer of compute)."""
    inputs = PlanInputs(MIXTRAL, MIXTRAL.weight_bytes + 4 * GiB, int(2.1 * GiB), 2048, workload=(1024, 1024),
                        buffers="vmm-ring")
    plan = plan_memory(MIXTRAL, inputs.budget_bytes, inputs.activation_bytes, "paged", max_model_len=2048,
                       workload=(1024, 1024), buffers="vmm-ring")
    hosts = [l for l, g in enumerate(plan.placement.num_gpu_experts) if g < 8]
    assert plan.placement.total_host <= 4 and hosts[-1] == 31 and hosts[0] > 0
    assert plan.estimate.decode.fill_s < 1e-3
    two_slot = plan_placement(replace(inputs, buffers="vmm"), plan.placement)
    assert two_slot.estimate.decode.fill_s > 10e-3


# -- the host tier bounded by host memory -------------------------------------------------------

def test_host_limit_refuses_a_host_heavy_placement():
    from pagedmoe.planning.planner import HostBudgetError

    limit = 40 * GiB
    inputs = PlanInputs(MIXTRAL, 64 * GiB, ACT, 2048, workload=(1024, 1024), host_budget_bytes=limit)
    cpu_moe = Placement.uniform(32, 8, 0)
    assert plan_placement(replace(inputs, host_budget_bytes=None), cpu_moe).host_tier_bytes == 256 * EXPERT
    with pytest.raises(HostBudgetError) as info:
        plan_placement(inputs, cpu_moe)
    e = info.value
    assert isinstance(e, PlacementBudgetError) and e.fits_device
    assert (e.host_tier_bytes, e.host_budget_bytes) == (256 * EXPERT, limit)
    overflow = -(-(256 * EXPERT - limit) // EXPERT)                  # 135 experts
    assert e.min_budget_bytes == minimum_budget_bytes(inputs, cpu_moe) + overflow * EXPERT
    for words in ("host tier of 84.00 GiB", "host memory limit of 40.00 GiB", "--gpu-memory-gb",
                  "--expert-compression lossless", "--host-compression lossless", "--host-memory-gb"):
        assert words in str(e)
    # at the limit it fits; the fixed-placement path of plan_memory raises the same error
    assert plan_placement(replace(inputs, host_budget_bytes=256 * EXPERT), cpu_moe).host_tier_bytes == 256 * EXPERT
    with pytest.raises(HostBudgetError):
        plan_memory(MIXTRAL, 64 * GiB, ACT, "paged", 0, host_budget_bytes=limit, **KW)
    with pytest.raises(ValueError, match="host_budget_bytes"):
        replace(inputs, host_budget_bytes=-1)


def test_host_limit_moves_experts_to_the_compressed_tier():
    """With a compressed tier the auto search (uniform candidates, then _refine) stays within the limit by
    holding experts compressed on the GPU; without the limit it would put more on the host."""
    kw = dict(compression_ratio=0.68, **KW)
    free = plan_memory(MIXTRAL, 64 * GiB, ACT, "auto", **kw)
    limit = free.host_tier_bytes // 2
    bounded = plan_memory(MIXTRAL, 64 * GiB, ACT, "auto", host_budget_bytes=limit, **kw)
    assert free.host_tier_bytes > limit >= bounded.host_tier_bytes
    assert bounded.placement.total_compressed > free.placement.total_compressed
    assert bounded.output_throughput <= free.output_throughput
    for mode in ("auto", "paged"):
        tight = plan_memory(MIXTRAL, 64 * GiB, ACT, mode, host_budget_bytes=8 * GiB, **kw)
        assert 7 * GiB < tight.host_tier_bytes <= 8 * GiB and tight.placement.total_compressed > 200  # not a uniform count


def test_host_limit_named_when_nothing_fits():
    from pagedmoe.planning.planner import HostBudgetError

    # 48 GiB holds every paged placement's device share, but 20 GiB of host memory needs >= 196 experts on
    # the GPU (64 GiB): host memory is why nothing fits; the budget named is the cheapest within the limit.
    limit = 20 * GiB
    assert plan_memory(MIXTRAL, 48 * GiB, ACT, "auto", **KW).host_tier_bytes > limit
    with pytest.raises(HostBudgetError, match="host memory is the limit") as info:
        plan_memory(MIXTRAL, 48 * GiB, ACT, "auto", host_budget_bytes=limit, **KW)
    inputs = PlanInputs(MIXTRAL, 48 * GiB, ACT, 2048, workload=(1024, 1024), host_budget_bytes=limit)
    # 196 = 256 - 60 host experts, spread: cheaper than the uniform N=7 a whole-expert-per-layer step gives
    need = minimum_budget_bytes(inputs, Placement.spread(32, 8, 196))
    assert need < min(minimum_budget_bytes(inputs, Placement.uniform(32, 8, n)) for n in range(9)
                      if (8 - n) * 32 * EXPERT <= limit)
    assert info.value.min_budget_bytes == need
    assert plan_memory(MIXTRAL, need, ACT, "auto", host_budget_bytes=limit, **KW).host_tier_bytes <= limit
    # a GPU budget too small for anything: the device budget is the reason, the error still names the limit
    with pytest.raises(PlacementBudgetError, match="within the host memory limit") as info:
        plan_memory(MIXTRAL, 8 * GiB, ACT, "auto", host_budget_bytes=limit, **KW)
    assert not isinstance(info.value, HostBudgetError) and info.value.min_budget_bytes == need


def test_detect_host_budget_from_meminfo(tmp_path):
    from pagedmoe.planning.kv_sizing import detect_host_budget_bytes

    def meminfo(total_kb, avail_kb):
        p = tmp_path / f"meminfo_{total_kb}_{avail_kb}"
        lines = [f"MemTotal:       {total_kb} kB", "MemFree:         1000 kB", "HugePages_Total:       0"]
        if avail_kb is not None:
            lines.append(f"MemAvailable:   {avail_kb} kB")
        p.write_text("\n".join(lines) + "\n")
        return str(p)

    big = 128 * 1024 * 1024                                            # 128 GiB in kB: reserve 12.8 GiB
    assert detect_host_budget_bytes(meminfo(big, 120 * 1024 * 1024)) == 120 * GiB - int(big * 1024 * 0.1)
    small = 16 * 1024 * 1024                                           # 16 GiB: reserve 4 GiB
    assert detect_host_budget_bytes(meminfo(small, 10 * 1024 * 1024)) == 6 * GiB
    assert detect_host_budget_bytes(meminfo(small, 1024 * 1024)) == 0
    laptop = 8 * 1024 * 1024                                           # 8 GiB: reserve a quarter, 2 GiB
    assert detect_host_budget_bytes(meminfo(laptop, 3 * 1024 * 1024)) == 1 * GiB
    assert detect_host_budget_bytes(meminfo(small, None)) is None
    assert detect_host_budget_bytes(str(tmp_path / "missing")) is None


def test_host_memory_flag_validation(capsys):
    import argparse

    from pagedmoe.cli import main
    from pagedmoe.config import EngineConfig, add_engine_args, engine_config_from_args

    for bad in (0, -2.5):
        with pytest.raises(ValueError, match="host_memory_gb must be > 0"):
            EngineConfig(host_memory_gb=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--host-memory-gb", "96"])).host_memory_gb == 96.0
    assert EngineConfig().host_memory_gb is None
    mixtral = str(CONFIGS / "mixtral-8x7b")
    assert main(["plan", mixtral, "--gpu-memory-gb", "64", "--host-memory-gb", "0"]) == 2
    assert "--host-memory-gb must be > 0" in capsys.readouterr().err
    assert main(["plan", mixtral, "--gpu-memory-gb", "64", "--host-memory-gb", "20", "--compression-ratio",
                 "0.68"]) == 0
    text = capsys.readouterr().out
    assert "host memory limit 20.00 GiB" in text and "does not fit: host tier 84.00 > host limit 20.00 GiB" in text
    assert main(["plan", mixtral, "--gpu-memory-gb", "64"]) == 0
    assert "host memory limit" not in capsys.readouterr().out
