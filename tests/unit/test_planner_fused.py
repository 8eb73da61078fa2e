"""The fused lossless tier in the planner (issue 23, opt-in): the MoE GEMM reads the compressed experts itself
(kernels/fused_moe_lossless.py), so they cost no decode pass and no buffer rows; their routed reads cost the
kernel's measured time, FUSED_LOSSLESS_TIME_FACTOR bf16 reads each (2.8 on the H200). Numbers checked by hand on
the Mixtral-8x7B shape."""
import pytest

from pagedmoe.planning.kv_sizing import GiB
from pagedmoe.planning.cost_model import H200, StepTraffic, decode_step_cost, expected_distinct_experts
from pagedmoe.planning.placement import Placement
from pagedmoe.planning.planner import PlanInputs, plan_memory, plan_placement
from pagedmoe.planning.plans import FUSED_LOSSLESS_PLANNING_RATIO, FUSED_LOSSLESS_TIME_FACTOR as F

from test_planner import ACT, CONFIGS, EXPERT, KW, MIXTRAL

R = FUSED_LOSSLESS_PLANNING_RATIO


def _plans(placement):
    base = dict(max_model_len=2048, workload=(1024, 1024))
    unfused = plan_placement(PlanInputs(MIXTRAL, 91 * GiB, ACT, **base), placement)
    fused = plan_placement(PlanInputs(MIXTRAL, 91 * GiB, ACT, fused_compressed=True, **base), placement)
    return unfused, fused


def test_every_expert_in_the_fused_tier():
    unfused, fused = _plans(Placement.uniform(32, 8, 0, 8, compression_ratio=R))
    d, u = fused.estimate.decode, unfused.estimate.decode
    assert d.decode_s == 0 and d.pcie_s == 0 and d.fill_s == 0 and u.decode_s > 0
    assert fused.buffer_bytes == 0 and unfused.buffer_bytes == 2 * 8 * EXPERT  # nothing lands in a buffer
    assert fused.compressed_expert_bytes == unfused.compressed_expert_bytes == 256 * int(EXPERT * R)
    # HBM: the routed experts at F bf16 reads each (the kernel's measured time), no decoder traffic; the rest of
    # the step is unchanged
    seqs, ctx = fused.estimate.num_seqs, 1024 + 1024 / 2
    routed = 32 * expected_distinct_experts(8, 2, seqs) * EXPERT
    read_fused = decode_step_cost(MIXTRAL, H200, StepTraffic(routed_read_factor=F), seqs, ctx)
    read_bf16 = decode_step_cost(MIXTRAL, H200, StepTraffic(), seqs, ctx)
    assert d.hbm_s == pytest.approx(read_fused.hbm_s, rel=1e-12)
    assert (d.hbm_s - read_bf16.hbm_s) * H200.hbm_bytes_per_s == pytest.approx(routed * (F - 1), rel=1e-9)


def test_partly_fused_layer_reads_the_mix():
    # 2 resident, 4 fused-compressed, 2 host experts per layer: the GEMMs read 2/8 + 2/8 + 4/8 * R of bf16
    unfused, fused = _plans(Placement.uniform(32, 8, 2, 4, compression_ratio=R))
    assert fused.buffer_bytes == 2 * 2 * EXPERT and unfused.buffer_bytes == 2 * 6 * EXPERT
    assert fused.estimate.decode.decode_s == 0
    assert fused.estimate.decode.pcie_s == pytest.approx(unfused.estimate.decode.pcie_s)  # host copies unchanged


def test_search_prefers_the_fused_tier_only_when_asked():
    fused = plan_memory(MIXTRAL, MIXTRAL.weight_bytes + 4 * GiB, ACT, "auto", compression_ratio=R,
                        fused_compressed=True, **KW)
    v1 = plan_memory(MIXTRAL, MIXTRAL.weight_bytes + 4 * GiB, ACT, "auto", compression_ratio=0.683, **KW)
    plain = plan_memory(MIXTRAL, MIXTRAL.weight_bytes + 4 * GiB, ACT, "auto", **KW)
    assert fused.placement.total_compressed == 256 and fused.estimate.decode.decode_s == 0
    # at the kernel's measured speed the fused tier still beats paging bf16 experts, not the decoding v1 tier
    assert v1.output_throughput > fused.output_throughput > plain.output_throughput


