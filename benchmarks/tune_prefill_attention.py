"""Tile sweep of the Triton prefill attention (kernels/paged_prefill.py) at the engine's prefill step shape:
8 sequences x 1024 fresh tokens (causal), Qwen3-30B-A3B (Hq 32, Hkv 4) and Mixtral-8x7B (Hq 32, Hkv 8), D 128,
bf16, block 16. Each variant is checked against the fp32 reference (rel err) before it is timed (CUDA-graph
replay, rotating cache copies); TFLOP/s and floor / measured against the 753 TFLOP/s bf16 GEMM ceiling.
Rows ending in `-lazy`: the same tiles with the opt-in lazy rescale of the running max (lazy_rescale=True).
Rows `torch-KERNEL`: kernels/paged_attention.py::fresh_prefill_attention with each of torch's kernels the engine can
take for a fresh prefill (PAGEDMOE_PREFILL_ATTENTION=KERNEL: cudnn-dense, flash; cuDNN's varlen path cannot be
captured), the gather of the step's keys from the cache included. Before 2026-12-07 (benchmarks/results/session32) these rows called torch's
kernels on keys laid out beforehand and were named torch-cudnn-dense, torch-flash, torch-cudnn-varlen[-gqa].

    PYTHONPATH=src python benchmarks/tune_prefill_attention.py [--batch 8 --q-len 1024]   # $OUT/tune_prefill_attention.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_attention as ba  # noqa: E402
from pagedmoe.kernels import paged_attention as pa  # noqa: E402

SHAPES = {"qwen3-30b-a3b": 4, "mixtral-8x7b": 8}   # KV heads (Hq 32, D 128 for both)


def variants(quick: bool = False):
    """With quick, the auto tiles and the measured best (m128n32w8s2) only. Otherwise the tile grid with the default
    per-tile rescale; rows ending in `-lazy` move the running max only when it grows by more than 2^8
    (lazy_rescale=True), for the auto tiles and the 8-warp tiles of 32 and 64 keys."""
    yield "auto", {}
    if quick:
        yield "m128n32w8s2", dict(block_m=128, block_n=32, num_warps=8, num_stages=2)
        return
    yield "auto-lazy", dict(lazy_rescale=True)
    for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        yield f"m{bm}n{bn}w{w}s{s}", kw
        if w == 8 and bn <= 64 and s <= 3:
            yield f"m{bm}n{bn}w{w}s{s}-lazy", dict(kw, lazy_rescale=True)


def sweep(hkv: int, batch: int, q_len: int, quick: bool = False) -> dict:
    ba.HKV = hkv
    caches, bt, qsl, lens, q = ba.layer_batch(batch, [q_len] * batch, 4, q_len=[q_len] * batch)
    ref = ba.reference(q[0][: q_len], *caches[0], bt[:1], qsl[:2], lens[:1])   # sequence 0 only (CPU reference)
    keys_seen = sum(i + 1 for i in range(q_len))
    flops = 4 * batch * ba.HQ * ba.D * keys_seen
    floor_us = flops / ba.BF16_FLOPS_PER_S * 1e6
    outs = [torch.empty_like(x) for x in q]

    def measure(name: str, make_fn) -> dict:
        """fn(i) -> copy i's output: checked on copy 0 against the reference, then timed. A variant that fails
        (shared memory, or torch without the op) is reported, not fatal."""
        try:
            fn = make_fn()
            err = ba.rel_err(fn(0)[: q_len], ref)
            if not err < 2e-2:
                r = dict(error=f"rel err {err:.3g}")
            else:
                us, spread = ba.time_graph(fn, len(q))
                r = dict(us=us, spread_us=spread, rel_err=err, tflops=flops / us / 1e6, floor_over=floor_us / us)
        except Exception as e:
            r = dict(error=repr(e)[:200])
        print(f"  {name:<16} " + (f"{r['us']:9.1f} us  {r['tflops']:6.1f} TFLOP/s  floor/meas {r['floor_over']:.2f}"
                                  if "us" in r else r["error"]), flush=True)
        return r

    def ours(kw):
        return lambda i: pa.paged_attention_prefill(q[i], *caches[i], bt, qsl, lens, ba.SCALE, q_len, out=outs[i], **kw)

    rows = {name: measure(name, lambda kw=kw: ours(kw)) for name, kw in variants(quick)}
    # torch's kernels as the engine runs them (kernels/paged_attention.py::fresh_prefill_attention: this step's keys
    # gathered from the cache at the slot mapping, then the kernel), one row per PAGEDMOE_PREFILL_ATTENTION value
    pos = torch.arange(q_len, device=bt.device)
    slots = (bt[:, pos // ba.BS].long() * ba.BS + pos % ba.BS).flatten()
    qsl_cpu = qsl.cpu()
    # cuDNN's varlen path ("cudnn", "cudnn-gqa") is left out: it builds its graph at every call (47 ms,
    # session32) and breaks a CUDA-graph capture, which left the process unable to run the next shape (session33)
    for kernel in ("cudnn-dense", "flash"):
        rows[f"torch-{kernel}"] = measure(f"torch-{kernel}", lambda kernel=kernel: lambda i: pa.fresh_prefill_attention(
            q[i], *caches[i], slots, qsl, q_len, ba.SCALE, kernel, qsl_cpu))
    return dict(hkv=hkv, batch=batch, q_len=q_len, flops=flops, floor_us=floor_us, variants=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--q-len", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="auto and the best measured tiles only, beside torch's")
    args = ap.parse_args()
    res = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    for name, hkv in SHAPES.items():
        print(f"=== {name}: Hq {ba.HQ} Hkv {hkv} D {ba.D}, {args.batch} x {args.q_len} causal", flush=True)
        res["shapes"][name] = sweep(hkv, args.batch, args.q_len, args.quick)
        ok = {k: v for k, v in res["shapes"][name]["variants"].items() if "us" in v and not k.startswith("torch")}
        best = min(ok, key=lambda k: ok[k]["us"])
        print(f"best {best}: {ok[best]['us']:.1f} us ({ok[best]['floor_over']:.2f} of floor); "
              f"auto {ok['auto']['us']:.1f} us ({ok['auto']['floor_over']:.2f})", flush=True)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tune_prefill_attention.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
