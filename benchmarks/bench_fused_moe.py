"""Routed-expert GEMMs on the GPU: torch._grouped_mm (experts_grouped_mm) against the Triton fused MoE.

One MoE layer's experts (router output given): Mixtral-8x7B (E 8, H 4096, I 14336, top-2) at
T = 1, 16, 64, 256, 512 and Qwen3-30B-A3B (E 128, H 2048, I 768, top-8) at T = 1, 64, 256, 512, 1024, bf16,
weights as packed per-expert rows (experts/layout.py views). Pass 1, every size: errors of both
paths against experts_loop in fp32 (upcast weights) and of Triton against grouped_mm, then the
times of grouped_mm and of the default Triton config, and a per-kernel breakdown (torch.profiler).
Pass 2, sizes in VARIANT_ORDER until FUSED_MOE_MAX_S seconds have passed: tile variants, each
checked against grouped_mm before it is timed. Each timed call reads a different one of 4 copies of
the layer (own weights and routing), so L2 never holds the weights; times are medians of CUDA-graph
replays (the engine runs decode in graphs), plus eager medians for the two defaults. Bandwidth =
bytes of the experts the routing touches (w13 + w2 of each, once) / time; the copy bandwidth is
re-measured in the same run.

    PYTHONPATH=src python benchmarks/bench_fused_moe.py        # JSON in $OUT/bench_fused_moe.json
    FUSED_MOE_QUICK=1 ...  (6 variants)    FUSED_MOE_MAX_S=200 ...  (stop variants earlier; default 330)

Every variant runs under try/except: a failure is recorded and printed, the run goes on. The JSON is
rewritten after each size, so a run cut short keeps what it measured. The table is printed last.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch
import triton

from pagedmoe.experts.layout import expert_stride, expert_views
from pagedmoe.kernels import fused_moe as fm
from pagedmoe.models.layers.moe import experts_grouped_mm, experts_loop, route_softmax_topk
from timing import time_eager as _time_eager, time_graph as _time_graph  # noqa: E402  (benchmarks/ on sys.path)

HBM_BYTES_PER_S = 4.19e12  # ../shared/H200.md: device-to-device copy, bytes read + written
DEV, DTYPE = "cuda", torch.bfloat16
OUT = os.environ.get("OUT", "out")
MAX_SECONDS = float(os.environ.get("FUSED_MOE_MAX_S", "330"))  # no new variant after this (s)
QUICK = bool(os.environ.get("FUSED_MOE_QUICK"))

MODELS = {
    "mixtral-8x7b": dict(E=8, H=4096, I=14336, A=2, renorm=True, tokens=(1, 16, 64, 256, 512)),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, A=8, renorm=True, tokens=(1, 64, 256, 512, 1024)),
}

VARIANTS = [  # overrides of the default config (default_config by size)
    ("m16", dict(block_m=16)),
    ("m32", dict(block_m=32)),
    ("m64", dict(block_m=64)),
    ("swap_ab", dict(swap_ab=True)),
    ("split1", dict(split_k=1)),
    ("split2", dict(split_k=2)),
    ("split4", dict(split_k=4)),
    ("n32", dict(block_n=32, block_n2=32)),
    ("n128", dict(block_n=128, block_n2=128)),
    ("k128", dict(block_k=128)),
    ("stages3", dict(num_stages=3, num_stages2=3)),
    ("stages5", dict(num_stages=5, num_stages2=5)),
    ("warps8", dict(num_warps=8, num_warps2=8)),
]
# Variants run after every size has its defaults timed, most important sizes first (issue 4: Mixtral decode).
VARIANT_ORDER = [("mixtral-8x7b", 64), ("mixtral-8x7b", 16), ("qwen3-30b-a3b", 64), ("mixtral-8x7b", 1),
                 ("qwen3-30b-a3b", 256), ("mixtral-8x7b", 256), ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 1024)]
QUICK_VARIANTS = ("m16", "m32", "swap_ab", "split1", "split4", "n32")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def git_commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        return out or "unknown"
    except Exception:
        return "unknown"


def measure_copy_bandwidth() -> float:
    x = torch.randn(256 << 20, device=DEV, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(7):
        start.record(); y.copy_(x); end.record(); torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    del x, y
    return 2 * (256 << 20) * 4 / statistics.median(samples)


def make_copies(model: dict, T: int, num_copies: int, seed: int):
    """num_copies layers: packed expert rows (random, 0.02 scale), x, routing from random router logits."""
    E, H, I, A = model["E"], model["H"], model["I"], model["A"]
    torch.manual_seed(seed)
    stride = expert_stride(H, I, 2)
    copies = []
    for _ in range(num_copies):
        packed = torch.randn(E, stride, device=DEV, dtype=DTYPE) * 0.02
        w13, w2 = expert_views(packed, H, I)
        x = torch.randn(T, H, device=DEV, dtype=DTYPE)
        logits = torch.randn(T, E, device=DEV, dtype=torch.float32)
        weights, ids = route_softmax_topk(logits, A, model["renorm"])
        copies.append(dict(packed=packed, w13=w13, w2=w2, x=x, weights=weights, ids=ids,
                           out=torch.empty_like(x)))
    return copies


def touched_bytes(model: dict, ids: torch.Tensor) -> int:
    n = int(torch.unique(ids).numel())
    return n * 3 * model["I"] * model["H"] * 2


def time_graph(fn, num_copies, reps=9):
    return _time_graph(fn, num_copies, reps=reps, sample_ms=5.0)


def time_eager(fn, num_copies, reps=9):
    return _time_eager(fn, num_copies, reps=reps)


def kernel_breakdown(fn, num_copies):
    """Device µs per call of each kernel fn(i) launches (torch.profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile
    for i in range(num_copies):
        fn(i)
    torch.cuda.synchronize()
    reps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for i in range(num_copies):
                fn(i)
        torch.cuda.synchronize()
    res = {}
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "cuda_time_total", 0)
        if dev_us and ev.count:
            res[ev.key[:60]] = round(dev_us / (reps * num_copies), 2)
    return res


