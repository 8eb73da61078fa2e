"""`pagedmoe plan --num-gpus N`: the engine's layout over N GPUs (`--tensor-parallel-size N
--enable-expert-parallel`: backbone sharded, experts split evenly, every rank running the same tokens);
the full-size DeepSeek-V3 / GLM-4.5 configs; numbers checked by hand."""
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pagedmoe.planning.kv_sizing import GiB
from pagedmoe.planning.cost_model import H200, StepTraffic, decode_step_cost, expected_distinct_experts
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import Placement
from pagedmoe.planning.planner import PlanInputs, minimum_budget_bytes, plan_memory, plan_placement

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
KW = dict(max_model_len=2048, workload=(1024, 1024), max_num_seqs=256)
ACT = 3 * GiB


@pytest.fixture(scope="module")
def v3():
    return ModelShape.from_hf_config(CONFIGS / "deepseek-v3")


def test_full_size_configs_by_hand(v3):
    # DeepSeek-V3: 671B parameters without the MTP layer, ~37B active; the cache holds the MLA latent,
    # 61 layers x (512 + 64) x 2 bytes.
    expert = 3 * 7168 * 2048
    assert (v3.num_moe_layers, v3.num_experts, v3.expert_params) == (58, 256, expert)
    assert v3.kv_bytes_per_token == 61 * 576 * 2
    assert v3.backbone_params + v3.num_expert_slots * expert == pytest.approx(671.03e9, rel=1e-4)
    assert v3.active_params_per_token == pytest.approx(36.6e9, rel=1e-2)
    glm = ModelShape.from_hf_config(CONFIGS / "glm-4.5")
    assert (glm.num_moe_layers, glm.num_experts, glm.top_k) == (89, 160, 8)
    assert glm.backbone_params + glm.num_expert_slots * glm.expert_params == pytest.approx(352.8e9, rel=1e-3)
    assert glm.kv_bytes_per_token == 92 * 2 * 8 * 128 * 2
    # DeepSeek-V2-Lite: 15.7B (2.4B active), no q low rank, 27 layers x (512 + 64) x 2 bytes of KV.
    lite = ModelShape.from_hf_config(CONFIGS / "deepseek-v2-lite")
    assert lite.backbone_params + lite.num_expert_slots * lite.expert_params == pytest.approx(15.706e9, rel=1e-4)
    assert lite.active_params_per_token == pytest.approx(2.45e9, rel=1e-2)
    assert (lite.q_lora_rank, lite.kv_bytes_per_token) == (0, 27 * 576 * 2)


def test_one_gpu_plans_unchanged(v3):
    plans = [plan_memory(s, 130 * GiB, ACT, "auto", **KW) for s in (v3, replace(v3, num_gpus=1))]
    assert plans[0] == plans[1]


@pytest.fixture(scope="module")
def glm():
    return ModelShape.from_hf_config(CONFIGS / "glm-4.5")


def test_split_and_step_by_hand(glm):
    N = 8
    g8 = ModelShape.from_hf_config(CONFIGS / "glm-4.5", tensor_parallel_size=N, expert_parallel=True)
    # one rank: 12 of 96 query heads, 1 of 8 KV heads, 20 of the 160 experts the router picks from
    assert (g8.num_heads, g8.num_kv_heads, g8.num_experts, g8.experts_per_gpu) == (12, 1, 160, 20)
    assert (g8.num_gpus, g8.tensor_parallel_size) == (N, N)
    assert g8.kv_bytes_per_token * N == glm.kv_bytes_per_token
    assert g8.all_expert_bytes * N == glm.all_expert_bytes and g8.expert_bytes == glm.expert_bytes
    assert g8.backbone_bytes < glm.backbone_bytes / 2                      # sharded, not replicated
    inputs = PlanInputs(g8, 130 * GiB, ACT, buffers="vmm", **KW)
    L = g8.num_moe_layers
    # Resident on each rank: its backbone share, L x 20 experts, plus one sequence of its KV heads.
    need = g8.backbone_bytes + ACT + L * 20 * g8.expert_bytes + 128 * 16 * g8.kv_bytes_per_token
    assert minimum_budget_bytes(inputs, Placement.resident(L, 20)) == need
    plan = plan_placement(inputs, Placement.uniform(L, 20, 12))
    assert plan.host_tier_bytes == L * 8 * plan.expert_slot_bytes      # each rank streams its own share
    assert plan.traffic.h2d_bytes == L * 8 * g8.expert_bytes
    # One decode step of B sequences: the same B tokens on every rank route over all 160 experts; this rank
    # reads the distinct ones of its 20 and runs 1/8 of the token-expert pairs; every decoder layer
    # all-reduces its attention and FFN outputs (a ring sends 2 (N - 1) / N of B x H from each GPU).
    B, ctx = 100, 1536.0
    cost = decode_step_cost(g8, H200, StepTraffic(), B, ctx)
    routed = L * expected_distinct_experts(160, 8, B) * 20 / 160
    hbm = (g8.backbone_read_bytes + routed * g8.expert_bytes + B * ctx * g8.kv_bytes_per_token
           + B * g8.kv_bytes_per_token)
    assert cost.hbm_s * H200.hbm_bytes_per_s == pytest.approx(hbm)
    experts_flops = 2 * L * 8 * glm.expert_params / N
    assert g8.flops_per_token(0) == pytest.approx(2 * g8._backbone_matmul_params() + experts_flops)
    assert cost.comm_s == pytest.approx(2 * 92 * B * 5120 * 2 * (7 / 8) * 2 / H200.nvlink_bytes_per_s)
    assert decode_step_cost(glm, H200, StepTraffic(), B, ctx).comm_s == 0
    assert cost.total_s == pytest.approx(cost.floor_s + cost.fill_s + cost.overhead_s + cost.comm_s)
    e = plan.estimate
    assert e.output_throughput == pytest.approx(e.num_seqs * 1024 / e.cycle_s)   # the engine's, not N times


