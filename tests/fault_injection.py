"""Faults injected on the CPU: torch's CUDA out-of-memory error from a call that would allocate."""
from __future__ import annotations

import torch

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB"


def raise_oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError(OOM)


class OomOnce:
    """Wrap `fn`: its `at`-th call (1-based) raises torch's OOM, every other call runs it."""

    def __init__(self, fn, at: int) -> None:
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise_oom()
        return self.fn(*args, **kwargs)