def check_size(model: dict, c: dict):
    """Errors of grouped_mm and of the Triton default against an fp32 loop, and Triton vs grouped_mm."""
    x, w13, w2, w, ids = c["x"], c["w13"], c["w2"], c["weights"], c["ids"]
    ref = experts_loop(x.float(), w13.float(), w2.float(), w, ids)
    gm = experts_grouped_mm(x, w13, w2, w, ids)
    out = torch.full_like(x, float("nan"))
    fm.fused_moe(x, w13, w2, w, ids, out=out)
    torch.cuda.synchronize()
    res = dict(grouped_mm_vs_fp32=rel_err(gm, ref), triton_vs_fp32=rel_err(out, ref),
               triton_vs_grouped_mm=rel_err(out, gm), triton_all_written=bool(torch.isfinite(out).all()))
    del ref
    torch.cuda.empty_cache()
    return res


NUM_COPIES = 4


def _recorder(row: dict, touched: float, floor_us: float, copy_bw: float, num_copies: int):
    def record(label, fn, eager=False):
        try:
            us, spread = time_graph(fn, num_copies)
            entry = dict(graph_us=us, spread_us=spread, tb_s=touched / us / 1e6,
                         of_copy_bw=touched / us * 1e6 / copy_bw, floor_over_measured=floor_us / us)
            if eager:
                entry["eager_us"] = time_eager(fn, num_copies)
            print(f"   {label:14s} {us:9.1f} µs ±{spread:6.1f}  {entry['tb_s']:5.2f} TB/s  "
                  f"{entry['floor_over_measured']:.2f} of floor"
                  + (f"  eager {entry['eager_us']:.1f} µs" if eager else ""), flush=True)
        except Exception as e:
            entry = dict(error=repr(e)[:400])
            print(f"   {label:14s} FAILED {e!r}"[:300], flush=True)
        row["variants"][label] = entry
        torch.cuda.synchronize()
        return entry
    return record


def setup_size(name: str, model: dict, T: int):
    E, H, I, A = model["E"], model["H"], model["I"], model["A"]
    copies = make_copies(model, T, NUM_COPIES, seed=T)
    touched = statistics.mean(touched_bytes(model, c["ids"]) for c in copies)
    floor_us = touched / HBM_BYTES_PER_S * 1e6
    cfg = fm.default_config(T, A, E, H, I, DTYPE, torch.cuda.get_device_properties(0).multi_processor_count)
    row = dict(model=name, T=T, E=E, H=H, I=I, A=A, copies=NUM_COPIES, touched_bytes=touched,
               floor_us=floor_us, default_config=cfg.__dict__, variants={})
    return copies, row


def tr_call(c, kw=None):
    fm.fused_moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], out=c["out"], **(kw or {}))


def bench_defaults(name: str, model: dict, T: int, copy_bw: float) -> dict:
    """Pass 1: correctness, grouped_mm and the default Triton config (graph + eager), kernel breakdown."""
    copies, row = setup_size(name, model, T)
    print(f"\n== {name} T={T}: touched {row['touched_bytes'] / 1e9:.3f} GB, floor {row['floor_us']:.1f} µs, "
          f"default {row['default_config']}", flush=True)
    try:
        row["check"] = check_size(model, copies[0])
        print(f"   check: {row['check']}", flush=True)
    except Exception as e:
        row["check"] = dict(error=repr(e)[:400])
        print(f"   check FAILED: {e!r}", flush=True)
        traceback.print_exc()
    record = _recorder(row, row["touched_bytes"], row["floor_us"], copy_bw, NUM_COPIES)

    def gm_fn(i):
        c = copies[i]
        experts_grouped_mm(c["x"], c["w13"], c["w2"], c["weights"], c["ids"])

    record("grouped_mm", gm_fn, eager=True)
    record("triton", lambda i: tr_call(copies[i]), eager=True)
    try:
        row["triton_kernels_us"] = kernel_breakdown(lambda i: tr_call(copies[i]), NUM_COPIES)
        print(f"   kernels: {row['triton_kernels_us']}", flush=True)
    except Exception as e:
        row["triton_kernels_us"] = dict(error=repr(e)[:300])
        print(f"   kernels: profiler failed {e!r}"[:200], flush=True)
    del copies
    torch.cuda.empty_cache()
    return row


