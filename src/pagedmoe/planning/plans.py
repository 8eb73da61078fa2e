"""What the planner (planning/planner.py) takes and gives: its inputs, the plan of one placement, and the
errors of a budget that does not fit. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedmoe.config_sections import FUSED_FORMATS, FUSED_KERNELS
from pagedmoe.planning.cost_model import H200, HardwareProfile, StepTraffic, WorkloadEstimate
from pagedmoe.planning.kv_sizing import GiB, BudgetError, KVBlocks
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import Placement


# NOTE: must match experts/layout.py::VMM_GRANULARITY_BYTES (kept here so the planner needs no torch).
VMM_GRANULARITY_BYTES = 2 << 20
# Issue 23, opt-in (`pagedmoe plan --compressed-gemm fused`): the compressed tier in lossless format version 2,
# read by the MoE GEMM itself (kernels/fused_moe_lossless.py), so a compressed expert costs no decode pass and
# its routed reads cost its stored bytes: this ratio of bf16's (docs/formats.md, benchmarks/lossless_formats.py).
# Its time is modelled as measured, not at that floor: FUSED_LOSSLESS_TIME_FACTOR, the fused kernel's MoE layer time
# over the bf16 GEMM's on the H200 (2026-12-02, benchmarks/bench_fused_lossless.py: Mixtral 2.86 / 2.75 / 3.87,
# Qwen3 2.78 / 2.82 / 2.55 at 16 / 64 / 256 tokens; the median), charged as that many bf16 reads of each routed
# fused expert. Behind the explicit flag until a kernel beats bf16 (docs/benchmarks.md, "The fused lossless GEMM").
FUSED_LOSSLESS_PLANNING_RATIO = 0.753
FUSED_LOSSLESS_TIME_FACTOR = 2.8
# --compressed-gemm fused-hibyte(-exact): version 3 (codecs/hibyte.py) holds 0.771 of bf16 on N(0, 0.02) and
# 0.776 on the default model's trained experts; planned at 0.78 (the raw-tile share varies with the weights). The tier
# holds it in the tile_major order only: the same bytes. The fast kernel (fused-hibyte: tile-major bytes decoded in
# the MMA operand registers) measured 0.87-2.30x bf16's time for one MoE layer on the H200 (2026-12-05, row
# tm-k4-warps4: 0.94 / 1.39 / 1.66 Mixtral, 0.89 / 0.87 / 1.10 Qwen3 at 16 / 64 / 256 tokens; median 1.02), so it
# is timed at FUSED_HIBYTE_FAST_TIME_FACTOR. Timed at 2.8 it had looked free to stream host experts under it: the
# engine's Qwen3-30B-A3B step at weights + 4 GiB took 45 ms at batch 64 on an H100, bound by 2.2 GB of PCIe copies a
# step (benchmarks/results/session34). The exact kernel (fused-hibyte-exact, tile-major halves since 2026-12-07)
# measured 1.2x the fast one's time on an H100 (session35, median of 1.10-1.26 over both shapes at 16 / 64 / 256
# tokens; 0.81-1.62x bf16 there): timed at the fast kernel's H200 factor times that, until an H200 measures it.
FUSED_HIBYTE_PLANNING_RATIO = 0.78
FUSED_HIBYTE_FAST_TIME_FACTOR = 1.05
FUSED_HIBYTE_EXACT_TIME_FACTOR = round(FUSED_HIBYTE_FAST_TIME_FACTOR * 1.2, 2)
# --compressed-gemm value -> (planning ratio, time factor) of a compressed tier the GEMM reads in place: the ratio
# by its format (config_sections.FUSED_FORMATS, the engine's own table), the time by its format and kernel
_FUSED_RATIOS = {"tiled": FUSED_LOSSLESS_PLANNING_RATIO, "hibyte": FUSED_HIBYTE_PLANNING_RATIO}
_FUSED_TIMES = {("tiled", "exact"): FUSED_LOSSLESS_TIME_FACTOR, ("hibyte", "fast"): FUSED_HIBYTE_FAST_TIME_FACTOR,
                ("hibyte", "exact"): FUSED_HIBYTE_EXACT_TIME_FACTOR}
FUSED_TIER_MODELS = {gemm: (_FUSED_RATIOS[fmt], _FUSED_TIMES[fmt, FUSED_KERNELS[gemm]])
                     for gemm, fmt in FUSED_FORMATS.items()}


def fused_tier_model(compressed_gemm: str) -> tuple[Optional[float], float]:
    """(ratio, time factor) of the tier `compressed_gemm` reads in place; (None, the v2 factor) when it decodes."""
    return FUSED_TIER_MODELS.get(compressed_gemm, (None, FUSED_LOSSLESS_TIME_FACTOR))
BUFFER_KINDS = ("vmm", "vmm-ring", "plain")
PLACEMENT_MODES = ("resident", "paged", "auto")


class PlacementBudgetError(BudgetError):
    """The budget cannot hold this placement; `min_budget_bytes` is the smallest budget that can."""

    def __init__(self, message: str, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class HostBudgetError(PlacementBudgetError):
    """The placement's host tier does not fit in the host memory limit. `min_budget_bytes` is a device
    budget that would fit the plan within the limit: for one placement, about its minimum budget plus the
    overflowing host experts held resident; from `best_plan`, the cheapest candidate within the limit."""

    def __init__(self, message: str, min_budget_bytes: int, host_tier_bytes: int, host_budget_bytes: int,
                 fits_device: bool) -> None:
        super().__init__(message, min_budget_bytes)
        self.host_tier_bytes = host_tier_bytes
        self.host_budget_bytes = host_budget_bytes
        self.fits_device = fits_device  # the GPU budget would hold it: host memory alone refuses it


HOST_LIMIT_ADVICE = ("keep more experts on the GPU (a larger --gpu-memory-gb, or the lossless compressed GPU tier "
                     "--expert-compression lossless), hold the host tier compressed (--host-compression "
                     "lossless), or raise --host-memory-gb if the machine has more free memory")


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class PlacementPlan(KVBlocks):
    """The split of one budget for one placement, and its modelled performance."""

    placement: Placement
    buffers: str                 # "vmm" | "plain" | "none" (all resident)
    budget_bytes: int
    backbone_bytes: int
    activation_bytes: int
    expert_slot_bytes: int       # one expert as stored (rounded up to the buffer granularity)
    resident_expert_bytes: int
    compressed_expert_bytes: int
    buffer_bytes: int
    host_tier_bytes: int         # pinned host memory, not part of the device budget
    kv_bytes_per_block: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    traffic: StepTraffic
    estimate: WorkloadEstimate

    @property
    def mode(self) -> str:
        return "resident" if self.placement.is_resident else "paged"

    @property
    def device_bytes(self) -> int:
        return (self.backbone_bytes + self.activation_bytes + self.resident_expert_bytes
                + self.compressed_expert_bytes + self.buffer_bytes + self.kv_bytes)

    @property
    def unused_bytes(self) -> int:
        return self.budget_bytes - self.device_bytes

    @property
    def num_seqs(self) -> int:
        return self.estimate.num_seqs

    @property
    def output_throughput(self) -> float:
        return self.estimate.output_throughput

    def summary(self) -> str:
        g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
        p = self.placement
        comp = f", compressed tier {g(self.compressed_expert_bytes)} GiB" if p.total_compressed else ""
        return (f"budget {g(self.budget_bytes)} GiB, experts {p.label()}: backbone {g(self.backbone_bytes)} GiB, "
                f"resident experts {g(self.resident_expert_bytes)} GiB{comp}, host tier {g(self.host_tier_bytes)} "
                f"GiB (pinned), expert buffers {g(self.buffer_bytes)} GiB, activations {g(self.activation_bytes)} "
                f"GiB, KV cache {g(self.kv_bytes)} GiB ({self.num_kv_blocks} blocks, "
                f"{self.kv_capacity_tokens} tokens)")

    def to_dict(self) -> dict:
        names = ("budget_bytes", "backbone_bytes", "activation_bytes", "expert_slot_bytes", "resident_expert_bytes",
                 "compressed_expert_bytes", "buffer_bytes", "host_tier_bytes", "kv_bytes_per_block",
                 "num_kv_blocks", "block_size", "max_model_len", "kv_bytes", "kv_capacity_tokens",
                 "unused_bytes", "mode", "buffers")
        return {"placement": self.placement.to_dict(), **{n: getattr(self, n) for n in names},
                "traffic": {"h2d_bytes": self.traffic.h2d_bytes, "d2d_bytes": self.traffic.d2d_bytes,
                            "decode_out_bytes": self.traffic.decode_out_bytes,
                            "decode_in_bytes": self.traffic.decode_in_bytes},
                "workload": self.estimate.to_dict()}


@dataclass(frozen=True)
class PlanInputs:
    """Everything but the placement: what `plan_placement` needs to size and cost one plan."""

    shape: ModelShape
    budget_bytes: int
    activation_bytes: int
    max_model_len: int
    block_size: int = 16
    workload: Optional[tuple[int, int]] = None   # (input_len, output_len); None: min(1024, max_model_len // 2) each
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    hw: HardwareProfile = H200
    backbone_bytes: Optional[int] = None         # measured; None: from the shape
    max_kv_blocks: Optional[int] = None          # cap on useful KV blocks (the rest stays unused)
    buffers: str = "vmm"
    host_compression_ratio: float = 0.0          # --host-compression lossless: the host tier's ratio (0: raw)
    host_budget_bytes: Optional[int] = None      # pinned host memory the host tier may take (None: unbounded)
    fused_compressed: bool = False               # the compressed tier is read by the GEMM (issue 23), not decoded
    fused_time_factor: float = FUSED_LOSSLESS_TIME_FACTOR  # its routed expert's time, in bf16 reads

    def __post_init__(self) -> None:
        if self.buffers not in BUFFER_KINDS:
            raise ValueError(f"buffers must be one of {', '.join(BUFFER_KINDS)}; got {self.buffers!r}")
        if self.host_budget_bytes is not None and self.host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0 (None: unbounded), got {self.host_budget_bytes}")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.workload is None:
            n = max(1, min(1024, self.max_model_len // 2))
            object.__setattr__(self, "workload", (n, n))
        input_len, output_len = self.workload
        if input_len < 1 or output_len < 1 or input_len + output_len > self.max_model_len:
            raise ValueError(f"workload {input_len} in + {output_len} out must be >= 1 each and fit in "
                             f"max_model_len={self.max_model_len}")

    @property
    def kv_bytes_per_block(self) -> int:
        return self.shape.kv_bytes_per_token * self.block_size

    @property
    def min_kv_blocks(self) -> int:
        """One sequence of max_model_len tokens."""
        return -(-self.max_model_len // self.block_size)
