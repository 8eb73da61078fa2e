"""Host->device bandwidth of every GPU alone and of all of them at once (pinned, 1 GiB copies).

Paged points are bound by PCIe, so on a machine with several GPUs they can only run side by side if the
GPUs do not share a link to host memory. `benchmarks/run_lanes.py` runs this first and keeps the
PCIe-bound stages on GPUs that keep >= 90% of their solo rate while all copy at once.

    python benchmarks/h2d_probe.py [--gib 1] [--reps 6] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import threading

import torch


def _copy_rate(dev: int, src: torch.Tensor, reps: int, barrier: threading.Barrier | None, out: dict) -> None:
    torch.cuda.set_device(dev)
    dst = torch.empty(src.numel(), dtype=src.dtype, device=f"cuda:{dev}")
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up
        stream.synchronize()
        if barrier is not None:
            barrier.wait()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
        end.synchronize()
    out[dev] = reps * src.numel() * src.element_size() / (start.elapsed_time(end) / 1e3) / 1e9


def probe(gib: float = 1.0, reps: int = 6) -> dict:
    n = torch.cuda.device_count()
    # one pinned source per GPU: sharing one would let the copies hit the same host pages (cache effects)
    srcs = [torch.randint(0, 255, (int(gib * 2 ** 30),), dtype=torch.uint8).pin_memory() for _ in range(n)]
    solo: dict = {}
    for d in range(n):
        _copy_rate(d, srcs[d], reps, None, solo)
    together: dict = {}
    barrier = threading.Barrier(n)
    threads = [threading.Thread(target=_copy_rate, args=(d, srcs[d], reps, barrier, together)) for d in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"gpus": n, "gib_per_copy": gib, "solo_gb_per_s": [solo[d] for d in range(n)],
            "together_gb_per_s": [together[d] for d in range(n)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = probe(args.gib, args.reps)
    for d in range(res["gpus"]):
        print(f"GPU {d}: host->device {res['solo_gb_per_s'][d]:.1f} GB/s alone, "
              f"{res['together_gb_per_s'][d]:.1f} GB/s with every GPU copying")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
