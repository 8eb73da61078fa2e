"""Timing helpers shared by the GPU benchmark scripts (run as `python benchmarks/<script>.py`)."""
from __future__ import annotations

import statistics

import torch


def time_graph(fn, num_copies: int, reps: int = 7, sample_ms: float = 2.0):
    """Median and spread (µs per call) of fn(i), i over `num_copies` input copies (rotated so the L2
    cache does not hold them), replayed from one CUDA graph; each sample lasts about `sample_ms`."""
    for i in range(num_copies):  # compile and warm outside the capture
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(num_copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); g.replay(); end.record(); torch.cuda.synchronize()  # noqa: E702
    inner = max(1, int(sample_ms / max(start.elapsed_time(end), 1e-3)))
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (inner * num_copies))
    del g
    return statistics.median(samples), max(samples) - min(samples)


def time_eager(fn, num_copies: int, reps: int = 7) -> float:
    """Median µs per call of fn(i), i over `num_copies` input copies, launched eagerly (no graph)."""
    for i in range(num_copies):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        for i in range(num_copies):
            fn(i)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / num_copies)
    return statistics.median(samples)
