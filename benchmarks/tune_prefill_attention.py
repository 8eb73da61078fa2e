"""Tile sweep of the Triton prefill attention (kernels/paged_prefill.py) at the engine's prefill step shape:
8 sequences x 1024 fresh tokens (causal), Qwen3-30B-A3B (Hq 32, Hkv 4) and Mixtral-8x7B (Hq 32, Hkv 8), D 128,
bf16, block 16. Each variant is checked against the fp32 reference (rel err) before it is timed (CUDA-graph
replay, rotating cache copies); TFLOP/s and floor / measured against the 753 TFLOP/s bf16 GEMM ceiling.
Rows ending in `-lazy`: the same tiles with the opt-in lazy rescale of the running max (lazy_rescale=True). Row `torch-flash`: torch's FlashAttention (aten._flash_attention_forward, varlen, causal, GQA) on the same keys
laid out contiguously, as a fresh prefill's own K/V are before they are written to the cache: what a well-kept
kernel gives where no cached context is read (not a backend of the engine yet).

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
    """With quick, the auto tiles and the measured best (m128n32w8s2) only. Otherwise the tile grid with the default per-tile rescale; rows ending in `-lazy` move the running max only when it
    grows by more than 2^8 (lazy_rescale=True), for the auto tiles and the 8-warp tiles of 32 and 64 keys."""
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
    rows["torch-flash"] = measure("torch-flash", lambda: _torch_flash(caches, bt, qsl, q, q_len))
    rows["torch-flash-paged"] = measure("torch-flash-paged", lambda: _torch_flash_paged(caches, bt, qsl, lens, q, q_len))
    for gqa in (False, True):
        name = "torch-cudnn-varlen" + ("-gqa" if gqa else "")
        rows[name] = measure(name, lambda gqa=gqa: _torch_cudnn_varlen(caches, bt, qsl, q, q_len, gqa))
    rows["torch-cudnn-dense"] = measure("torch-cudnn-dense", lambda: _torch_sdpa_dense(caches, bt, q, q_len, "cudnn"))
    return dict(hkv=hkv, batch=batch, q_len=q_len, flops=flops, floor_us=floor_us, variants=rows)


def _torch_flash(caches, bt, qsl, q, q_len):
    """fn(i): torch's varlen FlashAttention over contiguous copies of each sequence's keys (fresh prefill)."""
    kv = _contiguous_kv(caches, bt, q_len)
    cu = qsl.to(torch.int32)
    return lambda i: torch.ops.aten._flash_attention_forward(q[i], kv[i][0], kv[i][1], cu, cu, q_len, q_len, 0.0,
                                                             True, False, scale=ba.SCALE)[0]


def _contiguous_kv(caches, bt, q_len):
    """Each copy's keys and values laid out contiguously, [B * q_len, Hkv, D] (a fresh prefill's own K/V)."""
    pos = torch.arange(q_len, device=bt.device)
    blocks = bt[:, pos // ba.BS].long()                       # [B, q_len]: each key's cache block
    return [(kc[blocks, pos % ba.BS].flatten(0, 1), vc[blocks, pos % ba.BS].flatten(0, 1)) for kc, vc in caches]


def _torch_flash_paged(caches, bt, qsl, lens, q, q_len):
    """fn(i): torch's FlashAttention reading the paged cache through its block table (block_table argument;
    FlashAttention-2 wants pages of >= 256 tokens, so at our block of 16 this row is expected to be refused)."""
    cu = qsl.to(torch.int32)
    return lambda i: torch.ops.aten._flash_attention_forward(
        q[i], caches[i][0], caches[i][1], cu, None, q_len, q_len, 0.0, True, False, scale=ba.SCALE,
        seqused_k=lens, block_table=bt)[0]


def _torch_cudnn_varlen(caches, bt, qsl, q, q_len, gqa: bool):
    """fn(i): cuDNN's fused attention (aten._cudnn_attention_forward) over the ragged batch ([T, H, D] with
    cumulative lengths), keys contiguous; without gqa the KV heads are first repeated to Hq (counted)."""
    kv = _contiguous_kv(caches, bt, q_len)
    cu = qsl.to(torch.int32)
    G = ba.HQ // ba.HKV

    def fn(i):
        k, v = kv[i]
        if not gqa:
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        return torch.ops.aten._cudnn_attention_forward(q[i], k, v, None, cu, cu, q_len, q_len, False, 0.0, True,
                                                       scale=ba.SCALE)[0]
    return fn


def _torch_sdpa_dense(caches, bt, q, q_len, backend: str):
    """fn(i): scaled_dot_product_attention on [B, H, S, D] views (equal lengths only), one backend forced,
    GQA through enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kv = _contiguous_kv(caches, bt, q_len)
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    B = q[0].shape[0] // q_len

    def view(x):
        return x.view(B, q_len, x.shape[1], x.shape[2]).transpose(1, 2)

    def fn(i):
        with sdpa_kernel(be):
            o = torch.nn.functional.scaled_dot_product_attention(view(q[i]), view(kv[i][0]), view(kv[i][1]),
                                                                 is_causal=True, scale=ba.SCALE, enable_gqa=True)
        return o.transpose(1, 2).reshape(q[i].shape)
    return fn


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
