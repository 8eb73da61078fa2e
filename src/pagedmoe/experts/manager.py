"""Attach the expert subsystem to a model: table + store (+ pager for paged placement)."""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch

from pagedmoe.experts.pager import ExpertPager
from pagedmoe.experts.store import ExpertStore
from pagedmoe.experts.table import ExpertTable

logger = logging.getLogger(__name__)

PLACEMENTS = ("resident", "paged", "auto")


def attach_experts(model, placement: str, num_gpu_experts: Union[int, Sequence[int], None],
                   device: torch.device, dtype: torch.dtype, buffers: str = "auto") -> ExpertStore:
    """Create the expert table and store for `model` and route its MoE layers through them.

    placement "resident": every expert in device memory. "paged": `num_gpu_experts` resident (one
    count for every layer, or one per MoE layer), the rest in (pinned) host memory, streamed into a
    double-buffered compute area.
    """
    if placement not in ("resident", "paged"):
        raise ValueError(f"placement must be resolved to resident or paged, got {placement!r}")
    moes = model.moe_layers()
    dims = model.dims
    table = ExpertTable(len(moes), dims.num_experts)
    paged = placement == "paged"
    if not paged:
        table.place_first(dims.num_experts)
    else:
        counts = num_gpu_experts if isinstance(num_gpu_experts, (list, tuple)) else \
            [num_gpu_experts or 0] * len(moes)
        if len(counts) != len(moes):
            raise ValueError(f"{len(counts)} resident-expert counts for {len(moes)} MoE layers")
        # Without activity statistics every expert is as good as another: keep the first N.
        table.place([range(min(k, dims.num_experts)) for k in counts])
    factory, align = None, 16
    if paged and buffers in ("auto", "vmm") and device.type == "cuda":
        from pagedmoe.experts import vmm

        if vmm.available(device):
            factory, align = vmm.VmmExpertBuffers, vmm.granularity(device)
        elif buffers == "vmm":
            raise ValueError("expert buffers 'vmm' asked for, but CUDA virtual memory management is unavailable")
    elif buffers == "vmm":
        raise ValueError("expert buffers 'vmm' need a CUDA device")
    store = ExpertStore(table, dims.hidden_size, dims.moe_intermediate_size, dtype, device, paged,
                        stride_align_bytes=align, buffers_factory=factory)
    model.expert_store = store
    if paged:
        pager = ExpertPager(store)
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
