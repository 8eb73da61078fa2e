"""One MoE layer with every expert in the tiled lossless format (v2, decoded inside the GEMM) against the same
layer bf16-resident (kernels/fused_moe.py), next to each one's HBM floor (issue 23).

Mixtral-8x7B (E 8, H 4096, I 14336, top-2) and Qwen3-30B-A3B (E 128, H 2048, I 768, top-8) at T = 1, 16, 64,
256 tokens, N(0, 0.02) bf16 weights, random router logits. For each size: the lossless output is checked
torch.equal against fused_moe on the decoded (= original) weights with the same tiles, then both are timed
(medians of CUDA-graph replays over NUM_COPIES copies of the layer, so L2 never holds the weights). Floors =
bytes of the touched experts (bf16: 6IH per expert; lossless: the stored v2 bytes) / 4.19e12 B/s
(../shared/H200.md). A few tile variants of the lossless kernel follow (each checked before it is timed).
The v2 encoder is timed on the GPU on one Mixtral layer's w13 and extrapolated to the model's 45.1 G weights.

    PYTHONPATH=src python benchmarks/bench_fused_lossless.py            # GPU; JSON in $OUT/bench_fused_lossless.json
    PYTHONPATH=src python benchmarks/bench_fused_lossless.py --quick    # CPU smoke (Triton interpreter, tiny
                                                                        # shapes, no timings): the CI test
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch

QUICK = "--quick" in sys.argv
if QUICK and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' import

from pagedmoe.codecs import hibyte, tiled  # noqa: E402
from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels.device_info import sm_count  # noqa: E402
from pagedmoe.kernels.fused_moe import FusedMoEConfig  # noqa: E402
from pagedmoe.kernels.fused_moe_hibyte import FAST_LARGE_TILES, fused_moe_hibyte, layer_tiles, tile_major  # noqa: E402
from pagedmoe.kernels.fused_moe_lossless import fused_moe_lossless, lossless_config, prepare_lossless  # noqa: E402
from pagedmoe.models.layers.moe import experts_loop  # noqa: E402

HBM_BYTES_PER_S = 4.19e12
MIXTRAL_EXPERT_WEIGHTS = 32 * 3 * 8 * 14336 * 4096
NUM_COPIES = 2
MODELS = {
    "mixtral-8x7b": dict(E=8, H=4096, I=14336, A=2),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, A=8),
}
TOKENS = (1, 16, 64, 256)
VARIANTS = [("unrolled", dict(escapes="unrolled")), ("warps4", dict(num_warps=4)),
            ("w2warps8", dict(num_warps2=8)), ("n32", dict(block_n=32, block_n2=32)),
            ("stages2", dict(num_stages=2, num_stages2=2)), ("swap_ab", dict(swap_ab=True)),
            ("k2_128", dict(block_k2=128, num_warps2=8))]
# the hibyte kernel's tiles besides lossless_config's (K stays 64, the format's slice)
HB_VARIANTS = [("warps4", dict(num_warps=4, num_warps2=4)), ("stages3", dict(num_stages=3, num_stages2=3)),
               ("stages4", dict(num_stages=4, num_stages2=4)), ("n128", dict(block_n=128, block_n2=128)),
               ("n32", dict(block_n=32, block_n2=32))]


def make_copies(m: dict, T: int, n: int, dev, dtype, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    E, H, I, A = m["E"], m["H"], m["I"], m["A"]
    copies = []
    for _ in range(n):
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(E, H, I, device=dev, generator=g) * 0.02).bfloat16()
        t13, t2 = tiled.encode(w13, num_parts=E, checksum=False), tiled.encode(w2, num_parts=E, checksum=False)
        x = torch.randn(T, H, device=dev, generator=g).to(dtype)
        logits = torch.randn(T, E, device=dev, generator=g)
        weights, ids = torch.topk(torch.softmax(logits, -1), A, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        fits = H % hibyte.TILE_COLS == 0 and I % hibyte.TILE_COLS == 0  # candidate version 3's shapes
        h13, h2 = (hibyte.encode(w13, num_parts=E), hibyte.encode(w2, num_parts=E)) if fits else (None, None)
        copies.append(dict(w13=w13.to(dtype), w2=w2.to(dtype), t13=t13, t2=t2, h13=h13, h2=h2, x=x, weights=weights,
                           ids=ids, out=torch.empty_like(x)))
    return copies


def touched(m: dict, c: dict) -> tuple[float, float]:
    """(bf16 bytes, lossless bytes) of the experts c's routing touches."""
    used = torch.unique(c["ids"]).numel()
    per_bf16 = 3 * m["I"] * m["H"] * 2
    per_v2 = (c["t13"].nbytes + c["t2"].nbytes) / m["E"]
    return used * per_bf16, used * per_v2


