"""The process's device memory as the driver counts it, for the --gpu-memory-gb bound.

torch's counters (memory_allocated / memory_reserved) miss what the budget must hold: the CUDA context,
CUDA VMM mappings (expert buffers, the lendable KV cache), cuBLAS / Triton module memory outside torch's
pool. `torch.cuda.mem_get_info` sees all of it, for the whole device: this module turns it into the
process's share (the device's use less what other processes held when the monitor started) and polls it
on a thread, so a peak between two readings is not lost.

One monitor per device per process (`process_monitor`): its baseline is taken once, before the engine
loads anything, so the memory of earlier engines in the same process (a sweep's points) stays counted as
the process's own.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
from typing import Optional

import torch

from pagedmoe.planning.kv_sizing import CUDA_CONTEXT_BYTES, GiB, others_at_start, process_device_bytes


def _nvml_process_bytes(device_idx: int) -> Optional[int]:
    """This process's device memory by NVML (context included), or None without pynvml / permission."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_idx)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # NVML refuses in containers without the pid namespace: fall back
        return None
    return None


class DeviceMemoryMonitor:
    """`used_bytes()`: the process's device memory now; `peak_bytes`: the largest reading since the last
    `reset_peak()` (polled every `period_s` while running, and at every `used_bytes()` / `mark()`)."""

    def __init__(self, device: torch.device, period_s: float = 0.01) -> None:
        self.device = device
        self.idx = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(self.idx)   # creates the context if nothing did
        self.total_bytes = total
        nvml = _nvml_process_bytes(self.idx)
        self.context_source = "nvml" if nvml is not None else "estimate"
        reserved = torch.cuda.memory_reserved(self.idx)
        # NVML's figure is the process's whole use; without it, the context is estimated and anything
        # beyond it and torch's pool at the first reading counts as other processes'.
        own = nvml if nvml is not None else CUDA_CONTEXT_BYTES + reserved
        self.others_bytes = others_at_start(total, free, own)
        self.context_bytes = max(0, total - free - self.others_bytes - reserved)
        self.stages: dict[str, int] = {}
        self._stage: Optional[str] = None   # the last stage marked (the run's samples come after "ready")
        self.torch_stages: dict[str, int] = {}   # torch's reservation at each stage: growth outside it is not torch's
        self.peak_bytes = 0
        # at the peak's sample: the last stage marked before it and torch's reservation (what is beyond it was
        # held outside torch's pool: context, VMM mappings, module and graph memory)
        self.peak_stage: Optional[str] = None
        self.peak_torch_reserved_bytes = 0
        self.samples = 0
        self._lock = threading.Lock()
        self._gate = threading.Lock()   # held by `polling_paused` (CUDA-graph capture): no reading meanwhile
        self._done: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None
        self.period_s = period_s
        self.stages["context"] = self.used_bytes()

    def used_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.idx)
        used = process_device_bytes(total, free, self.others_bytes)
        with self._lock:
            if used > self.peak_bytes:
                self.peak_bytes = used
                self.peak_stage = self._stage
                self.peak_torch_reserved_bytes = torch.cuda.memory_reserved(self.idx)
            self.samples += 1
        return used

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = 0
        self.used_bytes()

    def peak_summary(self) -> str:
        """Where the peak was: "after stage S, torch's pool X GiB of it"."""
        return (f"after stage {self.peak_stage or '-'}, torch's pool {self.peak_torch_reserved_bytes / GiB:.2f} GiB "
                "of it")

    def mark(self, stage: str, sync: bool = True) -> int:
        """Record the process's memory at a named start-up stage (after the device finished its work)."""
        if sync:
            torch.cuda.synchronize(self.idx)
        used = self.used_bytes()
        self.stages[stage] = used
        self.torch_stages[stage] = torch.cuda.memory_reserved(self.idx)
        self._stage = stage
        return used

    # -- the polling thread ------------------------------------------------------------------------
    def start(self) -> "DeviceMemoryMonitor":
        if self._thread is None:
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._poll, name="pagedmoe-device-memory", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None

    def _poll(self) -> None:
        try:
            torch.cuda.set_device(self.idx)   # a thread's current device is 0 until told
            while not self._done.wait(self.period_s):
                with self._gate:
                    self.used_bytes()
        except Exception:  # the driver (or the interpreter) shutting down at exit: stop quietly
            return

    def record(self, budget_bytes: Optional[int] = None) -> dict:
        """What a bench JSON keeps (GiB): now, the peak, torch's share, the stages, the budget and the ratio."""
        used = self.used_bytes()
        out = {"source": "torch.cuda.mem_get_info (process = device use less other processes at start)",
               "used_gib": used / GiB, "peak_gib": self.peak_bytes / GiB,
               "torch_reserved_gib": torch.cuda.memory_reserved(self.idx) / GiB,
               "torch_peak_reserved_gib": torch.cuda.max_memory_reserved(self.idx) / GiB,
               # reserved far above allocated: torch's pool fragmented (or cached a transient)
               "torch_peak_allocated_gib": torch.cuda.max_memory_allocated(self.idx) / GiB,
               "other_processes_gib": self.others_bytes / GiB, "context_gib": self.context_bytes / GiB,
               "context_source": self.context_source, "device_total_gib": self.total_bytes / GiB,
               "samples": self.samples, "stages_gib": {k: v / GiB for k, v in self.stages.items()},
               "peak_after_stage": self.peak_stage, "torch_reserved_at_peak_gib": self.peak_torch_reserved_bytes / GiB,
               "torch_reserved_stages_gib": {k: v / GiB for k, v in self.torch_stages.items()}}
        if budget_bytes:
            out["budget_gib"] = budget_bytes / GiB
            out["peak_over_budget"] = self.peak_bytes / budget_bytes
        return out


_MONITORS: dict[int, DeviceMemoryMonitor] = {}


@contextlib.contextmanager
def polling_paused():
    """No monitor reads the device meanwhile: a CUDA-graph capture in global mode may refuse driver calls
    from other threads."""
    monitors = list(_MONITORS.values())
    for mon in monitors:
        mon._gate.acquire()
    try:
        yield
    finally:
        for mon in monitors:
            mon._gate.release()


@atexit.register
def _stop_monitors() -> None:
    """Before CUDA tears down: a reading during its shutdown would fail."""
    for mon in _MONITORS.values():
        mon.stop()


def process_monitor(device: torch.device) -> Optional[DeviceMemoryMonitor]:
    """The process's monitor of `device` (started, polling), created on first use; None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    mon = _MONITORS.get(idx)
    if mon is None:
        mon = _MONITORS[idx] = DeviceMemoryMonitor(torch.device("cuda", idx)).start()
    return mon
