"""Device facts the kernel launchers size their grids by."""
from __future__ import annotations

import torch

_SM_COUNT: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132 (an H200) off CUDA, so interpreter runs pick the
    same grid shapes as the GPU and the tests cover the same paths."""
    if device.type != "cuda":
        return 132
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]
