"""Attach the expert subsystem to a model: table + store (+ pager for paged placement)."""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional, Sequence, Union

import torch

from pagedmoe.experts.pager import ExpertPager
from pagedmoe.experts.store import ExpertStore
from pagedmoe.experts.table import ExpertTable

logger = logging.getLogger(__name__)

PLACEMENTS = ("resident", "paged", "auto")
# Stored bytes / bf16 bytes the planner assumes for the lossless tier before any weight is seen: the
# default layout on N(0, 0.02) weights (docs/benchmarks.md, "Lossless codec"); trained weights are close.
LOSSLESS_PLANNING_RATIO = 0.683

# Expert rows without VMM start every 16 bytes (vectorised loads); VMM rounds them up to its granularity.
STRIDE_ALIGN_BYTES = 16


def _per_layer(counts: Union[int, Sequence[int], None], num_layers: int, what: str) -> list[int]:
    out = list(counts) if isinstance(counts, (list, tuple)) else [counts or 0] * num_layers
    if len(out) != num_layers:
        raise ValueError(f"{len(out)} {what} counts for {num_layers} MoE layers")
    return out


def attach_experts(model, placement: str, num_gpu_experts: Union[int, Sequence[int], None],
                   device: torch.device, dtype: torch.dtype, buffers: str = "auto",
                   num_compressed_experts: Union[int, Sequence[int], None] = None,
                   quantized_precision: Optional[str] = None, host_compression: str = "none",
                   quantized_gemm: str = "dequant") -> ExpertStore:
    """Create the expert table and store for `model` and route its MoE layers through them.

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
    """
    if placement not in ("resident", "paged"):
        raise ValueError(f"placement must be resolved to resident or paged, got {placement!r}")
    moes = model.moe_layers()
    dims = model.dims
    table = ExpertTable(len(moes), dims.num_experts)
    paged = placement == "paged"
    comp = _per_layer(num_compressed_experts, len(moes), "compressed-expert")
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
        counts = _per_layer(num_gpu_experts, len(moes), "resident-expert")
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
    if paged and buffers in ("auto", "vmm", "vmm-ring") and device.type == "cuda":
        from pagedmoe.experts import vmm
        from pagedmoe.extras import require

        if buffers != "auto":  # asked for by name: say which package is missing rather than "unavailable"
            require("cuda.bindings", "gpu", f"--expert-buffers {buffers}", package="cuda-python")
        if vmm.available(device):
            factory = functools.partial(vmm.VmmExpertBuffers, ring=buffers == "vmm-ring")
            align = vmm.granularity(device)
        elif buffers != "auto":
            raise ValueError(f"expert buffers '{buffers}' asked for, but CUDA virtual memory management is "
                             "unavailable")
    elif buffers in ("vmm", "vmm-ring"):
        raise ValueError(f"expert buffers '{buffers}' need a CUDA device")
    if host_compression != "none" and not paged:
        raise ValueError("--host-compression compresses the host tier; it needs placement 'paged'")
    store = ExpertStore(table, dims.hidden_size, dims.moe_intermediate_size, dtype, device, paged,
                        stride_align_bytes=align, buffers_factory=factory, host_compression=host_compression)
    model.expert_store = store
    if quantized_gemm == "direct":
        # static: every expert of every layer quantized, in id order; dynamic (no quantized_precision here:
        # ExpertStore.enable_dynamic follows) reads each layer's published version instead
        if not paged or quantized_precision is not None and any(
                table.ids(l, "quantized") != list(range(dims.num_experts)) for l in range(len(moes))):
            raise ValueError("--quantized-gemm direct needs every expert of every layer quantized (--expert-precision "
                             "static-fp8/int8/int4) or dynamic precision")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--quantized-gemm direct runs Triton kernels: it needs a CUDA device")
    if paged:
        pager = ExpertPager(store, direct_quantized=quantized_gemm == "direct")
        model.pager = pager
        for moe in moes:
            moe.weights_provider = pager.weights
            moe.on_experts_done = pager.after_experts
    else:
        model.pager = None
        for moe in moes:
            moe.weights_provider = store.views
            moe.on_experts_done = None
    return store


# -- --expert-precision dynamic and --expert-stats ------------------------------------------------------
def load_expert_stats(path: Optional[str], activity) -> Optional[dict]:
    """--expert-stats PATH: load the activity table when the file exists (the first run creates it)."""
    from pathlib import Path

    if not path or not Path(path).exists():
        return None
    import json

    try:
        data = activity.load(path)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--expert-stats {path}: not an expert stats file written by pagedmoe ({e!r})") from e
    logger.info("expert stats loaded from %s", path)
    return data


def save_expert_stats(path: str, activity, precision=None) -> None:
    """At exit: the activity table, and under dynamic precision the precision map and measured errors."""
    try:
        activity.save(path, precision.state_json() if precision is not None else None)
    except Exception as e:  # at interpreter exit: report, never raise
        logger.warning("could not save expert stats to %s: %s", path, e)


def start_dynamic_precision(config, store, kv, block_bytes: int, min_usable_blocks: int, activity,
                            stats: Optional[dict] = None):
    """Build the DynamicPrecisionManager of `--expert-precision dynamic` (the store's DynamicExperts was
    enabled before the KV cache was sized). A precision map in the stats file is the starting point
    when it fits the budget."""
    from pagedmoe.experts.controller import DynamicPrecisionManager, parse_state

    from pagedmoe.config import resolve_model
    from pagedmoe.experts.quantized import OfflineForms

    initial = rel = None
    if stats is not None:
        initial, rel = parse_state(stats, store.table.num_layers, store.table.num_experts)
    offline = OfflineForms.open(resolve_model(config.model), store.hidden, store.inter)
    if offline is not None:   # `pagedmoe compress --precisions`: forms and compress-time costs
        store.dynamic.offline = offline
        rel = rel if rel is not None else offline.rel_error()
        logger.info("dynamic expert precision: offline lossy forms %s", sorted(offline.files))
    low, high = config.watermarks()
    mgr = DynamicPrecisionManager(store.dynamic, kv, block_bytes, low, high, store.dynamic.min_precision,
                                  activity=activity, min_usable_blocks=min_usable_blocks, initial=initial,
                                  rel_error=rel)
    logger.info("dynamic expert precision: %s; %d KV blocks lent to experts (watermarks %d / %d of %d blocks)",
                mgr.precision_counts(), mgr.withheld, mgr.watermarks.low, mgr.watermarks.high, mgr.num_blocks)
    return mgr
