"""The decode step's backbone GEMMs on the GPU: F.linear (cuBLAS) against kernels/small_gemm.py.

Shapes: the backbone linears of Qwen3-30B-A3B (H 2048, 32 q / 4 kv heads of 128, E 128, V 151936,
48 layers) and Mixtral-8x7B (H 4096, 32 / 8 heads of 128, E 8, V 32000, 32 layers), as the engine runs
them (q, k and v are three linears), plus the qkv rows as one [5120 or 6144, H] weight for a fused launch;
M = 1, 2, 4, 8, 16 tokens, bf16. Each timed call reads a different copy of the weight (rotated, >= 256 MB in
all, so the 60 MB L2 never holds it, as in a real step where every other layer's weights pass in between);
times are medians of CUDA-graph replays (the engine runs decode in graphs: launch gaps as in a step), in µs
per call. GB/s = bytes read and written (weight, x, output) / time; "of floor" is that over the copy
bandwidth measured in the same run. Each shape is checked against F.linear before it is timed. Then, per
shape at M 1 and 16, a few tile variants around small_gemm_config's (until --max-s). The table ends with the
backbone's time per decode step (the per-layer linears x layers + lm_head) for both paths: --backbone-gemm
auto switches to triton where that sum is lower at every M.

    PYTHONPATH=src python benchmarks/bench_small_gemm.py --out $OUT/bench_small_gemm.json   # < 2 min
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

DEV, DTYPE = "cuda", torch.bfloat16
ROTATE_BYTES = 256 << 20
MAX_COPIES = 4096  # Mixtral's router is 64 KB: 4096 copies pass the L2 too
TOKENS = (1, 2, 4, 8, 16)

# name -> (layers, [(linear, N, K, calls per layer; 0: once per step)])
MODELS = {
    "qwen3-30b-a3b": (48, [("q", 4096, 2048, 1), ("k", 512, 2048, 1), ("v", 512, 2048, 1), ("qkv", 5120, 2048, 0),
                           ("o", 2048, 4096, 1), ("router", 128, 2048, 1), ("lm_head", 151936, 2048, 0)]),
    "mixtral-8x7b": (32, [("q", 4096, 4096, 1), ("k", 1024, 4096, 1), ("v", 1024, 4096, 1), ("qkv", 6144, 4096, 0),
                          ("o", 4096, 4096, 1), ("router", 8, 4096, 1), ("lm_head", 32000, 4096, 0)]),
}
STEP_LINEARS = ("q", "k", "v", "o", "router")  # what the engine runs per layer today (qkv: a fused launch's share)


def gemm_bytes(M: int, N: int, K: int, itemsize: int = 2) -> int:
    """The fewest bytes one x @ W^T moves: W and x read once, the output written once."""
    return (N * K + M * K + M * N) * itemsize


def variants(cfg) -> list:
    """Tile variants around the rule's config (kernels/small_gemm.py) for the sweep."""
    from dataclasses import replace

    out = []
    # one knob at a time, then no split with narrower, deeper tiles (as many programs, no reduction launch)
    for change in (dict(block_n=cfg.block_n * 2), dict(block_n=max(16, cfg.block_n // 2)), dict(block_k=256),
                   dict(block_k=64), dict(split_k=cfg.split_k * 2), dict(split_k=max(1, cfg.split_k // 2)),
                   dict(num_warps=8), dict(num_warps=2), dict(num_stages=3), dict(num_stages=6),
                   dict(block_n=16, block_k=512, split_k=1), dict(block_n=32, block_k=256, split_k=1),
                   dict(block_n=16, block_k=256, split_k=1, num_stages=6)):
        v = replace(cfg, **change)
        if v != cfg and v not in out:
            out.append(v)
    return out


def per_step(rows: list, layers: int, M: int, value) -> float:
    """Sum of value(row) over one decode step's backbone linears at M tokens: the per-layer ones x layers,
    the lm_head once (the fused qkv row is not part of today's step)."""
    return sum(value(r) * (1 if r["linear"] == "lm_head" else layers) for r in rows
               if r["M"] == M and "error" not in r and (r["linear"] in STEP_LINEARS or r["linear"] == "lm_head"))


def sweep_order(by_shape: list) -> list:
    """The shapes (each a list of rows, one per M) in sweep order, what weighs most in a step first: per model,
    the step's linears by bytes x calls per step, then the fused qkv row."""
    def weight(rows):
        r = rows[0]
        once = r["linear"] == "lm_head"
        in_step = once or r["linear"] in STEP_LINEARS
        return list(MODELS).index(r["model"]), not in_step, -r["bytes"] * (1 if once else MODELS[r["model"]][0])
    return sorted(by_shape, key=weight)


def format_table(res: dict) -> str:
    copy_bw = res["copy_bytes_per_s"]
    lines = [f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  copy bandwidth {copy_bw / 1e12:.2f} TB/s",
             f"{'model':<14} {'linear':<8} {'N':>7} {'K':>5} {'M':>3} {'torch us':>9} {'GB/s':>6} {'triton us':>9} "
             f"{'GB/s':>6} {'of floor':>8} {'speedup':>7} {'best variant us':>15}"]
    for r in res["rows"]:
        t, k = r.get("torch", {}), r.get("triton", {})
        if "error" in r:
            lines.append(f"{r['model']:<14} {r['linear']:<8} {r['N']:>7} {r['K']:>5} {r['M']:>3}  "
                         f"error: {r['error'][:60]}")
            continue
        best = r.get("best_variant")
        lines.append(f"{r['model']:<14} {r['linear']:<8} {r['N']:>7} {r['K']:>5} {r['M']:>3} {t['us']:>9.2f} "
                     f"{t['gbps']:>6.0f} {k['us']:>9.2f} {k['gbps']:>6.0f} {k['gbps'] * 1e9 / copy_bw:>8.0%} "
                     f"{t['us'] / k['us']:>6.2f}x {best['us'] if best else float('nan'):>15.2f}")
    for name, step in res["step_ms"].items():
        lines.append(f"{name}: backbone GEMMs per decode step (ms), torch / triton / floor at M = "
                     + ", ".join(f"{M}: {s['torch']:.3f} / {s['triton']:.3f} / {s['floor']:.3f}"
                                 for M, s in step.items()))
    return "\n".join(lines)


def measure_copy_bandwidth() -> float:
    x = torch.empty(256 << 20, device=DEV, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record(); y.copy_(x); end.record(); torch.cuda.synchronize()  # noqa: E702
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * 4 / statistics.median(samples)


def bench_shape(model: str, linear: str, N: int, K: int, copy_bw: float) -> list:
    from pagedmoe.kernels.small_gemm import small_gemm
    from timing import time_graph  # noqa: E402  (benchmarks/ on sys.path)

    copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // (N * K * 2))))
    g = torch.Generator(device=DEV).manual_seed(N + K)
    weights = [(torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(DTYPE) for _ in range(copies)]
    rows = []
    for M in TOKENS:
        x = torch.randn(M, K, device=DEV, generator=g).to(DTYPE)
        row = dict(model=model, linear=linear, N=N, K=K, M=M, copies=copies, bytes=gemm_bytes(M, N, K))
        try:
            ref, got = F.linear(x, weights[0]).float(), small_gemm(x, weights[0]).float()
            row["max_rel_err_vs_torch"] = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
            if row["max_rel_err_vs_torch"] > 2e-2:
                raise AssertionError(f"small_gemm differs from F.linear: rel err {row['max_rel_err_vs_torch']:.3g}")
            for impl, fn in (("torch", lambda i: F.linear(x, weights[i])),
                             ("triton", lambda i: small_gemm(x, weights[i]))):
                us, spread = time_graph(fn, copies)
                row[impl] = dict(us=us, spread_us=spread, gbps=row["bytes"] / us / 1e3)
            row["floor_us"] = row["bytes"] / copy_bw * 1e6
        except Exception:
            row["error"] = traceback.format_exc()[-400:]
            print(row["error"], file=sys.stderr)
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def sweep_shape(rows: list, deadline: float) -> None:
    """Time the tile variants of one shape at M 1 and 16; record each and the best in its row."""
    from pagedmoe.kernels.device_info import sm_count
    from pagedmoe.kernels.small_gemm import small_gemm, small_gemm_config
    from timing import time_graph  # noqa: E402

    N, K = rows[0]["N"], rows[0]["K"]
    base = small_gemm_config(N, K, sm_count(torch.device(DEV)))
    copies = rows[0]["copies"]
    g = torch.Generator(device=DEV).manual_seed(N * 3 + K)
    weights = [(torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(DTYPE) for _ in range(copies)]
    for row in rows:
        if row["M"] not in (1, 16) or "error" in row:
            continue
        x = torch.randn(row["M"], K, device=DEV, generator=g).to(DTYPE)
        ref = F.linear(x, weights[0]).float()
        row["rule_config"], row["variants"] = vars(base), []
        for cfg in variants(base):
            if time.time() > deadline:
                break
            try:
                err = ((small_gemm(x, weights[0], config=cfg).float() - ref).abs().max() / ref.abs().max()).item()
                us, _ = time_graph(lambda i, cfg=cfg: small_gemm(x, weights[i], config=cfg), copies)
                row["variants"].append(dict(config=vars(cfg), us=us, max_rel_err_vs_torch=err))
            except Exception as e:
                row["variants"].append(dict(config=vars(cfg), error=repr(e)[:200]))
        timed = [v for v in row["variants"] if "us" in v and v["max_rel_err_vs_torch"] <= 2e-2]
        if timed:
            row["best_variant"] = min(timed, key=lambda v: v["us"])
    del weights
    torch.cuda.empty_cache()


def main() -> None:
    import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "bench_small_gemm.json"))
    p.add_argument("--max-s", type=float, default=90.0, help="no new sweep variant after this many seconds")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--sweep-only", default="", help="comma-separated linears to sweep (e.g. o,q), default all")
    args = p.parse_args()
    t0 = time.time()
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               commit=os.environ.get("PAGEDMOE_COMMIT", "unknown"), dtype=str(DTYPE), tokens=list(TOKENS),
               copy_bytes_per_s=measure_copy_bandwidth(), rows=[], step_ms={})
    by_shape = []
    for model, (_, linears) in MODELS.items():
        for linear, N, K, _ in linears:
            rows = bench_shape(model, linear, N, K, res["copy_bytes_per_s"])
            res["rows"] += rows
            by_shape.append(rows)
    for rows in ([] if args.no_sweep else sweep_order(by_shape)):
        if args.sweep_only and rows[0]["linear"] not in args.sweep_only.split(","):
            continue
        if time.time() - t0 > args.max_s:
            break
        sweep_shape(rows, t0 + args.max_s)
    for model, (layers, linears) in MODELS.items():
        rows = [r for r in res["rows"] if r["model"] == model]
        res["step_ms"][model] = {M: {key: per_step(rows, layers, M, value) / 1e3 for key, value in (
            ("torch", lambda r: r["torch"]["us"]), ("triton", lambda r: r["triton"]["us"]),
            ("floor", lambda r: r["floor_us"]))} for M in TOKENS}
    res["seconds"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(format_table(res))
    print(f"{res['seconds']:.0f} s; JSON in {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