def bench_variants(name: str, model: dict, T: int, row: dict, copy_bw: float, t_start: float) -> None:
    """Pass 2: tile variants of the Triton path on fresh copies (same seeds: same routing)."""
    copies, _ = setup_size(name, model, T)
    print(f"\n== variants {name} T={T}", flush=True)
    record = _recorder(row, row["touched_bytes"], row["floor_us"], copy_bw, NUM_COPIES)
    for label, kw in VARIANTS:
        if QUICK and label not in QUICK_VARIANTS:
            continue
        if time.time() - t_start > MAX_SECONDS:
            row["variants"][label] = dict(error="skipped: time budget")
            continue
        try:  # correctness of the variant on copy 0 before timing it
            c = copies[0]
            ref = experts_grouped_mm(c["x"], c["w13"], c["w2"], c["weights"], c["ids"])
            out = torch.full_like(c["x"], float("nan"))
            fm.fused_moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], out=out, **kw)
            err = rel_err(out, ref) if torch.isfinite(out).all() else float("nan")
        except Exception as e:
            row["variants"][label] = dict(error=repr(e)[:400])
            print(f"   {label:14s} FAILED {e!r}"[:300], flush=True)
            continue
        if not err < 2e-2:
            row["variants"][label] = dict(error=f"wrong result: rel err vs grouped_mm {err}")
            print(f"   {label:14s} WRONG rel err {err}", flush=True)
            continue
        entry = record(label, lambda i, kw=kw: tr_call(copies[i], kw))
        entry["err_vs_grouped_mm"] = err
    del copies
    torch.cuda.empty_cache()


def main():
    os.makedirs(OUT, exist_ok=True)
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    copy_bw = measure_copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs; copy bandwidth {copy_bw / 1e12:.2f} TB/s "
          f"(H200.md: {HBM_BYTES_PER_S / 1e12:.2f})", flush=True)
    result = dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  commit=git_commit(), copy_bw_bytes_per_s=copy_bw, hbm_bytes_per_s_ref=HBM_BYTES_PER_S, rows=[])
    path = os.path.join(OUT, "bench_fused_moe.json")
    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    rows = {}
    for name, model in MODELS.items():
        for T in model["tokens"]:
            try:
                rows[name, T] = bench_defaults(name, model, T, copy_bw)
            except Exception as e:  # e.g. out of memory: keep the other sizes
                traceback.print_exc()
                rows[name, T] = dict(model=name, T=T, error=repr(e)[:400])
            result["rows"].append(rows[name, T])
            save()
    for name, T in VARIANT_ORDER:
        if "error" in rows[name, T] or time.time() - t_start > MAX_SECONDS:
            continue
        try:
            bench_variants(name, MODELS[name], T, rows[name, T], copy_bw, t_start)
        except Exception as e:
            traceback.print_exc()
            rows[name, T]["variants_error"] = repr(e)[:400]
        save()

    print(f"\nfused MoE, bf16, {props.name}; TB/s = touched expert bytes / graph-replay median; "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; commit {result['commit'][:12]}")
    hdr = f"{'model':14s} {'T':>5s} {'GB':>6s} {'floor µs':>9s} | {'grouped_mm µs':>13s} {'TB/s':>5s} | " \
          f"{'triton µs':>9s} {'TB/s':>5s} {'err':>7s} | {'best variant':>14s} {'µs':>8s} {'TB/s':>5s} | {'speedup':>7s}"
    print(hdr)
    print("-" * len(hdr))
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['model']:14s} {r['T']:5d}  ERROR {r['error'][:80]}")
            continue
        v = r["variants"]
        gm, tr = v.get("grouped_mm", {}), v.get("triton", {})
        timed = {k: e for k, e in v.items() if k != "grouped_mm" and "graph_us" in e}
        best = min(timed, key=lambda k: timed[k]["graph_us"]) if timed else None
        err = r.get("check", {}).get("triton_vs_fp32", float("nan"))

        def f(e, key, fmt):
            return format(e[key], fmt) if key in e else "fail"
        ratio = f"{gm['graph_us'] / tr['graph_us']:.2f}x" if "graph_us" in gm and "graph_us" in tr else "-"
        print(f"{r['model']:14s} {r['T']:5d} {r['touched_bytes'] / 1e9:6.3f} {r['floor_us']:9.1f} | "
              f"{f(gm, 'graph_us', '13.1f')} {f(gm, 'tb_s', '5.2f')} | {f(tr, 'graph_us', '9.1f')} {f(tr, 'tb_s', '5.2f')} "
              f"{err:7.1e} | {best or '-':>14s} {f(timed.get(best, {}), 'graph_us', '8.1f')} "
              f"{f(timed.get(best, {}), 'tb_s', '5.2f')} | {ratio:>7s}")
    print(f"results: {path} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
