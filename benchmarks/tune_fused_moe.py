"""Tune kernels/fused_moe.py's tiles per (expert shape, batch) on the GPU and write the table that
kernels/fused_moe_tuned.py reads (default_config stays the fallback for what the table lacks).

    PYTHONPATH=src python benchmarks/tune_fused_moe.py --models qwen3-30b-a3b mixtral-8x7b --out $OUT/tune
    cp $OUT/tune/fused_moe_NVIDIA_H200_bfloat16.json src/pagedmoe/data/      # then commit it

Search, per shape and batch: for each (block_m, swap_ab), start from default_config with them, take the
fastest w13-GEMM tiles (block_n, block_k, warps, stages) with the w2 tiles fixed, then the fastest w2-GEMM
tiles (block_n2, block_k2, warps2, stages2, split_k) with those: the two GEMMs are separate launches, so
their times add. Every variant's output is checked against the default config's (rel. error < 2e-2 in
bf16) before it is timed; one that fails or does not compile is skipped and recorded. Times: medians of
CUDA-graph replays over --copies copies of the layer (so L2 never holds the weights), benchmarks/timing.py.
Triton compiles a tile set once per shape, so the first batch costs the compiles (~1 s each, ~300 sets)
and later batches only the timings: expected ~5 min per shape for the default 10 batches. The JSON is
rewritten after each batch and no batch starts after --max-s seconds, so a device call cut short keeps
what it measured (a later call with --resume adds the rest).

On CPU (--device cpu, TRITON_INTERPRET=1) it runs the same loop on a tiny shape with wall-clock timing:
that is how the tests check the table it writes loads; the figures mean nothing there.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedmoe.experts.layout import expert_stride, expert_views
from pagedmoe.kernels import fused_moe as fm
from pagedmoe.kernels._attention_checks import next_pow2
from pagedmoe.kernels.fused_moe_tuned import shape_key, table_name

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
W13 = dict(block_n=(16, 32, 64, 128), block_k=(64, 128), warps_stages=((4, 4), (8, 3)))
# split_k 0: the launcher picks the w2 GEMM's K splits by occupancy (choose_split_k)
W2 = dict(block_n2=(16, 32, 64, 128), block_k2=(64, 128), warps_stages=((4, 4), (8, 3)), split_k=(0,))
OUTER = dict(block_m=(16, 32, 64), swap_ab=(False, True))
QUICK = dict(w13=dict(block_n=(16, 32), block_k=(64,), warps_stages=((4, 2),)),
             w2=dict(block_n2=(16, 32), block_k2=(64,), warps_stages=((4, 2),), split_k=(0,)),
             outer=dict(block_m=(16,), swap_ab=(False,)))


def shape_of(name: str) -> dict:
    """E, H, I, A of a model folder under benchmarks/configs/ (or a path), or of 'E,H,I,A'."""
    if name.count(",") == 3:
        E, H, I, A = map(int, name.split(","))
        return dict(name=name, E=E, H=H, I=I, A=A)
    from pagedmoe.planning.model_shape import ModelShape

    path = Path(name) if Path(name).exists() else Path(__file__).parent / "configs" / name
    s = ModelShape.from_hf_config(str(path))
    return dict(name=path.name, E=s.num_experts, H=s.hidden_size, I=s.moe_intermediate_size, A=s.top_k)


def w13_variants(grid: dict) -> list[dict]:
    return [dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
            for n, k, (w, s) in itertools.product(grid["block_n"], grid["block_k"], grid["warps_stages"])]


def w2_variants(grid: dict) -> list[dict]:
    return [dict(block_n2=n, block_k2=k, num_warps2=w, num_stages2=s, split_k=sk)
            for n, k, (w, s), sk in itertools.product(grid["block_n2"], grid["block_k2"], grid["warps_stages"],
                                                      grid["split_k"])]


def make_layers(shape: dict, T: int, copies: int, dtype, device) -> list[dict]:
    E, H, I, A = shape["E"], shape["H"], shape["I"], shape["A"]
    g = torch.Generator(device=device).manual_seed(T)
    layers = []
    for _ in range(copies):
        packed = (torch.randn(E, expert_stride(H, I, torch.tensor([], dtype=dtype).element_size()), generator=g,
                              device=device) * 0.02).to(dtype)
        w13, w2 = expert_views(packed, H, I)
        probs = torch.softmax(torch.randn(T, E, generator=g, device=device), dim=-1)
        weights, ids = torch.topk(probs, A, dim=-1)
        layers.append(dict(packed=packed, w13=w13, w2=w2, x=torch.randn(T, H, generator=g, device=device).to(dtype),
                           weights=weights / weights.sum(-1, keepdim=True), ids=ids,
                           out=torch.empty(T, H, dtype=dtype, device=device)))
    return layers


def timer(device):
    if device.type == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        from timing import time_graph

        return lambda fn, n: time_graph(fn, n, reps=7, sample_ms=3.0)[0]

    def wall(fn, n):  # CPU plumbing runs only: the interpreter's time says nothing about the GPU
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return 1e6 * (time.perf_counter() - t0) / n
    return wall


def tune_batch(shape: dict, T: int, args, dtype, device, time_fn) -> dict:
    layers = make_layers(shape, T, args.copies, dtype, device)
    E, H, I, A = shape["E"], shape["H"], shape["I"], shape["A"]
    default = fm.default_config(T, A, E, H, I, dtype, fm.sm_count(device))

    def run(cfg, i):
        c = layers[i]
        return fm.fused_moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], out=c["out"], config=cfg)

    ref = run(default, 0).float().clone()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    failed, timed = [], 0

    def measure(cfg) -> float:
        nonlocal timed
        try:
            err = ((run(cfg, 0).float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err < tol:
                failed.append({"config": dataclasses.asdict(cfg), "error": f"rel err {err:.2e}"})
                return float("inf")
            timed += 1
            return time_fn(lambda i: run(cfg, i), len(layers))
        except Exception as e:  # a tile set that does not compile or does not fit: skipped, recorded
            failed.append({"config": dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:160]}"})
            return float("inf")

    seen: dict = {}

    def cached(cfg) -> float:  # the descent revisits its starting points: one measurement per config
        if cfg not in seen:
            seen[cfg] = measure(cfg)
        return seen[cfg]

    default_us = cached(default)
    best, best_us = default, default_us
    # block_m past twice the mean rows per expert only pads: not tried
    rows = max(16, 2 * next_pow2(-(-T * A // E)))
    for bm, swap in itertools.product(args.grid["outer"]["block_m"], args.grid["outer"]["swap_ab"]):
        if bm > rows and bm != default.block_m:
            continue
        base = dataclasses.replace(default, block_m=bm, swap_ab=swap)
        cand = min((dataclasses.replace(base, **v) for v in w13_variants(args.grid["w13"])), key=cached)
        cand = min((dataclasses.replace(cand, **v) for v in w2_variants(args.grid["w2"])), key=cached)
        if cached(cand) < best_us:
            best, best_us = cand, cached(cand)
    return {"batch": T, "config": dataclasses.asdict(best), "us": best_us, "default_us": default_us,
            "speedup": default_us / best_us if best_us < float("inf") else None, "timed": timed, "failed": failed}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"],
                   help="benchmarks/configs/ folders, model paths, or E,H,I,A")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--copies", type=int, default=4, help="layer copies rotated through (L2 never holds weights)")
    p.add_argument("--max-s", type=float, default=540.0, help="start no batch after this many seconds")
    p.add_argument("--quick", action="store_true", help="a tiny grid (plumbing runs)")
    p.add_argument("--block-m", type=int, nargs="+", default=None,
                   help=f"block_m values to try (default {OUTER['block_m']}; past twice the rows per expert skipped)")
    p.add_argument("--resume", default=None, help="a table this script wrote: keep its entries, add the rest")
    p.add_argument("--out", default="out/tune")
    args = p.parse_args(argv)
    args.grid = QUICK if args.quick else dict(w13=W13, w2=W2, outer=OUTER)
    if args.block_m:
        args.grid = dict(args.grid, outer=dict(args.grid["outer"], block_m=tuple(args.block_m)))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device (use --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / table_name(device_name, dtype)
    table = json.loads(Path(args.resume).read_text()) if args.resume else {}
    from pagedmoe.kernels.pdl import enabled as pdl_enabled

    # pdl: whether the kernels were timed launched with PDL, as the engine launches them (tiles tuned without it
    # were slower with it on Mixtral-8x7B at batch 1: docs/benchmarks.md)
    table.update({"device": device_name, "dtype": args.dtype, "commit": git_commit(),
                  "triton": __import__("triton").__version__, "torch": torch.__version__,
                  "pdl": pdl_enabled(device)})
    table.setdefault("shapes", {})
    details = {}
    t0, time_fn = time.perf_counter(), timer(device)
    for name in args.models:
        shape = shape_of(name)
        key = shape_key(shape["E"], shape["H"], shape["I"], shape["A"])
        entries = table["shapes"].setdefault(key, {})
        for T in args.batches:
            if str(T) in entries:
                continue
            if time.perf_counter() - t0 > args.max_s:
                print(f"stopping at {args.max_s:.0f} s: {shape['name']} T={T} and later not tuned (use --resume {path})")
                break
            r = tune_batch(shape, T, args, dtype, device, time_fn)
            if r["us"] < float("inf"):
                entries[str(T)] = r["config"]
            details.setdefault(key, {})[str(T)] = r
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            print(f"{shape['name']} ({key}) T={T}: {r['us']:.1f} us vs default {r['default_us']:.1f} us ({speed}), "
                  f"{r['timed']} timed, {len(r['failed'])} skipped", flush=True)
            path.write_text(json.dumps(table, indent=1, sort_keys=True))
            (out_dir / "tune_details.json").write_text(json.dumps(details, indent=1, default=str))
    path.write_text(json.dumps(table, indent=1, sort_keys=True))
    print(f"table: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