def gpu_encode_rate() -> dict:
    w = (torch.randn(8, 2 * 14336, 4096, device="cuda") * 0.02).bfloat16()
    tiled.encode(w[:1], num_parts=1, checksum=False)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tt = tiled.encode(w, num_parts=8, checksum=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = torch.equal(tiled.decode_reference(tt).view(torch.int16), w.view(torch.int16))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hb = hibyte.encode(w, num_parts=8, checksum=False)  # candidate version 3
    torch.cuda.synchronize()
    dt3 = time.perf_counter() - t0
    ok3 = torch.equal(hibyte.decode_reference(hb).view(torch.int16), w.view(torch.int16))
    return dict(weights=w.numel(), seconds=dt, gweights_s=w.numel() / dt / 1e9, bit_exact=ok,
                mixtral_experts_s=MIXTRAL_EXPERT_WEIGHTS / (w.numel() / dt), ratio=tt.ratio,
                hibyte=dict(seconds=dt3, gweights_s=w.numel() / dt3 / 1e9, bit_exact=ok3, ratio=hb.ratio,
                            mixtral_experts_s=MIXTRAL_EXPERT_WEIGHTS / (w.numel() / dt3)))


def tolerance_check(c: dict, got: torch.Tensor, bf16_out: torch.Tensor) -> dict:
    """An inexact variant's output against a float32 reference on the same (exact) weights: its largest error
    at most twice the bf16 kernel's own (both round silu(gate) * up to bf16 between the GEMMs)."""
    ref = experts_loop(c["x"].float(), c["w13"].float(), c["w2"].float(), c["weights"], c["ids"])
    err = (got.float() - ref).abs().max().item()
    err_bf16 = (bf16_out.float() - ref).abs().max().item()
    return dict(err_vs_fp32=err, bf16_err_vs_fp32=err_bf16, within_tolerance=err <= 2 * err_bf16 + 1e-6,
                max_diff_to_bf16=(got.float() - bf16_out.float()).abs().max().item())


def run_size(name, m, T, dev, dtype, quick, v2_variants=True):
    from timing import time_graph  # benchmarks/ on sys.path

    copies = make_copies(m, T, 1 if quick else NUM_COPIES, dev, dtype, seed=T)
    bf16_b, v2_b = (statistics.mean(v) for v in zip(*(touched(m, c) for c in copies)))
    row = dict(model=name, T=T, touched_bf16_bytes=bf16_b, touched_lossless_bytes=v2_b,
               floor_bf16_us=bf16_b / HBM_BYTES_PER_S * 1e6, floor_lossless_us=v2_b / HBM_BYTES_PER_S * 1e6,
               variants={})

    cfg = lossless_config(T, m["A"], m["E"], m["H"], m["I"], dtype, sm_count(torch.device(dev)))

    def lossless(i, escapes="loop", **ov):
        c = copies[i]
        return fused_moe_lossless(c["x"], c["t13"], c["t2"], c["weights"], c["ids"], out=c["out"], config=cfg,
                                  escapes=escapes, **ov)

    def bf16(i, config=None, **ov):
        c = copies[i]
        return fm.fused_moe(c["x"], c["w13"], c["w2"], c["weights"], c["ids"], out=c["out"], config=config, **ov)

    if not quick:  # the resident baseline at its own (fastest measured) tiles
        row["bf16_default_us"], row["bf16_default_spread_us"] = time_graph(bf16, len(copies))
    for label, ov in [("default", {})] + ([] if quick or not v2_variants else VARIANTS):
        try:
            for c in copies:
                prepare_lossless(c["t13"], c["t2"], dataclasses.replace(cfg, **{k: v for k, v in ov.items()
                                                                                if k != "escapes"}))
            got = lossless(0, **ov).clone()
            ref = bf16(0, config=cfg, **{k: v for k, v in ov.items() if k != "escapes"}).clone()
            entry = dict(equal_to_bf16_gemm=bool(torch.equal(got, ref)))  # same tiles: the same bits
            if not quick:
                entry["lossless_us"], entry["lossless_spread_us"] = time_graph(lambda i: lossless(i, **ov), len(copies))
                entry["lossless_over_bf16"] = entry["lossless_us"] / row["bf16_default_us"]
                entry["lossless_of_floor"] = row["floor_lossless_us"] / entry["lossless_us"]
                print(f"  {name:14s} T={T:4d} {label:9s} lossless {entry['lossless_us']:8.1f} us  bf16 "
                      f"{row['bf16_default_us']:8.1f} us  ratio {entry['lossless_over_bf16']:.3f}  (floors "
                      f"{row['floor_lossless_us']:.1f} / {row['floor_bf16_us']:.1f} us)  equal={entry['equal_to_bf16_gemm']}",
                      flush=True)
        except Exception as e:  # record and go on: one failing variant must not lose the run
            traceback.print_exc()
            entry = dict(error=repr(e)[:400])
        row["variants"][label] = entry
    try:  # candidate version 3 (codecs/hibyte.py, kernels/fused_moe_hibyte.py) at the same tiles
        if copies[0]["h13"] is None:
            raise ValueError(f"no hibyte layer: H {m['H']} and I {m['I']} must be multiples of 64")

        def hb(i, c2=cfg, exact=True, tm=False, join_k=True):
            c = copies[i]
            if tm and "tm" not in c:
                c["tm"] = (tile_major(c["h13"]), tile_major(c["h2"]))
            return fused_moe_hibyte(c["x"], c["h13"], c["h2"], c["weights"], c["ids"], config=c2, exact=exact,
                                    tile_major_bytes=c["tm"] if tm else None, join_k=join_k)
        got, ref = hb(0).clone(), bf16(0, config=cfg).clone()
        hb_bytes = statistics.mean(torch.unique(c["ids"]).numel() * (c["h13"].nbytes + c["h2"].nbytes) / m["E"]
                                   for c in copies)
        entry = dict(equal_to_bf16_gemm=bool(torch.equal(got, ref)), ratio=copies[0]["h13"].ratio,
                     raw_tiles=copies[0]["h13"].raw_tile_share, floor_us=hb_bytes / HBM_BYTES_PER_S * 1e6)
        if not quick:
            entry["us"], entry["spread_us"] = time_graph(hb, len(copies))
            entry["over_bf16"] = entry["us"] / row["bf16_default_us"]
            print(f"  {name:14s} T={T:4d} hibyte    {entry['us']:8.1f} us  bf16 {row['bf16_default_us']:8.1f} us  "
                  f"ratio {entry['over_bf16']:.3f}  (floor {entry['floor_us']:.1f} us, format {entry['ratio']:.3f}, "
                  f"raw tiles {entry['raw_tiles']:.3f})  equal={entry['equal_to_bf16_gemm']}", flush=True)
            entry["variants"] = {}
            # "layer": the tiles the engine's fused-hibyte tier runs at (fused_moe_mixed: the layer's own)
            layer = fm.tuned_config(T, m["A"], m["E"], m["H"], m["I"], dtype, torch.device(dev)) or \
                fm.default_config(T, m["A"], m["E"], m["H"], m["I"], dtype, sm_count(torch.device(dev)))
            # "layer-warps4": the layer's tiles at 4 warps, the engine's candidate (warps4 was the fastest hibyte
            # variant at 7 of 8 sizes on 2026-12-04, over lossless_config's tiles, which are not the layer's)
            layer4 = dataclasses.replace(layer, num_warps=4, num_warps2=4)
            # "m32": at most 32 token rows a block, so tl.dot stays on MMA v2 (mma.sync), where the decoded tile
            # reaches the MMA without the MMA v3 path's piecewise layout conversion (~33 barriers a K step in
            # the SASS of the layer's T = 256 tiles, against 2 for bf16: benchmarks/lossless_sass.py)
            m32 = dataclasses.replace(layer, block_m=min(layer.block_m, 32))
            # "...-k4": exact=False, the decoded tile straight in the MMA operand registers (no shared-memory
            # round trip); not bit-equal: checked against a float32 reference within twice bf16's own error
            # "tm...": the same bytes in tile_major()'s layout (a K step's loads cover whole lines); the engine's
            # tier holds these: tm-k4-warps4 is --compressed-gemm fused-hibyte, tm-halves fused-hibyte-exact
            # (kernels/fused_moe_hibyte.TIER_KERNELS). "-m16": 16 token rows a block where the layer's tiles take
            # more (Mixtral T = 64: block_m 32, 16 rows an expert; tm-k4-warps4 measured 1.39x there, 0.94x at T = 16)
            candidates = [("k4", layer), ("k4-warps4", layer4)] + ([("m32", m32), ("m32-k4", m32)]
                                                                 if layer.block_m > 32 else []) + \
                [("tm", layer), ("tm-warps4", layer4), ("tm-k4-warps4", layer4), ("halves", layer),
                 ("tm-halves", layer)] + \
                ([("tm-k4-warps4-m16", dataclasses.replace(layer4, block_m=16))] if layer.block_m > 16 else [])
            # "tm-k4-tier": the tiles the engine's fused-hibyte tier takes at this size where they are not layer4's
            # (layer_tiles; its fast kernel runs 4 warps, TIER_KERNELS); "tm-k4-m128": FAST_LARGE_TILES from 32 rows
            # an expert up to FAST_LARGE_ROWS, to place that threshold (Mixtral T = 256: 64 rows an expert at
            # block_m 64, so an expert routed more than 64 rows decodes its weights twice)
            tier = dataclasses.replace(layer_tiles(layer, T * m["A"], m["E"], dtype, fast=True), num_warps=4,
                                       num_warps2=4)
            big = dataclasses.replace(layer, **FAST_LARGE_TILES)
            candidates += ([("tm-k4-tier", tier)] if tier != layer4 else []) + \
                ([("tm-k4-m128", big)]
                 if tier.block_m < FAST_LARGE_TILES["block_m"] and T * m["A"] >= 32 * m["E"] else [])
            # where 128-row blocks apply (32 rows an expert or more): their neighbours, to find the fastest there;
            # "swap": the decoded weight tile on the MMA's M side (the token rows are its N)
            if T * m["A"] >= 32 * m["E"]:
                candidates += [("tm-k4-m128-w8", dataclasses.replace(big, num_warps=8, num_warps2=8)),
                               ("tm-k4-m128-n128-w8", dataclasses.replace(big, block_n=128, block_n2=128,
                                                                          num_warps=8, num_warps2=8)),
                               ("tm-k4-m128-s4", dataclasses.replace(big, num_stages=4, num_stages2=4)),
                               ("tm-k4-swap-m128", dataclasses.replace(big, swap_ab=True)),
                               ("tm-k4-swap-m64", dataclasses.replace(layer4, swap_ab=True))]
            for label, ov in ([("layer", None), ("layer-warps4", "layer4")] + HB_VARIANTS +
                              candidates):
                try:
                    exact = "k4" not in label
                    c2 = (layer if ov is None else layer4 if ov == "layer4" else ov
                          if isinstance(ov, FusedMoEConfig) else dataclasses.replace(cfg, **ov))
                    tm = label.startswith("tm")
                    join = not label.endswith("halves")  # a dot per K = 32 half, the kernel before 2026-12-05
                    got, ref = hb(0, c2, exact, tm, join), bf16(0, config=c2)
                    v = dict(equal_to_bf16_gemm=bool(torch.equal(got, ref)), exact=exact)
                    if not exact:
                        v.update(tolerance_check(copies[0], got, ref))
                    v["us"] = time_graph(lambda i: hb(i, c2, exact, tm, join), len(copies))[0]
                    v["over_bf16"] = v["us"] / row["bf16_default_us"]
                    print(f"  {name:14s} T={T:4d} hibyte {label:8s} {v['us']:8.1f} us  ratio {v['over_bf16']:.3f}"
                          f"  equal={v['equal_to_bf16_gemm']}" + ("" if exact else
                          f"  err {v['err_vs_fp32']:.3g} (bf16 {v['bf16_err_vs_fp32']:.3g}, within "
                          f"{v['within_tolerance']})"), flush=True)
                except Exception as e:
                    v = dict(error=repr(e)[:400])
                    print(f"  {name:14s} T={T:4d} hibyte {label:8s} failed: {repr(e)[:200]}", flush=True)
                entry["variants"][label] = v
    except Exception as e:
        traceback.print_exc()
        entry = dict(error=repr(e)[:400])
    row["hibyte"] = entry
    if not quick:
        row["bf16_of_floor"] = row["floor_bf16_us"] / row["bf16_default_us"]
    del copies
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, interpreter, no timings")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-v2-variants", action="store_true",
                    help="time v2 at lossless_config's tiles only (its tile variants were measured on 2026-12-02)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.quick:
        print("bench_fused_lossless times the GPU; on a CPU run it with --quick (a smoke test)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's dots are exact in fp32 only
    models = MODELS if not args.quick else {"tiny-a": dict(E=4, H=64, I=48, A=2), "tiny-b": dict(E=6, H=72, I=40, A=3)}
    tokens = TOKENS if not args.quick else (1, 5)
    res = dict(device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreter)", rows=[])
    if dev == "cuda":
        res["encode"] = gpu_encode_rate()
        print(f"tiled encode on the GPU: {res['encode']['gweights_s']:.2f} G weights/s -> Mixtral experts "
              f"{res['encode']['mixtral_experts_s']:.1f} s (bit-exact {res['encode']['bit_exact']})", flush=True)
        h3 = res["encode"]["hibyte"]
        print(f"hibyte encode on the GPU: {h3['gweights_s']:.2f} G weights/s -> Mixtral experts "
              f"{h3['mixtral_experts_s']:.1f} s (bit-exact {h3['bit_exact']}, ratio {h3['ratio']:.4f})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_fused_lossless.json")
    for name, m in models.items():
        for T in tokens:
            res["rows"].append(run_size(name, m, T, dev, dtype, args.quick, not args.no_v2_variants))
            with open(path, "w") as f:  # rewritten after each size: a run cut short keeps what it measured
                json.dump(res, f, indent=1)
    bad = [(r["model"], r["T"], k) for r in res["rows"] for k, v in r["variants"].items()
           if not v.get("equal_to_bf16_gemm")]
    bad += [(r["model"], r["T"], "hibyte " + k) for r in res["rows"]
            for k, v in [("default", r["hibyte"])] + list(r["hibyte"].get("variants", {}).items())
            if not (v.get("equal_to_bf16_gemm") if v.get("exact", True) else v.get("within_tolerance"))
            and "no hibyte layer" not in v.get("error", "")]
    print(f"wrote {path}; " + (f"NOT equal / failed: {bad}" if bad else "every output equal to the bf16 GEMM's"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
