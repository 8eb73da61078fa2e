"""Dynamic expert precision on the GPU (issue 7): controller overhead and a burst of long requests.

Model: Qwen3-30B-A3B-shaped dummy weights (benchmarks/configs/qwen3-30b-a3b, `--load-format dummy`,
prompts are token ids) cut to BENCH_DYNAMIC_LAYERS decoder layers (default 16; every layer keeps the
full shape: 128 experts, H 2048, I 768, top-8) so four engines start and run in under 4 minutes.
bf16, eager (dynamic precision runs eager: CUDA graphs would bake old expert versions).

1. static exact: `--expert-placement resident` with `--num-kv-blocks` forced to 60% of what the burst
   needs; its plan's budget B (weights + activations + KV) is the budget of every other run.
2. dynamic: `--expert-precision dynamic --gpu-memory-gb B` (min int4, default watermarks), same burst.
   Records the precision map at the end and at the step with the fewest free KV blocks (peak).
3. held: the same engine with the final map (and 4. the peak map) loaded from an `--expert-stats`
   file and watermarks 0 / 1 (the controller never moves), same burst: the controller's cost is
   dynamic's time against these (target <= 4%). `tick_s` is the host time inside the controller.

Burst: BENCH_DYNAMIC_REQS requests (default 32) of 2048 random prompt tokens + 256 output tokens
(ignore_eos), all submitted at once. A CPU smoke run of the script's logic (not a measurement):
BENCH_DYNAMIC_CONFIG=<a small config folder> BENCH_DYNAMIC_LAYERS=4 BENCH_DYNAMIC_REQS=8 ...

    PYTHONPATH=src python benchmarks/bench_dynamic.py          # JSON in $OUT/bench_dynamic.json
"""
from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
GiB = 1024 ** 3
LAYERS = int(os.environ.get("BENCH_DYNAMIC_LAYERS", "16"))
REQS = int(os.environ.get("BENCH_DYNAMIC_REQS", "32"))
PROMPT = int(os.environ.get("BENCH_DYNAMIC_PROMPT", "2048"))
OUTPUT = int(os.environ.get("BENCH_DYNAMIC_OUTPUT", "256"))
COMMON = dict(load_format="dummy", dtype="bfloat16", max_model_len=PROMPT + OUTPUT + 16, max_num_seqs=64,
              max_num_batched_tokens=8192, seed=0)


def model_dir() -> str:
    src = Path(os.environ.get("BENCH_DYNAMIC_CONFIG", ROOT / "configs" / "qwen3-30b-a3b"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = LAYERS
    d = Path(tempfile.mkdtemp(prefix="qwen3-30b-a3b-l%d-" % LAYERS))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(10, vocab - 10, (REQS, PROMPT), generator=g).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_burst(engine, ids, watch_maps: bool = False) -> dict:
    from pagedmoe import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, temperature=0.0)
    tick_s = [0.0]
    mgr = getattr(engine, "precision", None)
    if mgr is not None:
        tick = mgr.tick

        def timed_tick():
            t = time.perf_counter()
            try:
                return tick()
            finally:
                tick_s[0] += time.perf_counter() - t
        mgr.tick = timed_tick
    _sync()
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=p)
    out_tokens, steps, min_free, peak_map = 0, 0, None, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        out_tokens += len(outs)
        free = engine.kv.num_free_blocks
        if watch_maps and mgr is not None and (min_free is None or free < min_free):
            min_free, peak_map = free, mgr.precision_map()
    _sync()
    wall = time.perf_counter() - t0
    s = engine.get_stats()
    res = {"wall_s": wall, "steps": steps, "output_tokens": out_tokens,
           "output_throughput": out_tokens / wall,
           "total_token_throughput": (out_tokens + REQS * PROMPT) / wall,
           "num_preemptions": s["num_preemptions_total"], "num_kv_blocks": s["num_kv_blocks"],
           "prefill_s": s["step_prefill_s"], "decode_s": s["step_decode_s"], "decode_steps": s["step_decode_steps"],
           "tick_s": tick_s[0]}
    if mgr is not None:
        res.update({k: v for k, v in s.items() if k.startswith(("precision_", "expert_dynamic", "expert_precision", "kv_blocks"))})
        res["final_map"] = mgr.precision_map()
        res["peak_map"] = peak_map
    return res


