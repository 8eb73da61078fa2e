"""One resolver from flags to a frozen ExpertPlan: where the experts go, in what form, in which buffers.

The engine (engine/startup.py), `pagedmoe plan` and `bench sweep` read the placement flags through these
functions, so a flag means the same everywhere. Pure Python: the device budget and the host limit come in
as callables (the engine measures them; they are asked for only when the planner needs them).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from pagedmoe.config_sections import fused_format
from pagedmoe.planning import planner, routed_plan
from pagedmoe.planning.kv_sizing import (CUDA_CONTEXT_BYTES, GiB, dynamic_build_bytes, estimate_activation_bytes,
                                         start_up_reserve_bytes)
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import LOSSLESS_PLANNING_RATIO, Placement
from pagedmoe.planning.plans import fused_tier_model

logger = logging.getLogger("pagedmoe")


@dataclass(frozen=True)
class ExpertPlan:
    """Where every expert goes, settled once at start-up (engine/startup.py) and read by experts/build.py."""
    mode: str                                   # "resident" | "paged"
    num_gpu_experts: object = None              # resident experts per MoE layer (tuple), or one int
    num_compressed: Optional[tuple] = None      # compressed (GPU, lossless) experts per MoE layer
    host_compression: str = "none"              # "none" | "lossless": the host tier held compressed
    placement_plan: Optional[planner.PlacementPlan] = None   # the planner's plan when it chose
    buffers: str = "auto"                       # compute buffers: "plain" | "vmm" | "vmm-ring" once settled
    quantized_precision: Optional[str] = None   # static --expert-precision: the lossy format
    quantized_gemm: str = "dequant"             # "direct": the MoE GEMMs read quantized weights
    dynamic_min_precision: Optional[str] = None  # --expert-precision dynamic: the floor
    fetch: str = "stream"                       # "stream" | "routed" (experts/cache.py) once settled
    # routed: forwards of up to this many tokens fetch by path (b), the sync-free UVA gather, and the decode
    # buckets up to it run in CUDA graphs (planning/fetch_cost.py::settle_fetch_path); 0: path (a) everywhere
    sync_free_max_seqs: int = 0
    # routed: forwards of at least this many tokens that do not take path (b) are stream steps (every expert
    # prefetched a layer ahead, no sync: planning/fetch_cost.py::settle_stream_steps); 0: never
    stream_min_tokens: int = 0
    compressed_gemm: str = "decode"             # "fused*": the MoE GEMMs read the compressed tier (FUSED_FORMATS)

    @property
    def paged(self) -> bool:
        return self.mode == "paged"

    def replace(self, **changes) -> "ExpertPlan":
        return dataclasses.replace(self, **changes)


def resolve_placement_flags(expert_placement: Optional[str], num_gpu_experts: Optional[int],
                            cpu_moe: bool) -> tuple[str, Optional[int]]:
    """(mode, N): --cpu-moe is paged N=0, --num-gpu-experts N implies paged; contradictions are errors."""
    if cpu_moe and num_gpu_experts not in (None, 0):
        raise ValueError(f"--cpu-moe pages every expert; it contradicts --num-gpu-experts {num_gpu_experts}")
    n = 0 if cpu_moe else num_gpu_experts
    if n is not None:
        if expert_placement in ("resident", "auto"):
            flag = "--cpu-moe" if cpu_moe else "--num-gpu-experts"
            raise ValueError(f"{flag} fixes a paged placement; it cannot take effect with --expert-placement "
                             f"{expert_placement}")
        return "paged", n
    return expert_placement or "auto", None


# --compressed-gemm auto: the tier it settles on where the fused kernel can run (plans.FUSED_TIER_MODELS; measured
# end to end, Qwen3-30B-A3B at weights + 4 GiB on the H100: 2192.7 output tok/s against the decoding tier's 1269.2)
AUTO_FUSED_GEMM = "fused-hibyte"


def fused_gemm_blocker(c, dims, device_type: str, is_bf16: bool) -> Optional[str]:
    """Why --compressed-gemm auto keeps the decoding tier for `c` (an EngineConfig) and a model of rank dims
    `dims`, or None when AUTO_FUSED_GEMM can run: its Triton kernel on CUDA, bf16 exact experts fetched by
    stream steps, hidden and expert sizes multiples of 64, one rank (the fused tier is untested sharded)."""
    x = c.experts
    return next((why for why, on in (
        ("the Triton kernel needs a CUDA device", device_type != "cuda"),
        ("the lossless tier holds bf16 weights", not is_bf16),
        (f"--moe-backend {c.moe_backend}", c.moe_backend not in ("auto", "triton")),
        (f"--expert-precision {x.precision}", x.precision != "exact"),
        ("--expert-fetch routed", x.fetch == "routed"),
        ("more than one rank", c.tensor_parallel_size > 1 or c.enable_expert_parallel),
        (f"hidden size {dims.hidden_size} / expert size {dims.moe_intermediate_size} not multiples of 64",
         dims.hidden_size % 64 or dims.moe_intermediate_size % 64)) if on), None)


def planning_buffer_kind(requested: str, cuda: bool) -> str:
    """The compute buffers the planner models for --expert-buffers `requested`: plain off CUDA, else VMM
    (its rows padded to the mapping granularity) unless plain was asked for."""
    if not cuda or requested == "plain":
        return "plain"
    return "vmm-ring" if requested == "vmm-ring" else "vmm"


def resolve_expert_plan(config, dims, spec, *, device_type: str, dtype, max_model_len: int,
                        budget: Callable[[], Optional[int]], host_budget: Callable[[], Optional[int]],
                        eager: bool = True) -> ExpertPlan:
    """Placement, tier counts and host compression of `config` (an EngineConfig) for a model of `dims` and
    `spec` (models/moe_decoder.py). Flags decide when they fix it (a static --expert-precision pages every
    expert: all quantized); otherwise the planner (planning/planner.py) picks the placement with the best
    modelled throughput (with the lossless compressed tier among its choices only under
    --expert-compression lossless). `budget()`: the device bytes to plan for (None: CPU without a
    budget); `host_budget()`: the host tier's limit (None: unbounded). `dtype`: the model's torch dtype
    (read by name and size only); `eager`: no CUDA graphs (their pool is part of the reserve on CUDA)."""
    c, x = config, config.experts
    is_bf16, dtype_bytes = str(dtype) == "torch.bfloat16", dtype.itemsize
    host_compression = x.host_compression if x.host_compression in ("none", "lossless") else "none"  # auto, unset
    placement, n = x.placement_mode()
    num_moe = dims.num_layers - len(spec.dense_layers)
    lossless = x.compression == "lossless" or bool(x.num_compressed_experts)
    if lossless and not is_bf16:
        raise ValueError(f"the lossless compressed tier holds bf16 weights; the model runs in {dtype} "
                         "(use --dtype bfloat16)")
    # auto: the placement is searched with the decoding tier (routed fetching reads only that one), then, where
    # the pick streams and the fused kernel can run, searched again with the tier the GEMM reads in place
    gemm, blocker = x.compressed_gemm, None
    if gemm == "auto":
        blocker = fused_gemm_blocker(c, dims, device_type, is_bf16)
        gemm = "decode"
    if n is not None:
        if n > dims.num_experts:
            raise ValueError(f"--num-gpu-experts {n} exceeds the model's {dims.num_experts} experts per layer")
        comp = x.num_compressed_experts or 0
        if n + comp > dims.num_experts:
            raise ValueError(f"--num-gpu-experts {n} + --num-compressed-experts {comp} exceeds the model's "
                             f"{dims.num_experts} experts per layer")
        _check_fixed_host_tier(c, dims, spec, n, comp, device_type, dtype_bytes, host_compression, host_budget)
        if x.compressed_gemm == "auto" and blocker is None and comp and x.fetch == "stream":
            gemm = AUTO_FUSED_GEMM   # (with --expert-fetch auto the fixed placement keeps its fetch's choice)
        return ExpertPlan("paged", (n,) * num_moe, (comp,) * num_moe, host_compression, compressed_gemm=gemm)
    if placement == "resident" and (c.cache.gpu_memory_gb is None or device_type != "cuda"):
        return ExpertPlan("resident", host_compression=host_compression, compressed_gemm=gemm)
    budget_bytes = budget()
    if budget_bytes is None:  # CPU without a budget: nothing to trade
        if x.compression == "lossless":
            raise ValueError(f"--expert-compression {x.compression} lets the planner trade memory for "
                             "a compressed tier; without --gpu-memory-gb on CPU it cannot take effect "
                             "(give --num-compressed-experts)")
        if placement == "auto":
            return ExpertPlan("resident", host_compression=host_compression, compressed_gemm=gemm)
        return ExpertPlan("paged", (0,) * num_moe, None, host_compression, compressed_gemm=gemm)

    def search(tier_gemm: str):
        return _plan_host_modes(c, dims, spec, placement, budget_bytes, device_type, is_bf16, dtype_bytes,
                                max_model_len, host_compression, host_budget, eager, tier_gemm)

    searched = search(gemm)
    if searched is None:  # resident at a budget on CUDA: it fits (else the planner refused, naming the minimum)
        return ExpertPlan("resident", host_compression=host_compression, compressed_gemm=gemm)
    plans, inputs_of = searched
    # auto: the compressed host tier only when it models faster (it only matters for paged plans)
    host_compression = _best_host_mode(plans)
    plan = plans[host_compression]
    fetch = None
    if routed_search(x, device_type):
        # path (b) runs in the decode CUDA graphs on CUDA (fetch_cost.settle_fetch_path), or where asked for
        path = x.fetch_path
        if path == "auto" and (device_type != "cuda" or eager):
            path = "copy"   # auto gives path (b) only CUDA-graph buckets (fetch_cost.settle_fetch_path)
        pick = routed_plan.choose(
            routed_plan.settle(plan, inputs_of(host_compression), host_compression, x.fetch, max_model_len / 2,
                               "stream-optimised", path),
            [routed_plan.best_routed(inputs_of(mode), routed_plan.routed_compression_ratio(x.compression, is_bf16),
                                     max_model_len / 2, x.fetch, path)
             for mode in routed_plan.routed_host_modes(x.host_compression, is_bf16)], x.fetch)
        if pick.origin == "routed-optimised":
            logger.info("placement for routed fetching: %s, modelled %.1f ms per decode step at %d sequences "
                        "(faster than the stream-all search's %s)", pick.label(), pick.step_s * 1e3, pick.num_seqs,
                        plan.placement.label())
        host_compression, plan, fetch = pick.host_compression, pick.plan, pick.fetch
    if x.compressed_gemm == "auto" and x.compression == "lossless" and not plan.placement.is_resident and \
            fetch in (None, "stream"):
        if blocker is None:
            fused_plans, _ = search(AUTO_FUSED_GEMM)
            mode = _best_host_mode(fused_plans)
            better = fused_plans[mode].estimate.output_throughput >= plan.estimate.output_throughput
            if better and fused_plans[mode].placement.total_compressed:
                logger.info("--compressed-gemm auto: %s (the MoE GEMMs read the compressed tier in place), modelled "
                            "%.0f output tok/s against the decoding tier's %.0f", AUTO_FUSED_GEMM,
                            fused_plans[mode].estimate.output_throughput, plan.estimate.output_throughput)
                gemm, host_compression, plan = AUTO_FUSED_GEMM, mode, fused_plans[mode]
        else:
            logger.info("--compressed-gemm auto: decode (the fused tier cannot run here: %s)", blocker)
    logger.info("placement plan: %s", plan.summary())
    per_layer = tuple(plan.placement.num_gpu_experts)
    comp = tuple(plan.placement.num_compressed_experts)
    if all(k == dims.num_experts for k in per_layer):
        if x.host_compression == "lossless":
            raise ValueError("--host-compression lossless cannot take effect: at this budget the planner "
                             "keeps every expert resident, so nothing streams from the host (page anyway "
                             "with --expert-placement paged, or use --host-compression auto)")
        return ExpertPlan("resident", host_compression="none", placement_plan=plan, compressed_gemm=gemm)
    return ExpertPlan("paged", per_layer, comp if any(comp) else None, host_compression, plan, compressed_gemm=gemm)


def _best_host_mode(plans: dict) -> str:
    """The host-tier mode whose plan models the most output tokens/s (ties: the raw host tier)."""
    return max(plans, key=lambda m: (plans[m].estimate.output_throughput, m == "none"))


def rank_shape(c, dims, spec, dtype_bytes: int) -> ModelShape:
    """The planner's shape of this rank (`dims` are the rank's): under --enable-expert-parallel its experts
    are E / N of the model's E, which the router picks from, and every rank all-reduces (cost_model.py)."""
    return ModelShape.from_model_dims(dims, spec, dtype_bytes, tensor_parallel_size=c.tensor_parallel_size,
                                      expert_parallel=c.enable_expert_parallel)