def test_bad_num_gpus(v3):
    with pytest.raises(ValueError, match="num_gpus"):
        replace(v3, num_gpus=0)
    with pytest.raises(ValueError, match="num_gpus"):
        replace(v3, num_gpus=257)
    with pytest.raises(ValueError, match="tensor_parallel_size 8"):
        replace(v3, num_gpus=8)          # experts split only within the engine's tensor-parallel ranks


def test_plan_cli_num_gpus_is_the_engines_layout(plan_report, capsys):
    from pagedmoe.cli import main

    glm = CONFIGS / "glm-4.5"
    text, report = plan_report(glm, "--gpu-memory-gb", "130", "--num-gpus", "1", "8")
    assert "8 x H200, as the engine runs --tensor-parallel-size 8 --enable-expert-parallel" in text
    assert "allred" in text
    one, eight = report["budgets"]
    assert (one["num_gpus"], eight["num_gpus"], eight["experts_per_gpu"]) == (1, 8, 20)
    auto1 = next(r for r in one["rows"] if r["auto"])
    auto8 = next(r for r in eight["rows"] if r["auto"])
    assert auto8["backbone_bytes"] < auto1["backbone_bytes"] / 2          # sharded
    assert auto8["host_tier_bytes"] < auto1["host_tier_bytes"] / 7        # each GPU streams its share
    # --num-gpus 8 plans exactly what --tensor-parallel-size 8 --enable-expert-parallel plans
    _, tp = plan_report(glm, "--gpu-memory-gb", "130", "--tensor-parallel-size", "8", "--enable-expert-parallel")
    assert tp["budgets"][0]["rows"] == eight["rows"]
    assert main(["plan", str(glm), "--gpu-memory-gb", "130", "--num-gpus", "0"]) == 2
    assert main(["plan", str(glm), "--gpu-memory-gb", "130", "--num-gpus", "8", "--num-gpu-experts", "21"]) == 2
    assert main(["plan", str(glm), "--gpu-memory-gb", "130", "--num-gpus", "7"]) == 2       # 96 heads
    err = capsys.readouterr().err
    assert "does not divide the model's 96 attention heads" in err
    # MLA splits its heads as the engine does (the latent replicated): DeepSeek-V3 plans on 8 GPUs
    assert main(["plan", str(CONFIGS / "deepseek-v3"), "--gpu-memory-gb", "130", "--num-gpus", "8"]) == 0
    assert "one rank of 8" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["deepseek-v3", "glm-4.5", "deepseek-v2-lite"])
def test_full_size_module_tree_matches_the_shape(name):
    """The real configs build (on the meta device) into the module tree the shape counts."""
    import torch

    from pagedmoe.models.loader import load_hf_config
    from pagedmoe.models.moe_decoder import MoEForCausalLM
    from pagedmoe.models.registry import spec_builder

    cfg = load_hf_config(str(CONFIGS / name))
    dims, spec = spec_builder(cfg)(cfg)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg, dims, spec, 4096)
    shape = ModelShape.from_model_dims(dims, spec)
    assert shape == replace(ModelShape.from_hf_config(CONFIGS / name), name="")
    assert shape.backbone_params == sum(p.numel() for p in model.parameters())
    if name == "deepseek-v3":
        m = dims.mla
        assert (m.q_lora_rank, m.kv_lora_rank, m.latent_dim) == (1536, 512, 576)
        assert (dims.num_kv_heads, dims.head_dim) == (1, 288)   # the cache pair: the latent split in two
        # YaRN factor 40, mscale_all_dim 1: softmax scale 192^-0.5 x (0.1 ln 40 + 1)^2
        assert m.scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
        assert (spec.router, spec.n_group, spec.topk_group, spec.num_mtp_layers) == ("sigmoid_grouped", 8, 4, 1)
        assert dims.rope_interleaved and dims.rope_parameters["rope_type"] == "yarn"