def test_plan_cli_fused_compression(capsys):
    from pagedmoe.cli import main

    mixtral = str(CONFIGS / "mixtral-8x7b")
    assert main(["plan", mixtral, "--gpu-memory-gb", "weights+4", "--fused-compression"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("*"))
    assert "C=8" in line
    assert main(["plan", mixtral, "--gpu-memory-gb", "weights+4", "--compression-ratio", "0.683"]) == 0
    v1 = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("*"))
    assert float(line.split()[-1]) < float(v1.split()[-1])  # modelled output tok/s: see the test above


def test_resolver_plans_both_hibyte_flavours_at_the_held_tiers_bytes():
    # fused-hibyte (fast kernel) and fused-hibyte-exact hold the same bytes (version 3, tile_major order: one copy,
    # as many bytes as the row order), so one plan at FUSED_HIBYTE_PLANNING_RATIO, at or above what the tier holds
    import torch

    from pagedmoe.codecs import hibyte
    from pagedmoe.config import EngineConfig
    from pagedmoe.models.hf_config import load_hf_config
    from pagedmoe.models.registry import spec_builder
    from pagedmoe.planning.plans import FUSED_HIBYTE_PLANNING_RATIO
    from pagedmoe.planning.resolve import resolve_expert_plan

    hf = load_hf_config(CONFIGS / "qwen3-30b-a3b")
    dims, spec = spec_builder(hf)(hf)
    expert = 3 * dims.hidden_size * dims.moe_intermediate_size * 2

    def plan(gemm):
        c = EngineConfig(device="cuda", expert_compression="lossless", compressed_gemm=gemm, max_num_seqs=64,
                         gpu_memory_gb=48, max_model_len=2048, dtype="bfloat16")
        return resolve_expert_plan(c, dims, spec, device_type="cuda", dtype=torch.bfloat16, max_model_len=2048,
                                   budget=lambda: 48 * GiB, host_budget=lambda: None, eager=False)

    # (the engine sets plan.compressed_gemm after); the two kernels' times differ (plans.FUSED_TIER_MODELS), so
    # their splits may too: each compressed expert is planned at the same bytes
    for p in (plan("fused-hibyte"), plan("fused-hibyte-exact")):
        n = p.placement_plan.placement.total_compressed
        assert n > 0 and p.placement_plan.compressed_expert_bytes == \
            pytest.approx(n * expert * FUSED_HIBYTE_PLANNING_RATIO, rel=1e-6)
    w = (torch.randn(4, 256, 2048, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    held = hibyte.to_tile_major(hibyte.encode(w, num_parts=4, checksum=False))
    assert held.nbytes == hibyte.encode(w, num_parts=4, checksum=False).nbytes
    assert 0.76 < held.ratio <= FUSED_HIBYTE_PLANNING_RATIO


def test_each_fused_gemm_has_a_tier_model():
    # every --compressed-gemm value whose GEMM reads the tier in place is planned at its own ratio and time
    from pagedmoe.config_sections import FUSED_FORMATS
    from pagedmoe.planning.plans import FUSED_HIBYTE_FAST_TIME_FACTOR, FUSED_TIER_MODELS

    assert set(FUSED_TIER_MODELS) == set(FUSED_FORMATS)
    assert FUSED_TIER_MODELS["fused-hibyte"][1] == FUSED_HIBYTE_FAST_TIME_FACTOR < FUSED_TIER_MODELS["fused"][1]
    # the exact hibyte kernel at its own time (1.2x the fast one's, measured on an H100), not version 2's: the two
    # "exact" kernels share a name, not a speed
    exact = FUSED_TIER_MODELS["fused-hibyte-exact"]
    assert exact == (FUSED_TIER_MODELS["fused-hibyte"][0], round(FUSED_HIBYTE_FAST_TIME_FACTOR * 1.2, 2))
    assert FUSED_TIER_MODELS["fused-hibyte"][1] < exact[1] < FUSED_TIER_MODELS["fused"][1]


def test_a_faster_fused_kernel_streams_fewer_host_experts():
    # Qwen3-30B-A3B at weights + 4 GiB (the engine's w4p run): timed at 2.8 bf16 reads, the step looked long enough
    # to hide ~5 host experts a layer over PCIe; at the fast hibyte kernel's measured 1.05 the same budget keeps
    # more experts in the compressed tier and streams fewer, and models a faster step
    from pagedmoe.planning.model_shape import ModelShape
    from pagedmoe.planning.plans import FUSED_HIBYTE_FAST_TIME_FACTOR, FUSED_HIBYTE_PLANNING_RATIO

    qwen3 = ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b")
    kw = dict(max_model_len=3072, workload=(1024, 1024), compression_ratio=FUSED_HIBYTE_PLANNING_RATIO,
              fused_compressed=True)
    budget = int((qwen3.weight_bytes / GiB + 4) * GiB)
    slow = plan_memory(qwen3, budget, int(2.44 * GiB), "paged", fused_time_factor=F, **kw)
    fast = plan_memory(qwen3, budget, int(2.44 * GiB), "paged", fused_time_factor=FUSED_HIBYTE_FAST_TIME_FACTOR,
                       **kw)
    assert fast.placement.total_host < slow.placement.total_host
    assert fast.placement.total_compressed > slow.placement.total_compressed
    # at 2.8 the copies looked hidden under the kernel's modelled HBM time (the H100 run's step was bound by them)
    assert slow.estimate.decode.pcie_s < slow.estimate.decode.hbm_s
    assert fast.estimate.decode.total_s < slow.estimate.decode.total_s


def test_plan_cli_takes_the_engines_compressed_gemm(capsys):
    from pagedmoe.cli import main

    qwen3 = str(CONFIGS / "qwen3-30b-a3b")
    rows = {}
    for gemm in ("fused", "fused-hibyte"):
        assert main(["plan", qwen3, "--gpu-memory-gb", "weights+4", "--compressed-gemm", gemm]) == 0
        rows[gemm] = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("*"))
    assert "C=" in rows["fused-hibyte"]
    assert float(rows["fused-hibyte"].split()[-1]) > float(rows["fused"].split()[-1])  # modelled output tok/s
    with pytest.raises(SystemExit):  # a value the engine does not take
        main(["plan", qwen3, "--gpu-memory-gb", "weights+4", "--compressed-gemm", "hibyte"])
    assert main(["plan", qwen3, "--gpu-memory-gb", "weights+4", "--fused-compression", "--compressed-gemm",
                 "fused-hibyte"]) != 0
    assert "--fused-compression means --compressed-gemm fused" in capsys.readouterr().err


def _qwen3_resolve(device_type="cuda", budget_gib=None, **flags):
    """The engine's resolver on the Qwen3-30B-A3B shape at weights + 4 GiB (or `budget_gib`), bf16, with `flags`."""
    import torch

    from pagedmoe.config import EngineConfig
    from pagedmoe.models.hf_config import load_hf_config
    from pagedmoe.models.registry import spec_builder
    from pagedmoe.planning.model_shape import ModelShape
    from pagedmoe.planning.resolve import resolve_expert_plan

    hf = load_hf_config(CONFIGS / "qwen3-30b-a3b")
    dims, spec = spec_builder(hf)(hf)
    budget = int(budget_gib * GiB) if budget_gib else ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b").weight_bytes + 4 * GiB
    c = EngineConfig(device=device_type, max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_gb=budget / GiB,
                     max_model_len=3072, dtype="bfloat16", **flags)
    return resolve_expert_plan(c, dims, spec, device_type=device_type, dtype=torch.bfloat16, max_model_len=3072,
                               budget=lambda: budget, host_budget=lambda: None, eager=False), dims


def test_compressed_gemm_auto_reads_the_tier_in_place_where_the_kernel_runs():
    # --compressed-gemm auto (the default): the same plan as asking for fused-hibyte, where it can run (the w4p
    # run: 2192.7 output tok/s against the decoding tier's 1269.2 on the H100)
    auto, _ = _qwen3_resolve(expert_placement="auto", expert_compression="lossless")
    asked, _ = _qwen3_resolve(expert_placement="auto", expert_compression="lossless", compressed_gemm="fused-hibyte")
    decode, _ = _qwen3_resolve(expert_placement="auto", expert_compression="lossless", compressed_gemm="decode")
    assert auto.compressed_gemm == asked.compressed_gemm == "fused-hibyte" and decode.compressed_gemm == "decode"
    assert auto.placement_plan.placement == asked.placement_plan.placement != decode.placement_plan.placement
    assert auto.placement_plan.output_throughput > decode.placement_plan.output_throughput
    # each rule that keeps the decoding tier
    for flags in (dict(moe_backend="grouped_mm"), dict(expert_fetch="routed"), dict(expert_buffers="plain")):
        plan, _ = _qwen3_resolve(expert_placement="auto", expert_compression="lossless", **flags)
        assert plan.compressed_gemm == ("fused-hibyte" if "expert_buffers" in flags else "decode"), flags
    # no compressed tier asked for (the stream search models none): nothing to read in place
    assert _qwen3_resolve(expert_placement="auto")[0].compressed_gemm == "decode"
    # a fixed placement: in place only where its fetch is stream for certain (auto keeps its fetch's choice)
    fixed = dict(num_gpu_experts=2, num_compressed_experts=100)
    assert _qwen3_resolve(expert_fetch="stream", **fixed)[0].compressed_gemm == "fused-hibyte"
    assert _qwen3_resolve(**fixed)[0].compressed_gemm == "decode"
    # a budget that holds every expert resident: no tier at all
    assert _qwen3_resolve(budget_gib=120, expert_placement="auto", expert_compression="lossless")[0].mode == "resident"


def test_fused_gemm_blocker_names_each_rule():
    import dataclasses

    from pagedmoe.config import EngineConfig
    from pagedmoe.models.hf_config import load_hf_config
    from pagedmoe.models.registry import spec_builder
    from pagedmoe.planning.resolve import fused_gemm_blocker

    hf = load_hf_config(CONFIGS / "qwen3-30b-a3b")
    dims, _ = spec_builder(hf)(hf)
    ok = EngineConfig(device="cuda")
    assert fused_gemm_blocker(ok, dims, "cuda", True) is None
    assert "CUDA" in fused_gemm_blocker(ok, dims, "cpu", True)
    assert "bf16" in fused_gemm_blocker(ok, dims, "cuda", False)
    assert fused_gemm_blocker(EngineConfig(device="cuda", moe_backend="loop"), dims, "cuda", True) == "--moe-backend loop"
    assert fused_gemm_blocker(EngineConfig(device="cuda", expert_precision="dynamic"), dims, "cuda", True) == \
        "--expert-precision dynamic"
    assert fused_gemm_blocker(EngineConfig(device="cuda", expert_fetch="routed"), dims, "cuda", True) == \
        "--expert-fetch routed"
    assert "multiples of 64" in fused_gemm_blocker(ok, dataclasses.replace(dims, moe_intermediate_size=776), "cuda",
                                                   True)
    assert fused_gemm_blocker(EngineConfig(device="cuda", tensor_parallel_size=2), dims, "cuda", True) == \
        "more than one rank"


def test_routed_fetch_refuses_the_tier_read_in_place():
    # the fused tier is read where it lies: --expert-fetch routed names the flag that rules it out, auto streams
    from pagedmoe.config import EngineConfig
    from pagedmoe.planning.fetch_cost import settle_expert_fetch
    from pagedmoe.planning.model_shape import ModelShape

    plan, _ = _qwen3_resolve(expert_placement="auto", expert_compression="lossless")
    shape = ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b")
    auto = EngineConfig(device="cuda", expert_compression="lossless").experts
    assert settle_expert_fetch(auto, plan, shape, 1, "cuda", 1024, lambda: None) == "stream"
    routed = EngineConfig(device="cuda", expert_fetch="routed", num_compressed_experts=4).experts
    with pytest.raises(ValueError, match="--compressed-gemm fused-hibyte"):
        settle_expert_fetch(routed, plan, shape, 1, "cuda", 1024, lambda: None)


def test_plan_cli_compressed_gemm_auto(capsys, tmp_path):
    import json

    from pagedmoe.cli import main

    qwen3 = str(CONFIGS / "qwen3-30b-a3b")
    for extra, want in (([], "decode"), (["--expert-compression", "lossless"], "fused-hibyte"),
                        (["--expert-compression", "lossless", "--expert-fetch", "routed"], "decode"),
                        (["--expert-compression", "lossless", "--num-gpus", "2"], "decode")):
        out = tmp_path / "plan.json"
        assert main(["plan", qwen3, "--gpu-memory-gb", "weights+4", "--json", str(out), *extra]) == 0
        capsys.readouterr()
        assert json.loads(out.read_text())["compressed_gemm"] == want, extra
