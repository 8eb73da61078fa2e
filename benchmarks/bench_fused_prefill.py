"""The fused-hibyte tier at prefill sizes (issue 23): one MoE layer with every expert compressed, against the same
layer bf16-resident, at T = 512, 2048, 8192 tokens on the Mixtral-8x7B and Qwen3-30B-A3B shapes.

Rows (each checked before it is timed):
  grouped          bf16 experts, experts_grouped_mm (the resident engine's prefill path: cutlass grouped GEMMs)
  triton[-TILES]   bf16 experts, fused_moe (the Triton kernel) at the layer's tiles, and at larger ones
  tier[-TILES]     the engine's fused-hibyte tier decoding in the GEMM's tile loads (fused_moe_mixed over tile-major
                   hibyte launchers, exact=False at 4 warps), and the kernel at larger tiles (the config's warps)
  tier-decoded     the tier's launches decoding their experts a chunk at a time, then the bf16 kernel (the engine's
                   path from DECODE_MIN_ROWS routed rows an expert, kernels/fused_moe_hibyte.py)
  decode           hibyte_decode of every expert (w13 and w2) into bf16 buffers, alone
  decode+grouped   that decode, then the grouped GEMMs on the decoded experts (bit-equal to `grouped`)
The Triton rows' outputs are checked within bf16 GEMM tolerance of `grouped` (max error <= 1% of the
output's largest magnitude), the decode bit for bit. Times: medians of
CUDA-event timed calls. Compute floor: 6 x T x top-k x H x I FLOPs at 753 TFLOP/s (../shared/H200.md).

    PYTHONPATH=src python benchmarks/bench_fused_prefill.py [--tokens 512 2048 8192] [--models ...]
        # GPU; JSON in $OUT/bench_fused_prefill.json (or --out DIR)
    PYTHONPATH=src python benchmarks/bench_fused_prefill.py --quick   # CPU smoke (the Triton interpreter, a tiny
        # layer in float32, every row checked, no timings): the CI test
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import traceback

import torch

QUICK = "--quick" in sys.argv
if QUICK and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' import

from pagedmoe.codecs import hibyte  # noqa: E402
from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels.device_info import sm_count  # noqa: E402
from pagedmoe.kernels.fused_moe_config import default_config  # noqa: E402
from pagedmoe.kernels.fused_moe_hibyte import TIER_KERNELS, HiByteExperts, hibyte_decode  # noqa: E402
from pagedmoe.models.layers.moe import experts_grouped_mm  # noqa: E402

MODELS = {
    "mixtral-8x7b": dict(E=8, H=4096, I=14336, A=2),
    "qwen3-30b-a3b": dict(E=128, H=2048, I=768, A=8),
}
FLOPS_PER_S = 753e12
# (label, config fields over the layer's tiles) for the bf16 Triton kernel and the hibyte tier's kernel
TILES = [
    ("m128-n64-w4-s3", dict(block_m=128, block_n=64, num_warps=4, num_stages=3, block_n2=64, num_warps2=4,
                            num_stages2=3)),
    ("m128-n128-w8-s3", dict(block_m=128, block_n=128, num_warps=8, num_stages=3, block_n2=128, num_warps2=8,
                             num_stages2=3)),
    ("m64-n128-w4-s3", dict(block_m=64, block_n=128, num_warps=4, num_stages=3, block_n2=128, num_warps2=4,
                            num_stages2=3)),
    ("m128-n64-w8-s4", dict(block_m=128, block_n=64, num_warps=8, num_stages=4, block_n2=64, num_warps2=8,
                            num_stages2=4)),
]


def timed(fn, reps: int) -> float | None:
    if QUICK:
        return None
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def run_model(name: str, m: dict, tokens: list[int], reps: int, dev, act=torch.bfloat16) -> list[dict]:
    """act: the activations' dtype (float32 in the interpreter, whose dots take no bf16; the weights stay bf16,
    read as float32 by the bf16 rows)."""
    E, H, I, A = m["E"], m["H"], m["I"], m["A"]
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device=dev) * 0.02).bfloat16()
    h13 = hibyte.encode(w13, num_parts=E, order="tile_major", checksum=False)
    h2 = hibyte.encode(w2, num_parts=E, order="tile_major", checksum=False)
    d13, d2 = torch.empty_like(w13, dtype=act), torch.empty_like(w2, dtype=act)
    hibyte_decode(h13, out=d13)
    hibyte_decode(h2, out=d2)
    assert torch.equal(d13, w13.to(act)) and torch.equal(d2, w2.to(act))  # bit for bit (bf16 -> float32 is exact)
    w13, w2 = w13.to(act), w2.to(act)
    every = torch.arange(E, dtype=torch.int32, device=dev)
    fast = TIER_KERNELS["fast"]
    rows = []
    for T in tokens:
        x = torch.randn(T, H, generator=g, device=dev).to(act)
        weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g, device=dev), -1), A, dim=-1)
        floor_us = 6 * T * A * H * I / FLOPS_PER_S * 1e6
        layer_cfg = default_config(T, A, E, H, I, x.dtype, sm_count(dev) if dev.type == "cuda" else 132)
        ref = experts_grouped_mm(x, w13, w2, weights, ids)
        row = dict(model=name, T=T, floor_us=floor_us, us={}, errors={})

        def tier(cfg=None, warps=fast["num_warps"], decoded=False):
            # decoded: the tier's launches decode their experts, then run the bf16 kernel (HiByteExperts'
            # _launch_decoded); else the decode in the GEMM's tile loads, whatever the size
            os.environ["PAGEDMOE_HIBYTE_DECODE_ROWS"] = "0" if decoded else str(1 << 40)
            parts = [(HiByteExperts(h13, exact=False, num_warps=warps), HiByteExperts(h2, exact=False, num_warps=warps),
                      every)]
            return fm.fused_moe_mixed(x, parts, E, weights, ids, config=cfg)

        def decode_only():
            hibyte_decode(h13, out=d13)
            hibyte_decode(h2, out=d2)

        def decode_grouped():
            decode_only()
            return experts_grouped_mm(x, d13, d2, weights, ids)

        cases = [("grouped", lambda: experts_grouped_mm(x, w13, w2, weights, ids), "equal"),
                 ("triton", lambda: fm.fused_moe(x, w13, w2, weights, ids), "close"),
                 ("tier", tier, "close"), ("tier-decoded", lambda: tier(decoded=True), "close")]
        for label, ov in TILES[:1] if QUICK else TILES:  # (the interpreter: one tiling is enough to run the rows)
            cfg = dataclasses.replace(layer_cfg, **ov)
            cases.append((f"triton-{label}", lambda c=cfg: fm.fused_moe(x, w13, w2, weights, ids, config=c), "close"))
            cases.append((f"tier-{label}", lambda c=cfg: tier(c, None), "close"))
        cases += [("decode", decode_only, None), ("decode+grouped", decode_grouped, "equal")]
        for label, fn, check in cases:
            try:
                out = fn()
                if check == "equal" or (QUICK and check == "close" and label.startswith("triton")):
                    # (the interpreter's float32 dots of the Triton rows against torch's: within float32 rounding)
                    if check == "equal":
                        assert torch.equal(out, ref), f"{label} differs from grouped"
                    else:
                        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                elif check == "close":  # bf16 GEMM tolerance, relative to the output's scale
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    row.setdefault("rel_err", {})[label] = err
                    assert err <= 1e-2, f"{label}: max error {err:.3g} of the output's scale"
                row["us"][label] = timed(fn, reps)
                row.setdefault("checked", []).append(label)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
                row["errors"][label] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
        base = row["us"].get("grouped")
        print(f"{name} T={T}: floor {floor_us:.0f} us")
        for label, us in row["us"].items():
            if us is None:
                print(f"  {label:22s} checked")
                continue
            print(f"  {label:22s} {us:10.1f} us  floor/t {floor_us / us:5.2f}" +
                  (f"  x grouped {us / base:5.2f}" if base else ""))
        for label, err in row["errors"].items():
            print(f"  {label:22s} FAILED {err}")
        rows.append(row)
        del x, weights, ids, ref
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CPU smoke: a tiny layer, every row checked, no timings")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_fused_prefill.json")
    args = ap.parse_args()
    if args.quick and not torch.cuda.is_available():
        dev = torch.device("cpu")
        # the tier's rows force either path (tier: the tile loads, tier-decoded: the decode), whatever the size
        res = dict(device="cpu (TRITON_INTERPRET)", rows=run_model(
            "tiny", dict(E=4, H=128, I=64, A=2), [48], 1, dev, act=torch.float32))
    elif not torch.cuda.is_available():
        print("bench_fused_prefill.py needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
        res = dict(device=torch.cuda.get_device_name(), rows=[])
        for name in args.models:
            res["rows"] += run_model(name, MODELS[name], [64] if args.quick else args.tokens, args.reps, dev)
            torch.cuda.empty_cache()
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_fused_prefill.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 1 if any(r["errors"] for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