def make(model: str, **flags):
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.config import EngineConfig

    t = time.perf_counter()
    e = LLMEngine(EngineConfig(model=model, **COMMON, **flags))
    return e, time.perf_counter() - t


def free_engine(e) -> None:
    del e
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def counts(m) -> dict:
    out: dict = {}
    for row in m or []:
        for p in row:
            out[p] = out.get(p, 0) + 1
    return out


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "."))
    model = model_dir()
    t_all = time.perf_counter()
    results: dict = {"layers": LAYERS, "requests": REQS, "prompt_len": PROMPT, "output_len": OUTPUT,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                     "python": platform.python_version()}
    try:
        results["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip()
    except Exception:
        results["commit"] = None
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_dynamic.json"

    def dump():
        path.write_text(json.dumps(results, indent=1))

    blocks_needed = REQS * -(-(PROMPT + OUTPUT) // 16)
    static_blocks = int(0.6 * blocks_needed)
    # 1. static exact, resident, KV forced below the burst's need
    e, start_s = make(model, expert_placement="resident", num_kv_blocks=static_blocks)
    budget = e.plan.budget_bytes
    ids = prompts(e.model.dims.vocab_size)
    results["budget_gib"] = budget / GiB
    results["static_exact"] = {"start_s": start_s, **run_burst(e, ids)}
    dump()
    free_engine(e)
    # 2. dynamic at the same budget
    e, start_s = make(model, expert_precision="dynamic", gpu_memory_gb=budget / GiB)
    r = run_burst(e, ids, watch_maps=True)
    final_map, peak_map = r.pop("final_map"), r.pop("peak_map")
    results["dynamic"] = {"start_s": start_s, **r, "final_counts": counts(final_map),
                          "peak_counts": counts(peak_map)}
    dump()
    free_engine(e)
    # 3./4. the final (peak) map held static: same engine, controller frozen
    for name, m in (("held_final", final_map), ("held_peak", peak_map)):
        if m is None:
            continue
        stats = Path(tempfile.mkdtemp()) / f"{name}.json"
        L = len(m)
        stats.write_text(json.dumps({"total": [[0.0] * len(m[0])] * L, "ema": [[0.0] * len(m[0])] * L,
                                     "decay": 0.99, "precision_map": m}))
        e, start_s = make(model, expert_precision="dynamic", gpu_memory_gb=budget / GiB, expert_stats=str(stats),
                          kv_low_watermark=0.0, kv_high_watermark=1.0)
        held_counts = e.precision.precision_counts()
        r = run_burst(e, ids)
        r.pop("final_map", None), r.pop("peak_map", None)
        results[name] = {"start_s": start_s, **r, "counts": held_counts}
        dump()
        free_engine(e)
    results["seconds"] = time.perf_counter() - t_all
    d = results["dynamic"]
    for name in ("held_final", "held_peak"):
        if name in results:
            results[f"controller_cost_vs_{name}"] = results[name]["output_throughput"] / d["output_throughput"] - 1
    dump()

    print(f"\nQwen3-30B-A3B shape, {LAYERS} layers, {REQS} x ({PROMPT} + {OUTPUT}) tokens, budget "
          f"{results['budget_gib']:.2f} GiB, {results['seconds']:.0f} s total; JSON {path}")
    print(f"{'run':<14}{'KV blocks':>10}{'preempt':>9}{'out tok/s':>11}{'wall s':>8}{'tick s':>8}  precision")
    for name in ("static_exact", "dynamic", "held_final", "held_peak"):
        if name not in results:
            continue
        r = results[name]
        prec = r.get("counts") or r.get("final_counts") or {"bf16 (resident)": "all"}
        print(f"{name:<14}{r['num_kv_blocks']:>10}{r['num_preemptions']:>9}{r['output_throughput']:>11.1f}"
              f"{r['wall_s']:>8.2f}{r['tick_s']:>8.3f}  {prec}")
    for name in ("held_final", "held_peak"):
        k = f"controller_cost_vs_{name}"
        if k in results:
            print(f"controller cost vs {name}: {100 * results[k]:+.1f}% ({name} tok/s over dynamic tok/s - 1; "
                  "target <= 4%; negative: dynamic faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
