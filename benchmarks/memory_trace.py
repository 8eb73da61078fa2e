"""Where a run's device memory goes: any `pagedmoe` command with a timeline of the process's device memory.

    python benchmarks/memory_trace.py OUT.json bench sweep benchmarks/configs/qwen3-30b-a3b --budgets 24 ...

Every 50 ms: seconds since start, the process's device memory (GiB, worker/device_memory.py's count), torch's
reserved and allocated GiB, and the engine steps so far; per engine step (every 4th after the first 20):
the same with torch's peaks and the free KV blocks; per dynamic-precision tick that published moves: the
moves, memory, KV blocks lent and the experts' bytes. Plus the start-up stages the engine marked. OUT.json is
rewritten every 2 s, so a run cut by a time limit keeps its trace. GPU only.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

GiB = 1024 ** 3


def main() -> int:
    from pagedmoe.cli import main as cli
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.experts.dynamic.manager import DynamicPrecisionManager
    from pagedmoe.worker import device_memory

    out, argv = sys.argv[1], sys.argv[2:]
    t0 = time.monotonic()
    rec = {"command": argv, "timeline": [], "steps": [], "ticks": [], "engines": []}
    state = {"steps": 0, "engine": None}

    def now() -> float:
        return round(time.monotonic() - t0, 3)

    def process_gib() -> float:
        mon = device_memory._MONITORS.get(torch.cuda.current_device())
        return round(mon.used_bytes() / GiB, 3) if mon is not None else float("nan")

    def dump() -> None:
        mon = device_memory._MONITORS.get(torch.cuda.current_device())
        if mon is not None:
            rec["monitor"] = {"stages_gib": {k: v / GiB for k, v in mon.stages.items()}, "peak_gib": mon.peak_bytes / GiB,
                              "others_gib": mon.others_bytes / GiB, "context_gib": mon.context_bytes / GiB,
                              "context_source": mon.context_source}
        tl = rec["timeline"]
        with open(out + ".tmp", "w") as f:
            json.dump({**rec, "timeline": tl[::max(1, len(tl) // 2000)]}, f)
        os.replace(out + ".tmp", out)

    def sample() -> None:
        torch.cuda.init()
        last = 0.0
        while True:
            rec["timeline"].append((now(), process_gib(), round(torch.cuda.memory_reserved() / GiB, 3),
                                    round(torch.cuda.memory_allocated() / GiB, 3), state["steps"]))
            if time.monotonic() - last > 2:
                dump()
                last = time.monotonic()
            time.sleep(0.05)

    init, step, tick = LLMEngine.__init__, LLMEngine.step, DynamicPrecisionManager.tick

    def traced_init(self, config):
        init(self, config)
        rec["engines"].append({"t": now(), "plan": self.plan.summary(), "stages_gib": {
            k: v / GiB for k, v in (self.memory.stages if self.memory else {}).items()}})

    def traced_step(self):
        r = step(self)
        state["steps"] += 1
        if state["steps"] <= 20 or state["steps"] % 4 == 0:
            rec["steps"].append((now(), state["steps"], process_gib(), round(torch.cuda.max_memory_allocated() / GiB, 3),
                                 round(torch.cuda.max_memory_reserved() / GiB, 3), self.kv.num_free_blocks))
        return r

    def traced_tick(self):
        moves = tick(self)
        if moves:
            rec["ticks"].append((now(), state["steps"], len(moves), process_gib(),
                                 round(torch.cuda.memory_reserved() / GiB, 3), self.withheld,
                                 round(self.runtime.device_bytes / GiB, 3), self.precision_counts()))
        return moves

    LLMEngine.__init__, LLMEngine.step, DynamicPrecisionManager.tick = traced_init, traced_step, traced_tick
    threading.Thread(target=sample, daemon=True).start()
    rc = 1
    try:
        rc = cli(argv)
    finally:
        dump()
    return rc


if __name__ == "__main__":
    sys.exit(main())
