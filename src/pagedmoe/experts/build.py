"""Build the expert subsystem the model is constructed with: table + store, and the experts object the MoE
layers call (experts/interface.py): ResidentExperts for resident placement, the ExpertPager for paged."""
from __future__ import annotations

import functools
import logging
import os
from typing import Sequence, Union

import torch

from pagedmoe import cuda_vmm as vmm
from pagedmoe.config_sections import fused_format, fused_kernel
from pagedmoe.experts.buffers import VmmExpertBuffers
from pagedmoe.experts.cache import ExpertCache
from pagedmoe.experts.pager import ExpertPager
from pagedmoe.experts.routed import RoutedPager
from pagedmoe.experts.store import ExpertStore
from pagedmoe.experts.table import ExpertTable
from pagedmoe.experts.tiers.resident import ResidentExperts
from pagedmoe.extras import require
from pagedmoe.planning.fetch_cost import miss_rows

logger = logging.getLogger(__name__)


# Expert rows without VMM start every 16 bytes (vectorised loads); VMM rounds them up to its granularity.
STRIDE_ALIGN_BYTES = 16


def _per_layer(counts: Union[int, Sequence[int], None], num_layers: int, what: str) -> list[int]:
    out = list(counts) if isinstance(counts, (list, tuple)) else [counts or 0] * num_layers
    if len(out) != num_layers:
        raise ValueError(f"{len(out)} {what} counts for {num_layers} MoE layers")
    return out


def settle_buffers(requested: str, paged: bool, device: torch.device) -> str:
    """The compute buffers --expert-buffers `requested` gets: "vmm" / "vmm-ring" (CUDA virtual memory
    management: stable addresses, resident rows mapped in place) for paged placement on CUDA when the
    driver offers it (auto falls back on "plain"), else "plain"; a kind that cannot be had is an error."""
    if paged and requested in ("auto", "vmm", "vmm-ring") and device.type == "cuda":
        if requested != "auto":  # asked for by name: say which package is missing rather than "unavailable"
            require("cuda.bindings", "gpu", f"--expert-buffers {requested}", package="cuda-python")
        if vmm.available(device):
            return "vmm-ring" if requested == "vmm-ring" else "vmm"
        if requested != "auto":
            raise ValueError(f"expert buffers '{requested}' asked for, but CUDA virtual memory management is "
                             "unavailable")
    elif requested in ("vmm", "vmm-ring"):
        raise ValueError(f"expert buffers '{requested}' need a CUDA device")
    return "plain"


