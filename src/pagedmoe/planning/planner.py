"""Memory planner: one device budget -> backbone, activations, expert tiers, expert buffers, KV blocks.

Pure Python (no torch): the engine calls `plan_memory` at start-up with a `ModelShape` and measured
sizes; `pagedmoe plan` calls it from a config.json alone. The cost model is in planning/cost_model.py.

Device budget = backbone + activations + resident experts + compressed tier + expert buffers + KV blocks
(+ less than one block left over, or more when `max_kv_blocks` caps the KV cache). The host tier lives
in pinned host memory, outside the budget, bounded by `host_budget_bytes` when given (a placement whose
host tier exceeds it raises HostBudgetError; the search then keeps more experts on the GPU, resident or
in the compressed tier).

Expert buffers: streamed experts (host or compressed tier) land in stable-address compute buffers for
two MoE layers at a time. With CUDA VMM buffers ("vmm", the H200 default) resident experts are mapped
into the layer's range, so the physical buffers hold 2 * (largest number of streamed experts of a
layer) expert slots, and every expert slot is rounded up to the 2 MiB mapping granularity. With the
plain double buffer ("plain") each buffer holds all E experts and resident rows are copied in too
(device to device, every step). The all-resident placement has no buffers.

Expert parallelism (`ModelShape.num_gpus` = N): the plan is one GPU's, which holds the backbone
(replicated) and ceil(E / N) experts of every MoE layer; placements count those experts per layer.

Later tiers slot in as further per-layer counts of `Placement` with their own bytes per expert: the
lossless compressed tier (issue 6) is modelled already (`num_compressed_experts`, `compression_ratio`);
lower precisions (issue 7) would add counts per precision the same way.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

from pagedmoe.planning.kv_sizing import GiB
from pagedmoe.planning.cost_model import (H200, HardwareProfile, StepTraffic, estimate_workload,
                                         ring_wait_layers)
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import HOST_STAGING_SLOTS, Placement, host_group_experts
from pagedmoe.planning.plans import (BUFFER_KINDS, FUSED_LOSSLESS_TIME_FACTOR, HOST_LIMIT_ADVICE, PLACEMENT_MODES,
                                     VMM_GRANULARITY_BYTES,
                                     HostBudgetError, PlacementBudgetError, PlacementPlan, PlanInputs, round_up)

__all__ = ["BUFFER_KINDS", "PLACEMENT_MODES", "VMM_GRANULARITY_BYTES", "HostBudgetError", "PlacementBudgetError",
           "PlacementPlan", "PlanInputs", "host_tier_bytes", "minimum_budget_bytes", "plan_placement", "best_plan",
           "auto_candidates", "host_limited_candidates", "plan_memory"]


def _slot_bytes(shape: ModelShape, placement: Placement, buffers: str) -> int:
    """One expert row as the store lays it out: padded to the VMM mapping granularity when streamed experts
    land in VMM buffers (experts/layout.py), else to 16 bytes."""
    vmm = buffers in ("vmm", "vmm-ring")
    return round_up(shape.expert_bytes, VMM_GRANULARITY_BYTES if not placement.is_resident and vmm else 16)


def host_tier_bytes(shape: ModelShape, placement: Placement, buffers: str = "vmm",
                    host_compression_ratio: float = 0.0) -> int:
    """Pinned host memory the placement's host tier takes: one padded row per host expert, or each expert's
    compressed bytes under --host-compression lossless."""
    one = (int(shape.expert_bytes * host_compression_ratio) if host_compression_ratio
           else _slot_bytes(shape, placement, buffers))
    return placement.total_host * one


def _sizes(inputs: PlanInputs, placement: Placement) -> dict:
    shape = inputs.shape
    # a fused compressed tier is read in place by the GEMM: only host experts pass through the buffers
    buffered = placement.max_host if inputs.fused_compressed else placement.max_streamed
    streamed = buffered > 0
    vmm = inputs.buffers in ("vmm", "vmm-ring")
    slot = _slot_bytes(shape, placement, inputs.buffers)
    if not streamed:
        buffer_slots = 0
    elif vmm:
        buffer_slots = 2 * buffered
    else:
        buffer_slots = 2 * shape.experts_per_gpu
    buffer_slots = buffer_slots if shape.num_moe_layers > 1 else buffer_slots // 2
    compressed_one = int(shape.expert_bytes * placement.compression_ratio)
    backbone = shape.backbone_bytes if inputs.backbone_bytes is None else inputs.backbone_bytes
    # A compressed host tier: its bytes cross PCIe into one of two device staging slots of a group of experts
    # (experts/store.py), then the decoder writes bf16 into the compute rows.
    hr = inputs.host_compression_ratio
    host_one = int(shape.expert_bytes * hr) if hr else shape.expert_bytes
    group = min(host_group_experts(shape.expert_bytes), placement.max_host)
    staging = HOST_STAGING_SLOTS * group * host_one if hr and placement.total_host else 0
    decoded_host = placement.total_host if hr else 0
    fused = placement.total_compressed if inputs.fused_compressed else 0  # compressed experts never decoded
    in_tiers = shape.num_moe_layers * shape.experts_per_gpu
    return {
        "expert_slot_bytes": slot, "backbone_bytes": backbone, "resident_expert_bytes": placement.total_gpu * slot,
        "compressed_expert_bytes": placement.total_compressed * compressed_one,
        "buffer_bytes": buffer_slots * slot + staging,
        "host_tier_bytes": host_tier_bytes(shape, placement, inputs.buffers, hr),
        "traffic": StepTraffic(
            # Copies move an expert's weights, not its slot padding.
            h2d_bytes=placement.total_host * host_one,
            d2d_bytes=2 * placement.total_gpu * shape.expert_bytes if streamed and inputs.buffers == "plain" else 0,
            decode_out_bytes=(placement.total_compressed - fused + decoded_host) * shape.expert_bytes,
            decode_in_bytes=(placement.total_compressed - fused) * compressed_one + decoded_host * host_one,
            layer_copy_shares=_copy_shares(shape, inputs.hw, placement, hr, bool(fused)),
            layer_copy_waits=_ring_waits(placement) if streamed and inputs.buffers == "vmm-ring" else (),
            # routing is modelled uniform: a fraction fused / in_tiers of the routed experts is read by the fused
            # kernel, at its measured time (plans.py: fused_time_factor bf16 reads each)
            routed_read_factor=1.0 + fused / in_tiers * (inputs.fused_time_factor - 1.0) if fused else 1.0),
    }


def _ring_waits(placement: Placement) -> tuple[int, ...]:
    """ring_wait_layers for the rows experts/buffers.py gives this placement (streamed rows layer by layer)."""
    rows, k = [], 0
    for layer in range(len(placement.num_gpu_experts)):
        n = placement.num_streamed(layer)
        rows.append(list(range(k, k + n)))
        k += n
    return tuple(ring_wait_layers(rows, 2 * placement.max_streamed))


def _copy_shares(shape, hw, placement: Placement, host_ratio: float = 0.0, fused: bool = False) -> tuple[float, ...]:
    """Each MoE layer's share of the copy stream's time: its host experts over PCIe (compressed: then
    through the decoder too), then its compressed ones through the decoder (one stream, in order; none when
    the GEMM reads the compressed tier itself)."""
    host_s = (host_ratio / hw.pcie_h2d_bytes_per_s + 1 / hw.lossless_decode_bytes_per_s if host_ratio
              else 1 / hw.pcie_h2d_bytes_per_s)
    comp_s = 0.0 if fused else 1 / hw.lossless_decode_bytes_per_s
    per_layer = [(placement.num_experts - g - c) * host_s + c * comp_s
                 for g, c in zip(placement.num_gpu_experts, placement.num_compressed_experts)]
    total = sum(per_layer)
    return tuple(x / total for x in per_layer) if total > 0 else ()


def _fixed_bytes(inputs: PlanInputs, s: dict) -> int:
    return (s["backbone_bytes"] + inputs.activation_bytes + s["resident_expert_bytes"]
            + s["compressed_expert_bytes"] + s["buffer_bytes"])


def minimum_budget_bytes(inputs: PlanInputs, placement: Placement) -> int:
    """The smallest budget that holds `placement` and one max_model_len sequence."""
    return _fixed_bytes(inputs, _sizes(inputs, placement)) + inputs.min_kv_blocks * inputs.kv_bytes_per_block


def plan_placement(inputs: PlanInputs, placement: Placement) -> PlacementPlan:
    """Size one placement: KV blocks get everything left; raises PlacementBudgetError if it cannot fit."""
    shape = inputs.shape
    if placement.num_experts != shape.experts_per_gpu or len(placement.num_gpu_experts) != shape.num_moe_layers:
        raise ValueError(f"placement for {len(placement.num_gpu_experts)} layers x {placement.num_experts} "
                         f"experts does not match the model ({shape.num_moe_layers} x {shape.experts_per_gpu}"
                         f" per GPU)")
    s = _sizes(inputs, placement)
    free = inputs.budget_bytes - _fixed_bytes(inputs, s)
    per_block = inputs.kv_bytes_per_block
    num_blocks = max(free, 0) // per_block
    g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    host, limit = s["host_tier_bytes"], inputs.host_budget_bytes
    if limit is not None and host > limit:
        # Checked before the device budget so that every plain PlacementBudgetError is a placement within
        # the host limit: best_plan's cheapest budget then never names one the host cannot hold.
        per_host = host // placement.total_host
        overflow = -(-(host - limit) // per_host)
        need = minimum_budget_bytes(inputs, placement) + overflow * s["expert_slot_bytes"]
        raise HostBudgetError(
            f"placement {placement.label()} needs a host tier of {g(host)} GiB of pinned host memory, over the "
            f"host memory limit of {g(limit)} GiB ({overflow} experts too many); {HOST_LIMIT_ADVICE}",
            need, host, limit, num_blocks >= inputs.min_kv_blocks)
    if num_blocks < inputs.min_kv_blocks:
        need = minimum_budget_bytes(inputs, placement)
        raise PlacementBudgetError(
            f"a budget of {g(inputs.budget_bytes)} GiB cannot hold placement {placement.label()}: backbone "
            f"{g(s['backbone_bytes'])} + resident experts {g(s['resident_expert_bytes'])} + compressed "
            f"{g(s['compressed_expert_bytes'])} + expert buffers {g(s['buffer_bytes'])} + activations "
            f"{g(inputs.activation_bytes)} + one sequence of max_model_len={inputs.max_model_len} "
            f"{g(inputs.min_kv_blocks * per_block)} GiB; it needs {g(need)} GiB", need)
    if inputs.max_kv_blocks is not None:
        num_blocks = min(num_blocks, max(inputs.max_kv_blocks, inputs.min_kv_blocks))
    input_len, output_len = inputs.workload
    blocks_per_seq = -(-(input_len + output_len) // inputs.block_size)
    num_seqs = min(inputs.max_num_seqs, num_blocks // blocks_per_seq)
    estimate = estimate_workload(shape, inputs.hw, s["traffic"], num_seqs, input_len, output_len,
                                 inputs.max_num_batched_tokens)
    buffers = inputs.buffers if not placement.is_resident else "none"
    return PlacementPlan(placement, buffers, inputs.budget_bytes, s["backbone_bytes"], inputs.activation_bytes,
                      s["expert_slot_bytes"], s["resident_expert_bytes"], s["compressed_expert_bytes"],
                      s["buffer_bytes"], s["host_tier_bytes"], per_block, int(num_blocks), inputs.block_size,
                      inputs.max_model_len, s["traffic"], estimate)


def best_plan(inputs: PlanInputs, candidates: Iterable[Placement]) -> PlacementPlan:
    """The candidate with the best modelled output throughput (ties: more resident experts). When none fits,
    the error names the cheapest placement within the host memory limit, and says when that limit is why."""
    best, cheapest, host_err = None, None, None
    for placement in candidates:
        try:
            plan = plan_placement(inputs, placement)
        except HostBudgetError as e:  # its min_budget_bytes is an estimate: kept apart from `cheapest`
            if host_err is None or (e.fits_device, -e.host_tier_bytes) > (host_err.fits_device,
                                                                           -host_err.host_tier_bytes):
                host_err = e
            continue
        except PlacementBudgetError as e:
            if cheapest is None or e.min_budget_bytes < cheapest.min_budget_bytes:
                cheapest = e
            continue
        key = (plan.output_throughput, placement.total_gpu, -placement.total_compressed)
        if best is None or key > best[0]:
            best = (key, plan)
    if best is not None:
        return best[1]
    if cheapest is None and host_err is None:
        raise ValueError("no placement to choose from")
    if host_err is None:
        raise PlacementBudgetError(f"no placement fits; the cheapest: {cheapest}", cheapest.min_budget_bytes)
    limit = f"{host_err.host_budget_bytes / GiB:.2f}"
    if cheapest is None:
        raise HostBudgetError(f"no placement fits the host memory limit of {limit} GiB; the least host memory: "
                              f"{host_err}", host_err.min_budget_bytes, host_err.host_tier_bytes,
                              host_err.host_budget_bytes, host_err.fits_device)
    within = f"within the host memory limit of {limit} GiB the cheapest: {cheapest}"
    if host_err.fits_device:
        raise HostBudgetError(
            f"no placement fits: host memory is the limit. Placements the GPU budget holds need more pinned host "
            f"memory than the limit (e.g. {host_err}); {within}", cheapest.min_budget_bytes,
            host_err.host_tier_bytes, host_err.host_budget_bytes, True)
    raise PlacementBudgetError(f"no placement fits; {within}", cheapest.min_budget_bytes)


def auto_candidates(shape: ModelShape, compression_ratio: Optional[float] = None,
                    paged_only: bool = False) -> list[Placement]:
    """Uniform placements: N resident per layer in 0..E (and C compressed in 0..E-N with a ratio)."""
    L, E = shape.num_moe_layers, shape.experts_per_gpu
    out = []
    for n in range(E if paged_only else E + 1):
        for c in range(E - n + 1) if compression_ratio else (0,):
            if paged_only and n + c == E and c == 0:
                continue
            out.append(Placement.uniform(L, E, n, c, compression_ratio or 0.0))
    return out


def host_limited_candidates(inputs: PlanInputs, compression_ratio: Optional[float] = None,
                            paged_only: bool = False) -> list[Placement]:
    """Under a host memory limit, the placements whose host tier just fits it: the experts it cannot hold
    resident (spread evenly), or for each N resident per layer held compressed (spread evenly). Uniform
    counts step a whole expert per layer (L experts), too coarse to meet a limit closely."""
    shape, limit = inputs.shape, inputs.host_budget_bytes
    L, E = shape.num_moe_layers, shape.experts_per_gpu
    if limit is None or L * E == 0:
        return []
    per_host = _sizes(inputs, Placement.uniform(L, E, 0))["host_tier_bytes"] // (L * E)
    on_gpu = L * E - min(L * E, limit // per_host)
    if on_gpu <= 0:
        return []
    out = [] if paged_only and on_gpu == L * E else [Placement.spread(L, E, on_gpu)]
    for n in range(E) if compression_ratio else ():
        compressed = on_gpu - n * L
        if compressed <= 0:
            break
        if compressed <= (E - n) * L:
            base, extra = divmod(compressed, L)
            out.append(Placement(E, (n,) * L, tuple(base + (i < extra) for i in range(L)), compression_ratio))
    return out


def _refine(inputs: PlanInputs, plan: PlacementPlan, paged_only: bool) -> PlacementPlan:
    """Around the best N, try every total resident count within one expert per layer (spread evenly),
    keeping the compressed counts: one more resident expert in a few layers frees less KV than a whole N
    step. Each goes through plan_placement, so the host memory limit holds for the refined plan too."""
    shape, p = inputs.shape, plan.placement
    L, E = shape.num_moe_layers, shape.experts_per_gpu
    n, comp = p.num_gpu_experts[0], p.num_compressed_experts
    c = max(comp, default=0)
    top = (E - c) * L - (1 if paged_only and c == 0 else 0)
    totals = range(max(0, (n - 1) * L), min(top, (n + 1) * L) + 1)
    arrangements = ("last", "even") if inputs.buffers == "vmm-ring" else ("last",)
    spread = [Placement(E, Placement.spread(L, E, t, 0, 0.0, fewer).num_gpu_experts, comp, p.compression_ratio)
              for t in totals for fewer in arrangements]
    return best_plan(inputs, [p, *spread])


def plan_memory(shape: ModelShape, budget_bytes: int, activation_bytes: int, placement_mode: str = "auto",
                num_gpu_experts: Union[int, Sequence[int], None] = None, *, max_model_len: int,
                block_size: int = 16, workload: Optional[tuple[int, int]] = None, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 8192, hw: HardwareProfile = H200,
                backbone_bytes: Optional[int] = None, max_kv_blocks: Optional[int] = None,
                buffers: str = "vmm", compression_ratio: Optional[float] = None,
                host_compression_ratio: float = 0.0, host_budget_bytes: Optional[int] = None,
                fused_compressed: bool = False,
                fused_time_factor: float = FUSED_LOSSLESS_TIME_FACTOR) -> PlacementPlan:
    """Split `budget_bytes` for `placement_mode`:
    - "resident": every expert on the GPU (`num_gpu_experts` must be None or E);
    - "paged": `num_gpu_experts` resident per layer (an int, or one count per MoE layer), the rest
      streamed from the host; None lets the planner pick the best N < E;
    - "auto": the best modelled throughput over N in 0..E (N = E is resident), refined per layer.
    `compression_ratio` (issue 6) adds the lossless compressed tier to the search; `host_compression_ratio`
    holds the host tier compressed (its traffic and decode modelled); `host_budget_bytes` bounds the host tier
    (None: unbounded; over it: HostBudgetError, or the search keeps more experts on the GPU). Raises
    PlacementBudgetError (a BudgetError, a ValueError) naming the minimum budget when nothing fits."""
    if placement_mode not in PLACEMENT_MODES:
        raise ValueError(f"placement_mode must be one of {', '.join(PLACEMENT_MODES)}; got {placement_mode!r}")
    inputs = PlanInputs(shape, int(budget_bytes), int(activation_bytes), max_model_len, block_size, workload,
                        max_num_seqs, max_num_batched_tokens, hw, backbone_bytes, max_kv_blocks, buffers,
                        host_compression_ratio, host_budget_bytes, fused_compressed, fused_time_factor)
    L, E = shape.num_moe_layers, shape.experts_per_gpu
    if num_gpu_experts is not None:
        counts = (num_gpu_experts,) * L if isinstance(num_gpu_experts, int) else tuple(num_gpu_experts)
        if placement_mode == "auto":
            raise ValueError("num_gpu_experts fixes the placement; it cannot be combined with placement 'auto'")
        if len(counts) != L or any(not 0 <= n <= E for n in counts):
            raise ValueError(f"num_gpu_experts must be in [0, {E}] for each of the {L} MoE layers; got "
                             f"{num_gpu_experts}")
        if placement_mode == "resident" and any(n != E for n in counts):
            raise ValueError(f"resident placement keeps all {E} experts per layer; num_gpu_experts "
                             f"{num_gpu_experts} needs placement 'paged'")
        return plan_placement(inputs, Placement(E, counts))
    if placement_mode == "resident":
        return plan_placement(inputs, Placement.resident(L, E))
    paged_only = placement_mode == "paged"
    best = best_plan(inputs, [*auto_candidates(shape, compression_ratio, paged_only),
                              *host_limited_candidates(inputs, compression_ratio, paged_only)])
    return _refine(inputs, best, paged_only) if L > 1 else best
