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