def build_experts(plan, num_moe_layers: int, dims, device: torch.device, dtype: torch.dtype, activity=None):
    """The experts object for a model of `dims` with `num_moe_layers` MoE layers, laid out by the resolved
    ExpertPlan `plan` (planning/resolve.py): its table, store and buffers (the loader writes the weights into
    `.store` later). `activity` (optional ActivityTable) counts the router ids the MoE layers pass in.

    placement "resident": every expert in device memory. "paged": `num_gpu_experts` resident (one
    count for every layer, or one per MoE layer), the rest in (pinned) host memory, streamed into a
    double-buffered compute area. `num_compressed_experts` (paged only; one count, or one per MoE
    layer) of the others are kept losslessly compressed on the device instead (bf16 only) and decoded
    into the compute area; the store encodes them when loading ends (ExpertStore.finalize).
    `quantized_precision` ("fp8", "int8" or "int4"; paged only): the experts that would go to the host
    tier are held on the device in that lossy format instead and dequantised into the compute area (the
    static `--expert-precision static-*` modes: every expert, with no resident or compressed ones).
    `host_compression` "lossless": the host tier is held losslessly compressed (ExpertStore.finalize
    encodes it) and decoded on the device after each copy. `quantized_gemm` "direct" (static lossy
    experts, every expert of every layer quantized): forwards of up to TRITON_MAX_TOKENS tokens skip the
    dequantisation and the MoE GEMMs read the quantized weights (kernels/fused_moe.py::fused_moe_quantized).
    `compressed_gemm` "fused": the compressed experts are held in lossless format v2 and the MoE GEMMs read
    them (kernels/fused_moe.py::fused_moe_mixed with TiledTensor parts): never decoded into the buffers;
    "fused-hibyte" / "fused-hibyte-exact": in version 3 (tile_major order), read by the fast / exact hibyte kernel.
    """
    if plan.paged and plan.fetch == "routed":
        return _build_routed(plan, num_moe_layers, dims, device, dtype, activity)
    placement, num_gpu_experts, num_compressed_experts = plan.mode, plan.num_gpu_experts, plan.num_compressed
    buffers, quantized_precision = plan.buffers, plan.quantized_precision
    host_compression, quantized_gemm = plan.host_compression, plan.quantized_gemm
    fmt = fused_format(plan.compressed_gemm)
    fused = fmt is not None
    if placement not in ("resident", "paged"):
        raise ValueError(f"placement must be resolved to resident or paged, got {placement!r}")
    num_layers = num_moe_layers
    table = ExpertTable(num_layers, dims.num_experts)
    paged = placement == "paged"
    comp = _per_layer(num_compressed_experts, num_layers, "compressed-expert")
    if any(comp) and not paged:
        raise ValueError("compressed experts are decoded into paged compute buffers; they need placement 'paged'")
    if any(comp) and dtype != torch.bfloat16:
        raise ValueError(f"the lossless compressed tier holds bf16 weights; the model runs in {dtype} "
                         "(use --dtype bfloat16)")
    if quantized_precision is not None and not paged:
        raise ValueError("quantized experts are dequantised into paged compute buffers; they need placement "
                         "'paged'")
    if not paged:
        table.place_first(dims.num_experts)
    else:
        counts = _per_layer(num_gpu_experts, num_layers, "resident-expert")
        E = dims.num_experts
        bad = [(n, c) for n, c in zip(counts, comp) if n < 0 or c < 0 or n + c > E]
        if bad:
            raise ValueError(f"{bad[0][0]} resident + {bad[0][1]} compressed experts exceed the model's {E} "
                             "experts per layer")
        # Without activity statistics every expert is as good as another: the first N resident, the
        # next C compressed (consecutive ids: one decode launch per layer).
        quant = None
        if quantized_precision is not None:
            quant = [range(n + c, E) for n, c in zip(counts, comp)]
        table.place([range(n) for n in counts], [range(n, n + c) for n, c in zip(counts, comp)], quant,
                    quantized_precision or "int8")
    factory, align = None, STRIDE_ALIGN_BYTES
    if settle_buffers(buffers, paged, device) != "plain":
        factory = functools.partial(VmmExpertBuffers, ring=buffers == "vmm-ring")
        align = vmm.granularity(device)
    if host_compression != "none" and not paged:
        raise ValueError("--host-compression compresses the host tier; it needs placement 'paged'")
    if fused:  # (a placement the planner chose without compressed experts has nothing for it to do)
        flag = f"--compressed-gemm {plan.compressed_gemm}"
        if plan.dynamic_min_precision is not None:
            raise ValueError(f"{flag} does not support --expert-precision dynamic yet")
        if fmt == "hibyte" and (dims.hidden_size % 64 or dims.moe_intermediate_size % 64):
            raise ValueError(f"{flag} needs the hidden size ({dims.hidden_size}) and the expert "
                             f"intermediate size ({dims.moe_intermediate_size}) to be multiples of 64; use "
                             "--compressed-gemm fused")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{flag} runs Triton kernels: it needs a CUDA device")
    store = ExpertStore(table, dims.hidden_size, dims.moe_intermediate_size, dtype, device, paged,
                        stride_align_bytes=align, buffers_factory=factory, host_compression=host_compression,
                        fused_compressed=fused, fused_format=fmt or "tiled",
                        fused_kernel=fused_kernel(plan.compressed_gemm) or "exact")
    if quantized_gemm == "direct":
        # static: every expert of every layer quantized, in id order; dynamic (no quantized_precision here:
        # ExpertStore.enable_dynamic follows) reads each layer's published version instead
        if not paged or quantized_precision is not None and any(
                table.ids(l, "quantized") != list(range(dims.num_experts)) for l in range(num_layers)):
            raise ValueError("--quantized-gemm direct needs every expert of every layer quantized (--expert-precision "
                             "static-fp8/int8/int4) or dynamic precision")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--quantized-gemm direct runs Triton kernels: it needs a CUDA device")
    if paged:
        return ExpertPager(store, direct_quantized=quantized_gemm == "direct", activity=activity)
    return ResidentExperts(store, activity)




