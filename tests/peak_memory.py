"""Peak bytes of the tensors an operation allocates, on any device (the CPU included): a TorchDispatchMode sees
every op's outputs; an output whose storage is none of its inputs' is a new allocation, tracked until its
storage dies. Tensors made before the probe, and views or in-place results of any tensor, are not counted;
`excluded()` marks allocations that are not the device's (e.g. the host tier's arrays)."""
from __future__ import annotations

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}   # storage address -> (weak ref, bytes)
        self.peak = 0          # most bytes live at once
        self.largest = 0       # largest single allocation
        self._skip = 0

    @contextlib.contextmanager
    def excluded(self):
        self._skip += 1
        try:
            yield
        finally:
            self._skip -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {p: v for p, v in self.live.items() if not v[0].expired()}
        if not self._skip:
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if n and ptr not in inputs and ptr not in self.live:
                    self.live[ptr] = (StorageWeakRef(st), n)
                    self.largest = max(self.largest, n)
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
