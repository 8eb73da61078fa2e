"""The prefill MoE layer by stage (models/layers/moe.py::_grouped_mm_chunk, the grouped-GEMM path of a large
step), each stage timed alone against its floor, with tile variants of our Triton stages checked equal (bit for bit)
to the engine's default before they are timed.

Shapes: Qwen3-30B-A3B (E 128, top 8, H 2048, I 768) at 8192 tokens (8 prompts x 1024, the prefill profile's step)
and Mixtral-8x7B (E 8, top 2, H 4096, I 14336) at one grouped_mm chunk (planning/kv_sizing.py). Routing is
uniform random (distinct experts per token), weights N(0, 0.02) bf16.

Stages: sort (argsort of the uint8 ids, expert counts, offsets), gather (token rows in expert order: torch's
x[order // A] against kernels/fused_moe.py::gather_rows tiles), gm1 (grouped GEMM x @ w13), silu (silu_mul tiles),
gm2 (grouped GEMM h @ w2), combine (inverse permutation + moe_sum tiles, unrolled or not), and the whole chunk.
Floors: bytes moved / measured device copy bandwidth for the memory-bound stages, max(FLOPs / 753 TFLOP/s,
weight bytes / bandwidth) for the GEMMs. Times are CUDA-graph replays, medians of 7.

    PYTHONPATH=src python benchmarks/bench_prefill_moe.py [--shapes qwen3-30b-a3b]   # $OUT/bench_prefill_moe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import BF16_FLOPS_PER_S, measure_copy_bandwidth  # noqa: E402
from timing import time_graph  # noqa: E402
from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels import moe_align as ma  # noqa: E402
from pagedmoe.kernels.fused_moe_config import FusedMoEConfig  # noqa: E402
from pagedmoe.models.layers import moe  # noqa: E402
from pagedmoe.planning.kv_sizing import grouped_mm_chunk_tokens  # noqa: E402

SHAPES = {   # E, top-k, hidden, moe intermediate, tokens (None: one grouped_mm chunk)
    "qwen3-30b-a3b": (128, 8, 2048, 768, 8192),
    "mixtral-8x7b": (8, 2, 4096, 14336, None),
}
GATHER_TILES = [(8, 512, 4), (4, 1024, 4), (16, 256, 4), (8, 256, 2), (2, 2048, 8), (1, 2048, 4)]
SILU_TILES = [(8, 512, 4), (4, 1024, 4), (16, 256, 4), (2, 1024, 4), (1, 2048, 8)]
# (block_m, block_n, block_k, warps, stages, block_n2, block_k2) of the Triton fused_moe at prefill sizes
TRITON_TILES = [(64, 128, 64, 4, 4, 128, 64), (128, 128, 64, 8, 3, 128, 64), (128, 64, 64, 4, 4, 128, 64),
                (64, 64, 64, 4, 4, 64, 128), (128, 256, 64, 8, 3, 256, 64)]
SUM_TILES = [(8, 512, 8), (4, 1024, 4), (16, 256, 4), (2, 1024, 4), (1, 2048, 8), (4, 512, 4)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within bf16 GEMM tolerance (another kernel's reduction order): max error <= 2% of b's largest entry."""
    return bool(((a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max()).item())


def routing(T: int, A: int, E: int, dev):
    ids = torch.rand(T, E, device=dev).argsort(dim=1)[:, :A].to(torch.int64)     # distinct experts per token
    w = torch.softmax(torch.randn(T, A, device=dev), dim=1).to(torch.bfloat16)
    return w, ids


def sweep(name: str, bw: float) -> dict:
    E, A, H, I, T = SHAPES[name]
    dev = torch.device("cuda")
    T = T or grouped_mm_chunk_tokens(A, H, I, 2)
    R = T * A
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(T, H, device=dev, generator=g) * 1.0).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    tw, ids = routing(T, A, E, dev)
    flat = ids.reshape(-1)
    order = torch.argsort(flat.to(torch.uint8), stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // A]
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    h = fm.silu_mul(gate_up)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    slot_row = torch.empty_like(order)
    slot_row[order] = torch.arange(R, device=dev)
    out = torch.empty_like(x)
    ref_sum = fm.moe_sum(y.unsqueeze(0), tw, ids, torch.empty_like(x), 1, E, rows=slot_row).clone()
    print(f"=== {name}: T {T} (x{A} = {R} rows) E {E} H {H} I {I}", flush=True)
    rows = {}

    def measure(stage: str, label: str, fn, floor_us: float, check=None) -> None:
        """fn(i) timed (one copy: every stage's operands exceed L2); check() -> bool before timing."""
        key = f"{stage}/{label}"
        try:
            if check is not None and not check():
                rows[key] = dict(error="differs from the default")
            else:
                us, spread = time_graph(lambda i: fn(), 1)
                rows[key] = dict(us=us, spread_us=spread, floor_us=floor_us, floor_over=floor_us / us)
        except Exception as e:   # a tile that does not compile or fit is reported, not fatal
            rows[key] = dict(error=repr(e)[:200])
        r = rows[key]
        print(f"  {key:<28} " + (f"{r['us']:9.1f} us  floor {r['floor_us']:8.1f} us  floor/meas {r['floor_over']:.2f}"
                                  if "us" in r else r["error"]), flush=True)

    mem = lambda nbytes: nbytes / bw * 1e6   # noqa: E731

    def sort_stage():
        o = torch.argsort(flat.to(torch.uint8), stable=True)
        c = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        return o, torch.cumsum(c, 0, dtype=torch.int32)
    measure("sort", "torch", sort_stage, mem(R * (8 + 1 + 8)))

    def sort_searchsorted():   # the engine's since 2026-12-07: end rows from the sorted keys, no counting
        keys, o = torch.sort(flat.to(torch.uint8), stable=True)
        return o, torch.searchsorted(keys, torch.arange(E, device=dev, dtype=keys.dtype), right=True, out_int32=True)
    measure("sort", "searchsorted", sort_searchsorted, mem(R * (8 + 1 + 8)),
            check=lambda: all(torch.equal(a, b) for a, b in zip(sort_searchsorted(), (order, offs))))
    # the Triton path's sort (kernels/moe_align.py): its kernel (O(R^2) counting) against the torch sort it takes
    # above ALIGN_SORT_MIN_SLOTS slots; both exact against each other
    ref_align = ma.moe_align_ref(ids, E, 64)
    for label, cut in (("kernel-m64", R), ("sort-m64", 0)):
        def align(cut=cut):
            saved, ma.ALIGN_SORT_MIN_SLOTS = ma.ALIGN_SORT_MIN_SLOTS, cut
            try:
                return ma.moe_align(ids, E, 64)
            finally:
                ma.ALIGN_SORT_MIN_SLOTS = saved
        measure("align", label, align, mem(R * 8),
                check=lambda align=align: all(torch.equal(a, b) for a, b in zip(align(), ref_align)))

    gather_floor = mem(2 * R * H * 2)   # every routed row read and written once
    measure("gather", "torch", lambda: x[order // A], gather_floor)
    for br, bh, nw in GATHER_TILES:
        fn = lambda br=br, bh=bh, nw=nw: fm.gather_rows(x, order, A, block_r=br, block_h=bh, num_warps=nw)  # noqa: E731
        measure("gather", f"r{br}h{bh}w{nw}", fn, gather_floor, check=lambda fn=fn: torch.equal(fn(), xs))

    def gemm_floor(n: int, k: int) -> float:
        return max(2 * R * n * k / BF16_FLOPS_PER_S, (E * n * k + R * (n + k)) * 2 / bw) * 1e6
    measure("gm1", "grouped_mm", lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs), gemm_floor(2 * I, H))

    silu_floor = mem(R * 3 * I * 2)
    for bm, bi, nw in SILU_TILES:
        fn = lambda bm=bm, bi=bi, nw=nw: fm.silu_mul(gate_up, block_m=bm, block_i=bi, num_warps=nw)  # noqa: E731
        measure("silu", f"m{bm}i{bi}w{nw}", fn, silu_floor, check=lambda fn=fn: torch.equal(fn(), h))

    measure("gm2", "grouped_mm", lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), gemm_floor(H, I))

    def inverse():
        s = torch.empty_like(order)
        s[order] = torch.arange(R, device=dev)
        return s
    measure("combine", "inverse", inverse, mem(R * 8 * 2))
    sum_floor = mem((R + T) * H * 2)
    for (bt, bh, nw), unroll in [(t, u) for t in SUM_TILES for u in (False, True)]:
        fn = lambda bt=bt, bh=bh, nw=nw, u=unroll: fm.moe_sum(y.unsqueeze(0), tw, ids, out, 1, E, rows=slot_row,  # noqa: E731
                                                               block_t=bt, block_h=bh, num_warps=nw, unroll=u)
        measure("combine", f"t{bt}h{bh}w{nw}" + ("-unroll" if unroll else ""), fn, sum_floor,
                check=lambda fn=fn: torch.equal(fn(), ref_sum))

    chunk_out = torch.empty_like(x)
    floor = (gemm_floor(2 * I, H) + gemm_floor(H, I) + gather_floor + silu_floor + sum_floor)
    measure("chunk", "engine", lambda: moe._grouped_mm_chunk(x, w13, w2, tw, ids, chunk_out), floor,
            check=lambda: (moe._grouped_mm_chunk(x, w13, w2, tw, ids, chunk_out), torch.equal(chunk_out, ref_sum))[1])
    # The Triton path (kernels/fused_moe.py, the decode path's kernels) at this size: the gather read through the
    # sorted slots inside the w13 GEMM and silu(gate) * up in its epilogue, so two of the grouped path's passes
    # over the routed rows go; large-M tiles. Checked against the grouped chunk within bf16 tolerance (other sums).
    for bm, bn, bk, nw, ns, bn2, bk2 in TRITON_TILES:
        cfg = FusedMoEConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                             block_n2=bn2, block_k2=bk2, num_warps2=nw, num_stages2=ns, split_k=1)
        fn = lambda cfg=cfg: fm.fused_moe(x, w13, w2, tw, ids, out=chunk_out, config=cfg)  # noqa: E731
        measure("chunk", f"triton-m{bm}n{bn}k{bk}w{nw}s{ns}-n{bn2}k{bk2}", fn, floor,
                check=lambda fn=fn: _close(fn(), ref_sum))
    best = {}
    for key, r in rows.items():
        stage = key.split("/")[0]
        if "us" in r and (stage not in best or r["us"] < rows[best[stage]]["us"]):
            best[stage] = key
    print("best per stage: " + ", ".join(f"{k} {rows[k]['us']:.1f} us" for k in best.values()), flush=True)
    return dict(E=E, top_k=A, hidden=H, inter=I, tokens=T, rows=rows, best=best)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = measure_copy_bandwidth()
    res = {"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "shapes": {}}
    print(f"{res['gpu']}: device copy {bw / 1e12:.2f} TB/s", flush=True)
    for name in args.shapes:
        res["shapes"][name] = sweep(name, bw)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_prefill_moe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
