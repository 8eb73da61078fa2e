"""Out of device memory, named: what was being done, how large it was, and the budget.

torch's own message ("Tried to allocate 2.00 GiB ...") says nothing of what pagedmoe was doing; the loader used
to report it as a corrupt checkpoint. Code that allocates device memory in bulk wraps the work in
`naming_oom(what, nbytes)`; the engine adds the budget (engine/llm_engine.py)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

GiB = 1 << 30


class DeviceOutOfMemoryError(torch.OutOfMemoryError):
    """CUDA out of memory while doing `what` (`nbytes`: the size of that work, when known). A subclass of torch's
    error, so `except torch.OutOfMemoryError` still catches it."""

    def __init__(self, what: str, nbytes: Optional[int] = None, budget: Optional[str] = None) -> None:
        self.what, self.nbytes, self.budget = what, nbytes, budget
        text = f"out of GPU memory while {what}"
        if nbytes is not None:
            text += f" ({nbytes / GiB:.2f} GiB)"
        if budget is not None:
            text += f", {budget}"
        super().__init__(text)

    def with_budget(self, budget: str) -> "DeviceOutOfMemoryError":
        return DeviceOutOfMemoryError(self.what, self.nbytes, budget)


@contextlib.contextmanager
def naming_oom(what: str, nbytes: Optional[int] = None):
    """Re-raise a CUDA OOM inside the block as DeviceOutOfMemoryError(what, nbytes); an inner, more precise
    name wins."""
    try:
        yield
    except DeviceOutOfMemoryError:
        raise
    except torch.OutOfMemoryError as e:
        raise DeviceOutOfMemoryError(what, nbytes) from e


def budget_text(gpu_memory_gb: Optional[float], device: torch.device) -> str:
    """"budget 24.00 GiB", or what stands in for one when --gpu-memory-gb is not given."""
    if gpu_memory_gb is not None:
        return f"budget {gpu_memory_gb:.2f} GiB"
    if device.type == "cuda":
        try:
            _, total = torch.cuda.mem_get_info(device)
            return f"no --gpu-memory-gb budget (the device's {total / GiB:.2f} GiB)"
        except RuntimeError:
            pass
    return "no --gpu-memory-gb budget"
