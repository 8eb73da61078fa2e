"""What the device memory a run grows after start-up is: any `pagedmoe` command, with torch's allocation history
recorded from the moment each engine is ready (LLMEngine.__init__ returned) to the end of the command.

    python benchmarks/memory_peak.py OUT.json bench latency benchmarks/configs/qwen3-30b-a3b --load-format dummy ...

At the end it replays the recorded allocations and frees, finds the moment the most bytes allocated after
start-up were live at once, and prints those bytes grouped by the innermost pagedmoe frame of their allocation
stack (file:line function), largest first, with the top frames of each. Start-up's own allocations (weights,
KV cache, graph pools) are not in the history, so the sum is what the run added beyond start-up: the part of a
peak over `--gpu-memory-gb` that the budget's reserve did not hold. OUT.json has the same table and the
replay's peak. GPU only (torch.cuda.memory._record_memory_history); the replay (`peak_sites`) is plain Python,
tested on CPU (tests/unit/test_memory_peak.py).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

GiB = 1024 ** 3
MAX_ENTRIES = 1_000_000   # trace events kept (a ring: the oldest drop first; a decode step makes a few thousand)


def site(frames: list[dict]) -> str:
    """The innermost pagedmoe frame of an allocation's stack, else its innermost frame."""
    for f in frames:
        if "pagedmoe" in f.get("filename", "") and "/torch/" not in f.get("filename", ""):
            return f"{f['filename'].rsplit('pagedmoe/', 1)[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def peak_sites(events: list[dict], top: int = 25) -> dict:
    """Replay allocation events (torch's snapshot device_traces: action alloc / free_completed, addr, size,
    frames, time_us) and return the peak of the bytes live at once: {"peak_bytes", "peak_time_us", "sites":
    [(site, bytes, blocks)] largest first, at most `top`}. Frees of blocks allocated before the history began
    are ignored (they were start-up's)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    peak_time = None
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames") or []))
            total += e["size"]
            if total > peak:
                peak, peak_time, peak_live = total, e.get("time_us"), dict(live)
        elif action == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in peak_live.values():
        by_site[where][0] += size
        by_site[where][1] += 1
    sites = sorted(((k, v[0], v[1]) for k, v in by_site.items()), key=lambda r: -r[1])[:top]
    return {"peak_bytes": peak, "peak_time_us": peak_time, "sites": sites}


def main() -> int:
    import torch

    from pagedmoe.cli import main as cli
    from pagedmoe.engine.llm_engine import LLMEngine

    out, argv = sys.argv[1], sys.argv[2:]
    if not torch.cuda.is_available():
        raise SystemExit("memory_peak.py records torch's CUDA allocation history: it needs a CUDA GPU")
    init = LLMEngine.__init__

    def traced(self, *a, **kw):
        init(self, *a, **kw)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        self._memory_peak_start = torch.cuda.memory_allocated()

    LLMEngine.__init__ = traced
    try:
        rc = cli(argv)
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for dev in snap.get("device_traces", []) for e in dev]
    res = peak_sites(events)
    rec = {"command": argv, "events": len(events), "dropped_oldest": len(events) >= MAX_ENTRIES,
           "peak_gib_after_start_up": res["peak_bytes"] / GiB, "peak_time_us": res["peak_time_us"],
           "torch_peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
           "sites": [{"site": s, "gib": b / GiB, "blocks": n} for s, b, n in res["sites"]]}
    with open(out, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"\nallocated after start-up, at its peak: {res['peak_bytes'] / GiB:.3f} GiB in {len(events)} events "
          f"(torch's peak allocation {rec['torch_peak_allocated_gib']:.2f} GiB)")
    for s, b, n in res["sites"]:
        print(f"  {b / GiB:8.3f} GiB  {n:6d} blocks  {s}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
