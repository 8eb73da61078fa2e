"""Host tensors to the device without waiting for the GPU.

A copy from pageable host memory may make the driver synchronise with the stream to stage it (the CUDA
runtime's API synchronisation notes say it may, and do for copies over its inline limit), so a step's inputs
built while the step before still runs (--async-scheduling) could wait for it. Copies go through pinned
memory instead, as vLLM's input buffers do: torch's caching host allocator keeps each pinned block until its
copy has run on the stream, so a temporary is safe to drop at once.
"""
from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device`: through pinned memory and non-blocking on CUDA, a plain copy elsewhere."""
    if device.type != "cuda":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
