"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode step's Triton kernels.

A decode step at batch 1 is ~700 short kernels; in a CUDA graph each one still waits for the one before it
to finish and drain before its first program starts. Launched with PDL (Triton's ``launch_pdl=True``, kept
through CUDA-graph capture as a programmatic edge), a kernel may be scheduled while its predecessor is still
running; every such kernel begins with ``pdl_enter``:
  1. griddepcontrol.wait: block until the previous kernel in the stream has completed and its writes are
     visible. Nothing is read or written before it, so the kernel sees exactly what it would have seen
     without PDL (same results bit for bit).
  2. griddepcontrol.launch_dependents: let the next PDL kernel be scheduled now. It is called after the wait,
     so a kernel that has started implies that its predecessor's predecessor has completed; a kernel that
     was not launched with PDL (cuBLAS, torch ops) waits for the complete kernel as usual.
H200 (benchmarks/pdl_probe.py, a graph of 400 dependent one-program kernels): 0.92 -> 0.74 us a kernel.

``enabled(device)``: CUDA, capability >= 9, not the Triton interpreter, and PAGEDMOE_PDL not "0" (the switch
for measurements: PAGEDMOE_PDL=0 runs the same kernels without it). Memoised per device and environment: the
eager prefill launches ~400 kernels, and every host microsecond there is on the critical path.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "PAGEDMOE_PDL"


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (the launchers pass it as PDL= and launch_pdl=)."""
    return launch_args(device)["PDL"]


def launch_args(device: torch.device) -> dict:
    """The launch keywords of a kernel that takes a PDL constexpr: PDL=..., launch_pdl=... (a shared dict: do
    not modify it)."""
    return _launch_args(device.type, device.index, os.environ.get("TRITON_INTERPRET"), os.environ.get(ENV))


@functools.lru_cache(maxsize=64)
def _launch_args(kind: str, index, interpret, switch) -> dict:
    on = kind == "cuda" and interpret != "1" and switch != "0" and _capable(
        index if index is not None else torch.cuda.current_device())
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL-capable kernel: wait for the previous kernel, then release the next one."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