def _plan_host_modes(c, dims, spec, placement: str, budget_bytes: int, device_type: str, is_bf16: bool,
                     dtype_bytes: int, max_model_len: int, host_compression: str, host_budget,
                     eager: bool, compressed_gemm: str) -> Optional[dict]:
    """The planner's best plan for each host-tier mode --host-compression allows (auto: both when bf16), and
    the PlanInputs of a host mode (for the routed search); None for a resident placement at a budget, which is
    only checked (refused with the minimum). `compressed_gemm`: how the compressed tier is read (settled)."""
    shape = rank_shape(c, dims, spec, dtype_bytes)
    x, sch = c.experts, c.scheduler
    act = estimate_activation_bytes(sch.max_num_batched_tokens, sch.max_num_seqs, dims.hidden_size,
                                    dims.moe_intermediate_size, dims.top_k, dims.vocab_size, dtype_bytes)
    if device_type == "cuda":  # what start-up will keep out of the KV cache (planning/kv_sizing.py)
        build = (dynamic_build_bytes(shape.experts_per_gpu, shape.expert_bytes, shape.expert_bytes // dtype_bytes)
                 if x.precision == "dynamic" else 0)
        act += start_up_reserve_bytes(act, sch.max_num_seqs, dims.hidden_size, dims.moe_intermediate_size,
                                      dims.top_k, dims.vocab_size, dtype_bytes, cuda_graphs=not eager,
                                      build_bytes=build, context_bytes=CUDA_CONTEXT_BYTES)
    buffers = planning_buffer_kind(x.buffers, device_type == "cuda")
    if placement == "resident":  # refused before loading when the budget cannot hold it (names the minimum)
        planner.plan_memory(shape, budget_bytes, act, "resident", max_model_len=max_model_len,
                            block_size=c.cache.block_size, max_num_seqs=sch.max_num_seqs,
                            max_num_batched_tokens=sch.max_num_batched_tokens, buffers=buffers)
        return None
    # the tier read by the GEMM (issue 23): no decode; its ratio and measured time (plans.FUSED_TIER_MODELS)
    fused_ratio, fused_factor = fused_tier_model(compressed_gemm)
    fused = fused_ratio is not None
    ratio = (fused_ratio if fused else LOSSLESS_PLANNING_RATIO) if x.compression == "lossless" else None
    host_modes = ["none", "lossless"] if x.host_compression == "auto" and is_bf16 else [host_compression]
    host_limit = host_budget()

    def kwargs(mode: str) -> dict:
        return dict(max_model_len=max_model_len, block_size=c.cache.block_size, max_num_seqs=sch.max_num_seqs,
                    max_num_batched_tokens=sch.max_num_batched_tokens, buffers=buffers,
                    host_compression_ratio=LOSSLESS_PLANNING_RATIO if mode == "lossless" else 0.0,
                    host_budget_bytes=host_limit)

    plans, errors = {}, []
    for mode in host_modes:
        try:
            plans[mode] = planner.plan_memory(shape, budget_bytes, act, placement, None, compression_ratio=ratio,
                                              fused_compressed=fused, fused_time_factor=fused_factor,
                                              **kwargs(mode))
        except ValueError as e:  # PlacementBudgetError: this mode does not fit
            errors.append(e)
    if not plans:
        raise errors[0]
    return plans, lambda mode: planner.PlanInputs(shape, budget_bytes, act, **kwargs(mode))


def routed_search(x, device_type: str) -> bool:
    """The placement search also weighs placements for routed fetching (planning/routed_plan.py): when
    --expert-fetch may settle on routed (routed, or auto on CUDA) with exact experts in plain buffers."""
    fetch = x.fetch == "routed" or (x.fetch == "auto" and device_type == "cuda")
    # the fused compressed tier (--compressed-gemm fused) is read by the GEMMs in place: never fetched routed
    return fetch and x.precision == "exact" and x.buffers in ("auto", "plain") and fused_format(x.compressed_gemm) is None


def _check_fixed_host_tier(c, dims, spec, num_gpu: int, num_comp: int, device_type: str, dtype_bytes: int,
                           host_compression: str, host_budget) -> None:
    """A placement fixed by the flags (--num-gpu-experts, --cpu-moe) skips the planner's search, not its
    host limit: refuse it before pinning more host memory than the machine has."""
    num_moe = dims.num_layers - len(spec.dense_layers)
    # NOTE: a static lossy precision holds every expert quantized on the device (experts/build.py): its
    # host tier is empty, so no host limit can refuse it.
    lossy = c.experts.quantized_precision() is not None
    num_host = 0 if lossy else (dims.num_experts - num_gpu - num_comp) * num_moe
    limit = host_budget() if num_host > 0 else None
    if limit is None:
        return
    shape = rank_shape(c, dims, spec, dtype_bytes)
    placement = Placement.uniform(num_moe, dims.num_experts, num_gpu, num_comp,
                                  LOSSLESS_PLANNING_RATIO if num_comp else 0.0)
    buffers = planning_buffer_kind(c.experts.buffers, device_type == "cuda")
    need = planner.host_tier_bytes(shape, placement, buffers,
                                   LOSSLESS_PLANNING_RATIO if host_compression == "lossless" else 0.0)
    if need > limit:
        raise ValueError(f"the host tier of this placement ({num_host} experts, {need / GiB:.2f} GiB) does not "
                         f"fit the host memory limit of {limit / GiB:.2f} GiB: keep more experts on the GPU "
                         "(--num-gpu-experts, --num-compressed-experts), hold the host tier compressed "
                         "(--host-compression lossless), or raise --host-memory-gb")
