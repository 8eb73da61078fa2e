"""Dequantisation into the compute buffer (kernels/dequant.py) against its HBM floor, per precision and launch shape.

Under --expert-precision dynamic (and the static lossy tiers) every quantized expert of a layer is
dequantised into the layer's compute rows each step; on the H200 at d3607ad that cost ~21 ms of a 29.9 ms
step for 2,048 Qwen3-shaped experts, about a third of the HBM rate (docs/benchmarks.md). This times one
layer's worth (128 Qwen3-30B-A3B experts: w13 [128*1536, 2048], w2 [128*2048, 768]) for fp8 / int8 / int4 and a
grid of (BLOCK_R, BLOCK_K, num_warps), launches queued back to back between CUDA events, two layers
alternated (well over the 50 MB L2). Every variant is first checked bit-exact against the PyTorch
reference (codecs/quant.py::dequantize). Floor: (quantized bytes read + bf16 bytes written) / the
device-to-device copy rate measured in the same run. Then, per precision, one MoE layer's expert GEMMs at
decode sizes (1-256 tokens, top-8): dequantise + fused_moe on the buffer (--quantized-gemm dequant) against
fused_moe_quantized on the quantized weights (direct), their outputs compared bit for bit.

    PYTHONPATH=src python benchmarks/bench_dequant.py [--experts 128] [--out $OUT]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # a CPU smoke run of the script's logic (tiny shapes, Triton interpreter): not a measurement
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedmoe.codecs.quant import dequantize  # noqa: E402
from pagedmoe.experts.tiers.quantized import QuantizedLayer  # noqa: E402
from pagedmoe.kernels.dequant import LAUNCH_SHAPES, dequantize_into  # noqa: E402

from timing import time_eager  # noqa: E402

if not CUDA:  # the interpreter fix the kernel tests use (loops with runtime bounds under numpy >= 2.4)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()

H, I = (2048, 768) if CUDA else (256, 128)   # Qwen3-30B-A3B; CPU smoke: small
DEV = "cuda" if CUDA else "cpu"


def time_call(fn, num_copies: int) -> float:
    if CUDA:
        return time_eager(fn, num_copies)
    t = time.perf_counter()
    for i in range(num_copies):
        fn(i)
    return (time.perf_counter() - t) / num_copies * 1e6


def copy_rate() -> float:
    a = torch.empty(1 << (30 if CUDA else 24), dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    us = time_call(lambda i: b.copy_(a), 1)
    return 2 * a.numel() / (us * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128 if CUDA else 2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    n = args.experts
    stride = 3 * I * H
    bw = copy_rate()
    gpu = torch.cuda.get_device_name() if CUDA else "cpu (smoke run, not a measurement)"
    print(f"{gpu}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)")
    g = torch.Generator(device=DEV).manual_seed(0)
    results = []
    for precision in ("int8", "fp8", "int4") if CUDA else ("int8", "int4"):  # the interpreter has no fp8
        layers = [QuantizedLayer.quantize_rows(
            (torch.randn(n, stride, device=DEV, generator=g) * 0.02).bfloat16(), precision, H, I, list(range(n)),
            torch.device(DEV)) for _ in range(2)]
        # the interpreter's bf16 cast truncates (tests/kernels/test_dequant.py): float32 rows on the CPU
        dtype = torch.bfloat16 if CUDA else torch.float32
        packed = [torch.empty(n, stride, dtype=dtype, device=DEV) for _ in range(2)]
        kinds = [(lay.w13, lay._bases(stride, 0)) for lay in layers], [(lay.w2, lay._bases(stride, 2 * I * H))
                                                                       for lay in layers]
        moved = sum(qt.nbytes for qt in (layers[0].w13, layers[0].w2)) + 2 * n * stride
        refs = [dequantize(lay.w13, dtype) for lay in layers[:1]]
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        # BLOCK_R 64 never won (58408ed: 0.02-0.62 of the floor) and int4 without paired loads reached at most
        # 0.18; of those only the old default (16, 256, 4) stays, as the reference.
        grid = itertools.product((16, 32), (256, 512, 1024), (4, 8), (False, True)) if CUDA else \
            sorted({(16, 256, 4, False), (16, 256, 4, True), LAUNCH_SHAPES[precision]})  # the default among them
        for br, bk, nw, paired in grid:
            if paired and precision != "int4" or precision == "int4" and not paired and (br, bk, nw) != (16, 256, 4):
                continue
            kw = dict(block_r=br, block_k=bk, num_warps=nw, paired=paired)
            packed[0].fill_(float("nan"))
            for qt, bases in (kinds[0][0], kinds[1][0]):
                dequantize_into(qt, packed[0], bases, **kw)
            got = packed[0][:, :2 * I * H].reshape(n * 2 * I, H)
            exact = torch.equal(got.view(bits), refs[0].view(bits))

            def run(i):
                for qt, bases in (kinds[0][i], kinds[1][i]):
                    dequantize_into(qt, packed[i], bases, **kw)

            us = time_call(run, 2)
            r = {"precision": precision, "block_r": br, "block_k": bk, "num_warps": nw, "paired": paired,
                 "us_per_layer": us,
                 "tb_per_s": moved / (us * 1e-6) / 1e12, "floor_us": moved / bw * 1e6, "exact": exact}
            results.append(r)
            print(f"{precision:5s} BLOCK_R {br:3d} BLOCK_K {bk:5d} warps {nw}{' paired' if paired else ''}: "
                  f"{us:8.1f} us per layer, "
                  f"{r['tb_per_s']:.2f} TB/s, {r['floor_us'] / us:.2f} of the floor, exact {exact}", flush=True)
        # One MoE layer's expert GEMMs at decode sizes: dequantise into the buffer, then fused_moe on it
        # (--quantized-gemm dequant), against fused_moe_quantized reading the quantized weights (direct).
        from pagedmoe.experts.layout import expert_views
        from pagedmoe.kernels.fused_moe import fused_moe, fused_moe_quantized

        for T in (1, 16, 64, 256) if CUDA else (2,):
            x = [torch.randn(T, H, device=DEV, generator=g).to(dtype) for _ in range(2)]
            ids = [torch.stack([torch.randperm(n, device=DEV, generator=g)[:8 if n >= 8 else n] for _ in range(T)])
                   for _ in range(2)]
            wts = [torch.full(i.shape, 1.0 / i.shape[1], device=DEV) for i in ids]
            views = [expert_views(p, H, I) for p in packed]

            def via_buffer(i):
                for qt, bases in (kinds[0][i], kinds[1][i]):
                    dequantize_into(qt, packed[i], bases)
                return fused_moe(x[i], *views[i], wts[i], ids[i])

            def direct(i):
                return fused_moe_quantized(x[i], layers[i].w13, layers[i].w2, n, wts[i], ids[i])

            ref, got = via_buffer(0), direct(0)
            same = torch.equal(ref, got)
            # when not bit-equal: the largest difference against the output's scale
            rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
            t_buf, t_dir = time_call(via_buffer, 2), time_call(direct, 2)
            results.append({"precision": precision, "gemm_tokens": T, "us_dequant_then_gemm": t_buf,
                            "us_direct": t_dir, "direct_equal": same, "max_rel_diff": rel})
            print(f"{precision:5s} MoE layer at {T:3d} tokens: dequantise + GEMMs {t_buf:8.1f} us, direct "
                  f"{t_dir:8.1f} us ({t_buf / t_dir:.2f}x), outputs equal {same} (max diff {rel:.1e} of max |out|)",
                  flush=True)
        del layers, packed, kinds
        if CUDA:
            torch.cuda.empty_cache()
    best = {}
    for r in results:
        if "gemm_tokens" in r:
            continue
        if r["exact"] and (r["precision"] not in best or r["us_per_layer"] < best[r["precision"]]["us_per_layer"]):
            best[r["precision"]] = r
    default = {r["precision"]: r for r in results if "gemm_tokens" not in r
               and (r["block_r"], r["block_k"], r["num_warps"], r["paired"]) == LAUNCH_SHAPES[r["precision"]]}
    print("\nprecision  default us  best us  best (BLOCK_R, BLOCK_K, warps, paired)  best / floor")
    for p, r in best.items():
        print(f"{p:9s} {default[p]['us_per_layer']:10.1f} {r['us_per_layer']:8.1f}  "
              f"({r['block_r']}, {r['block_k']}, {r['num_warps']}, {r['paired']}){'':12s}"
              f"{r['floor_us'] / r['us_per_layer']:.2f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_dequant.json"), "w") as f:
        json.dump({"gpu": gpu, "copy_bytes_per_s": bw, "experts": n, "results": results},
                  f, indent=1)


if __name__ == "__main__":
    main()