def cache_slots(num_gpu_experts, num_layers: int, num_experts: int) -> int:
    """Pages of the expert cache under --expert-fetch routed: the device rows stream-all holds with VMM
    buffers (the planner's resident experts of every layer plus two slots of the most streamed layer's
    rows), so the planner's split against the KV cache holds for both fetches (planning/fetch_cost.py::
    cache_pages); never fewer than E, so one layer can route to all its experts."""
    counts = _per_layer(num_gpu_experts, num_layers, "resident-expert")
    return max(num_experts, sum(counts) + 2 * max(num_experts - n for n in counts))


def _build_routed(plan, num_layers: int, dims, device: torch.device, dtype: torch.dtype, activity):
    """--expert-fetch routed: every expert's master copy in the host tier (raw, or compressed one expert per group
    under --host-compression lossless), or the first C per layer in the compressed GPU tier
    (--num-compressed-experts C); a GPU expert cache (experts/cache.py) of `cache_slots` pages as the compute
    buffers, and the RoutedPager (experts/routed.py), which fills a page per routed miss (experts/routed_fill.py).
    Fetch path (b) (`plan.sync_free_max_seqs`) reads the host tier from mapped host memory (raw rows gathered,
    compressed ones decoded as they are read) and decodes the compressed GPU tier on the device; forwards of at least
    `plan.stream_min_tokens` tokens beyond it are stream steps."""
    comp = _per_layer(plan.num_compressed, num_layers, "compressed-expert")
    unsupported = [name for name, on in (("--expert-precision static-*", plan.quantized_precision is not None),
                                         ("--expert-precision dynamic", plan.dynamic_min_precision is not None),
                                         ("--quantized-gemm direct", plan.quantized_gemm == "direct"),
                                         ("--compressed-gemm fused", fused_format(plan.compressed_gemm) is not None))
                   if on]
    if unsupported:
        raise ValueError(f"--expert-fetch routed fetches exact experts from the host and lossless tiers; it cannot "
                         f"take effect with {unsupported[0]} (use --expert-fetch stream)")
    if plan.buffers not in ("plain", "auto"):
        raise ValueError(f"--expert-fetch routed pages experts into its own expert cache; --expert-buffers "
                         f"{plan.buffers} cannot take effect with it")
    if (any(comp) or plan.host_compression != "none") and dtype != torch.bfloat16:
        raise ValueError(f"the lossless tiers hold bf16 weights; the model runs in {dtype} (use --dtype bfloat16)")
    E = dims.num_experts
    if any(c < 0 or c > E for c in comp):
        raise ValueError(f"{max(comp)} compressed experts exceed the model's {E} experts per layer")
    sync_free = plan.sync_free_max_seqs
    table = ExpertTable(num_layers, E)
    # no resident experts: the cache holds what is routed; compressed: the first C ids (one decode run a layer)
    table.place([()] * num_layers, [range(c) for c in comp])
    # path (b)'s miss area comes out of the cache's pages while they leave E for path (a) (always, with 2+ layers)
    misses = miss_rows(E, dims.top_k, sync_free)
    slots = max(cache_slots(plan.num_gpu_experts, num_layers, E), E + misses)
    store = ExpertStore(table, dims.hidden_size, dims.moe_intermediate_size, dtype, device, True,
                        stride_align_bytes=STRIDE_ALIGN_BYTES,
                        buffers_factory=lambda st: ExpertCache(table, slots, st.stride, dtype, device, misses),
                        host_compression=plan.host_compression, host_group_experts=1, host_mapped=bool(sync_free))
    return RoutedPager(store, activity=activity, sync_free_max_tokens=sync_free,
                       stream_min_tokens=plan.stream_min_tokens)
