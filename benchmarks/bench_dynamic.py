"""Dynamic expert precision on the GPU (issue 7): controller overhead and a burst of long requests.

Model: Qwen3-30B-A3B-shaped dummy weights (benchmarks/configs/qwen3-30b-a3b, `--load-format dummy`,
prompts are token ids) cut to BENCH_DYNAMIC_LAYERS decoder layers (default 16; every layer keeps the
full shape: 128 experts, H 2048, I 768, top-8) so four engines start and run in under 4 minutes.
bf16, eager (dynamic precision runs eager: CUDA graphs would bake old expert versions).

1. static exact: `--expert-placement resident` with `--num-kv-blocks` forced to 60% of what the burst
   needs; its plan's budget B (weights + activations + KV) is the budget of every other run.
2. dynamic: `--expert-precision dynamic --gpu-memory-gb B` (min int4, default watermarks), same burst.
   Records the precision map at the end and at the step with the fewest free KV blocks (peak).
2b. dynamic_direct: the same with `--quantized-gemm direct` (decode steps multiply each layer's published
   version in place: no double-buffer rewrite per step).
Burst: BENCH_DYNAMIC_REQS requests (default 32) of 2048 random prompt tokens + 256 output tokens
(ignore_eos), all submitted at once: static exact preempts, dynamic does not.

Controller cost (target <= 4%), like for like: a steady workload keeps BENCH_DYNAMIC_INFLIGHT requests
(default REQS) in flight, a new one submitted whenever one finishes, BENCH_DYNAMIC_STEADY_REQS
(default 4 x in flight) in all; the first wave's output lengths are spread 1..OUTPUT so completions
stay staggered. The window is the second half of the constant-in-flight phase (from half of the
requests that finish before the last submission until the last submission); the run stops there.
3. steady: the controller active (default watermarks) at budget B. The window is cut into 8 slices
   (by completions) in ABBA order: in "held" slices the controller's tick is a no-op, so the placement
   it has is held static, in the same engine on the same workload (two engines measured one after the
   other differed by up to 4% with no move in either window: run-to-run noise, not the controller).
cost = held slices' tok/s / controller slices' tok/s - 1. `tick_s`: host time inside the controller.

A CPU smoke run of the script's logic (not a measurement):
BENCH_DYNAMIC_CONFIG=src/pagedmoe/default_model BENCH_DYNAMIC_LAYERS=4 BENCH_DYNAMIC_REQS=8 \
BENCH_DYNAMIC_PROMPT=64 BENCH_DYNAMIC_OUTPUT=16 PYTHONPATH=src python benchmarks/bench_dynamic.py

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
INFLIGHT = int(os.environ.get("BENCH_DYNAMIC_INFLIGHT", str(REQS)))
STEADY_REQS = int(os.environ.get("BENCH_DYNAMIC_STEADY_REQS", str(4 * INFLIGHT)))
COMMON = dict(load_format="dummy", dtype="bfloat16", max_model_len=PROMPT + OUTPUT + 16, max_num_seqs=64,
              max_num_batched_tokens=8192, seed=0)


def model_dir() -> str:
    src = Path(os.environ.get("BENCH_DYNAMIC_CONFIG", ROOT / "configs" / "qwen3-30b-a3b"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = LAYERS
    d = Path(tempfile.mkdtemp(prefix="qwen3-30b-a3b-l%d-" % LAYERS))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def prompts(vocab: int, n: int = REQS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, PROMPT), generator=g).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ticks(engine) -> list:
    """Wraps the precision manager's tick; the returned list's [0] accumulates its host seconds."""
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
    return tick_s


def run_burst(engine, ids, watch_maps: bool = False) -> dict:
    from pagedmoe import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, temperature=0.0)
    mgr = getattr(engine, "precision", None)
    tick_s = time_ticks(engine)
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


# Slices of the steady window, controller on (True) or held (False): ABBA order, so a linear drift
# in the GPU's or the host's speed weighs on both modes alike.
SLICES = (True, False, False, True, True, False, False, True)


def run_steady(engine, ids) -> dict:
    """INFLIGHT requests in flight, a new one whenever one finishes, until all STEADY_REQS are submitted.
    The window (second half of that phase) is cut into len(SLICES) slices by completions; in the
    held slices the controller's tick is replaced by a no-op (the placement it has is held static).
    Times both modes in one engine and stops at the window's end."""
    from pagedmoe import SamplingParams

    mgr = getattr(engine, "precision", None)
    tick_s = time_ticks(engine)
    active_tick = mgr.tick if mgr is not None else None
    n_in = min(INFLIGHT, len(ids))
    # The first wave's lengths are spread so completions (and new prefills) stay staggered.
    lengths = [max(1, (i + 1) * OUTPUT // n_in) for i in range(n_in)] + [OUTPUT] * (len(ids) - n_in)
    submitted = finished = 0

    def submit():
        nonlocal submitted
        p = SamplingParams(max_tokens=lengths[submitted], ignore_eos=True, temperature=0.0)
        engine.add_request(f"s{submitted}", None, p, prompt_token_ids=ids[submitted])
        submitted += 1

    def snapshot():
        _sync()
        s = engine.get_stats()
        return {"t": time.perf_counter(), "tick_s": tick_s[0], "steps": steps, "out": out_tokens,
                "finished": finished, "preempt": s["num_preemptions_total"],
                "moves": (s.get("precision_demotions", 0), s.get("precision_promotions", 0)),
                "counts": mgr.precision_counts() if mgr is not None else None}

    def set_mode(on: bool):
        if mgr is not None:
            mgr.tick = active_tick if on else (lambda: [])

    for _ in range(n_in):
        submit()
    # window: from half the completions of the constant-in-flight phase to the last submission
    start_at, end_at = (len(ids) - n_in) // 2, len(ids) - n_in
    bounds = [start_at + i * (end_at - start_at) // len(SLICES) for i in range(len(SLICES) + 1)]
    snaps: list = []
    steps = out_tokens = 0
    t0 = time.perf_counter()
    while submitted < len(ids) or (len(snaps) < len(bounds) and engine.has_unfinished_requests()):
        while len(snaps) < len(bounds) and finished >= bounds[len(snaps)]:
            snaps.append(snapshot())
            set_mode(SLICES[len(snaps) - 1] if len(snaps) <= len(SLICES) else True)
        if len(snaps) == len(bounds):
            break
        outs = engine.step()
        steps += 1
        out_tokens += len(outs)
        for o in outs:
            if o.finished:
                finished += 1
                if submitted < len(ids):
                    submit()
    set_mode(True)
    while len(snaps) < len(bounds):  # (tiny runs) the window closed before its slices filled
        snaps.append(snapshot())
    w0, w1 = snaps[0], snaps[-1]
    wall = w1["t"] - w0["t"]
    res = {"total_s": w1["t"] - t0, "window_s": wall, "window_steps": w1["steps"] - w0["steps"],
           "window_output_tokens": w1["out"] - w0["out"], "window_finished": w1["finished"] - w0["finished"],
           "window_output_throughput": (w1["out"] - w0["out"]) / max(wall, 1e-9),
           "window_tick_s": w1["tick_s"] - w0["tick_s"],
           "window_preemptions": w1["preempt"] - w0["preempt"],
           "window_demotions": w1["moves"][0] - w0["moves"][0], "window_promotions": w1["moves"][1] - w0["moves"][1],
           "counts_window_start": w0["counts"], "counts_window_end": w1["counts"],
           "num_kv_blocks": engine.get_stats()["num_kv_blocks"]}
    res["window_tick_ms_per_step"] = 1e3 * res["window_tick_s"] / max(res["window_steps"], 1)
    res["window_tick_share"] = res["window_tick_s"] / max(wall, 1e-9)
    # per mode: the slices' sums (held slices: the placement at the slice's start, held static)
    res["slices"] = []
    for on, a, b in zip(SLICES, snaps, snaps[1:]):
        res["slices"].append({"controller": on, "s": b["t"] - a["t"], "steps": b["steps"] - a["steps"],
                              "output_tokens": b["out"] - a["out"],
                              "moves": b["moves"][0] + b["moves"][1] - a["moves"][0] - a["moves"][1]})
    for on, name in ((True, "dynamic"), (False, "held")):
        sl = [x for x in res["slices"] if x["controller"] == on]
        secs, toks = sum(x["s"] for x in sl), sum(x["output_tokens"] for x in sl)
        res[f"{name}_s"], res[f"{name}_output_tokens"] = secs, toks
        res[f"{name}_steps"], res[f"{name}_moves"] = sum(x["steps"] for x in sl), sum(x["moves"] for x in sl)
        res[f"{name}_output_throughput"] = toks / max(secs, 1e-9)
    res["controller_cost"] = res["held_output_throughput"] / max(res["dynamic_output_throughput"], 1e-9) - 1
    if mgr is not None:
        res["final_map"] = mgr.precision_map()
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
    e_vocab = e.model.dims.vocab_size
    ids = prompts(e_vocab)
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
    # 2b. the same burst with --quantized-gemm direct: decode steps multiply the published versions in place
    # instead of rewriting the double buffer every step (copies of exact experts, dequantisation of the rest)
    if torch.cuda.is_available():  # the direct GEMMs are Triton kernels (CUDA only outside the test suite)
        e, start_s = make(model, expert_precision="dynamic", gpu_memory_gb=budget / GiB, quantized_gemm="direct")
        r = run_burst(e, ids, watch_maps=True)
        final_map = r.pop("final_map")
        r.pop("peak_map", None)
        results["dynamic_direct"] = {"start_s": start_s, **r, "final_counts": counts(final_map)}
        dump()
        free_engine(e)
    # 3. steady workload, controller on and held in alternating slices of one engine's window
    steady_ids = prompts(e_vocab, STEADY_REQS, seed=2)
    e, start_s = make(model, expert_precision="dynamic", gpu_memory_gb=budget / GiB)
    r = run_steady(e, steady_ids)
    r["final_counts"] = counts(r.pop("final_map"))
    results["steady"] = {"start_s": start_s, **r}
    results["controller_cost"] = r["controller_cost"]
    results["seconds"] = time.perf_counter() - t_all
    dump()
    free_engine(e)

    print(f"\nQwen3-30B-A3B shape, {LAYERS} layers, budget {results['budget_gib']:.2f} GiB, "
          f"{results['seconds']:.0f} s total; JSON {path}")
    print(f"burst: {REQS} x ({PROMPT} + {OUTPUT}) tokens at once")
    print(f"{'run':<15}{'KV blocks':>10}{'preempt':>9}{'out tok/s':>11}{'wall s':>8}{'tick s':>8}  precision at end")
    for name in [n for n in ("static_exact", "dynamic", "dynamic_direct") if n in results]:
        r = results[name]
        prec = r.get("final_counts") or {"bf16 (resident)": "all"}
        print(f"{name:<15}{r['num_kv_blocks']:>10}{r['num_preemptions']:>9}{r['output_throughput']:>11.1f}"
              f"{r['wall_s']:>8.2f}{r['tick_s']:>8.3f}  {prec}")
    st = results["steady"]
    print(f"steady: {INFLIGHT} in flight, {STEADY_REQS} requests; window = 2nd half of the constant-in-flight phase, "
          f"{st['num_kv_blocks']} KV blocks, {st['window_preemptions']} preemptions, tick "
          f"{st['window_tick_ms_per_step']:.3f} ms/step, precision {st['counts_window_end']}")
    print(f"{'slice':>6}{'controller':>11}{'steps':>7}{'s':>7}{'out tok/s':>11}{'moves':>7}")
    for i, x in enumerate(st["slices"]):
        print(f"{i:>6}{'on' if x['controller'] else 'held':>11}{x['steps']:>7}{x['s']:>7.2f}"
              f"{x['output_tokens'] / max(x['s'], 1e-9):>11.1f}{x['moves']:>7}")
    for name in ("dynamic", "held"):
        print(f"{name:>17}{st[name + '_steps']:>7}{st[name + '_s']:>7.2f}{st[name + '_output_throughput']:>11.1f}"
              f"{st[name + '_moves']:>7}")
    print(f"controller cost: {100 * results['controller_cost']:+.1f}% (held slices' tok/s over the controller's "
          f"slices' tok/s - 1; target <= 4%; negative: dynamic faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
