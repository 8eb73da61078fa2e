"""Paged attention on the GPU: correctness against the reference, then decode and prefill timings.

Mixtral-8x7B attention shape (Hq 32, Hkv 8, D 128, bf16, block 16). Decode at batch 1/16/64/256 with
context 1024 and batch 1 at 8k/32k, each against its HBM floor = KV bytes read / HBM bandwidth.
Each timed call reads a different layer's cache (rotating copies, >= 512 MB in all) so L2 does not
hold the KV between calls, as in a real step where the other layers run in between. Times are
CUDA-graph replays of one call per copy (the engine captures decode in graphs), medians of 7.
Prefill: 512-token chunks, fresh and over 7.5k cached tokens, against max(bytes, FLOPs) floors.

    PYTHONPATH=src python benchmarks/bench_attention.py   # writes $OUT/bench_attention.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

import torch
import triton

from pagedmoe.kernels import paged_attention as pa
from pagedmoe.kernels.attention_ref import paged_attention_ref
from timing import time_eager as _time_eager, time_graph as _time_graph  # noqa: E402  (benchmarks/ on sys.path)

HBM_BYTES_PER_S = 4.19e12  # ../shared/H200.md: device-to-device copy, bytes read + written
BF16_FLOPS_PER_S = 753e12  # ../shared/H200.md: bf16 GEMM 8192^3
HQ, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
SCALE = D ** -0.5
DEV = "cuda"
ROTATE_BYTES = 512 << 20


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def reference(q, kc, vc, bt, qsl, lens):
    # On the CPU: attention_ref builds its causal positions with a plain torch.arange (CPU tensors).
    args = [t.cpu() for t in (q.float(), kc.float(), vc.float(), bt, qsl, lens)]
    return paged_attention_ref(*args, SCALE).to(q.device)


def layer_batch(batch, ctx_lens, num_copies, q_len=None, seed=0):
    """Caches for num_copies layers (random bf16), one scattered block table shared by the layers."""
    torch.manual_seed(seed)
    blocks_per_seq = [triton.cdiv(c, BS) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, device=DEV).int()
    width = max(blocks_per_seq)
    bt = torch.zeros(batch, width, dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        bt[b, :n] = perm[used:used + n]
        used += n
    caches = [(torch.randn(num_blocks, BS, HKV, D, device=DEV, dtype=DTYPE),
               torch.randn(num_blocks, BS, HKV, D, device=DEV, dtype=DTYPE)) for _ in range(num_copies)]
    q_lens = q_len or [1] * batch
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    q = [torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=DTYPE) for _ in range(num_copies)]
    return caches, bt, qsl, seq_lens, q


def time_graph(fn, num_copies, reps=7):
    return _time_graph(fn, num_copies, reps=reps, sample_ms=2.0)


def time_eager(fn, num_copies, reps=7):
    return _time_eager(fn, num_copies, reps=reps)


def measure_copy_bandwidth():
    x = torch.randn(256 << 20, device=DEV, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record(); y.copy_(x); end.record(); torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * 4 / statistics.median(samples)


def correctness():
    res = {}
    caches, bt, qsl, lens, q = layer_batch(16, [(i * 997) % 2048 + 1 for i in range(16)], 1)
    kc, vc = caches[0]
    ref = reference(q[0], kc, vc, bt, qsl, lens)
    for splits in (None, 1, 5):
        out = torch.full_like(q[0], float("nan"))
        pa.paged_attention_decode(q[0], kc, vc, bt, lens, SCALE, out=out, max_seq_len=2048, num_splits=splits)
        res[f"decode_b16_splits{splits}"] = rel_err(out, ref) if torch.isfinite(out).all() else float("nan")
    q_lens = [512, 1, 300, 1]
    caches, bt, qsl, lens, q = layer_batch(4, [512, 900, 4096, 33], 1, q_len=q_lens)
    kc, vc = caches[0]
    ref = reference(q[0], kc, vc, bt, qsl, lens)
    out = torch.full_like(q[0], float("nan"))
    pa.paged_attention_prefill(q[0], kc, vc, bt, qsl, lens, SCALE, max(q_lens), out=out)
    res["prefill_mixed"] = rel_err(out, ref) if torch.isfinite(out).all() else float("nan")
    return res


DECODE_VARIANTS = [
    ("auto", {}),
    ("splits1", dict(num_splits=1)),
    ("splits2", dict(num_splits=2)),
    ("splits4", dict(num_splits=4)),
    ("splits8", dict(num_splits=8)),
    ("splits16", dict(num_splits=16)),
    ("n32", dict(block_n=32)),
    ("n128", dict(block_n=128)),
    ("stages3", dict(num_stages=3)),
    ("warps8", dict(num_warps=8)),
]


def bench_decode(batch, ctx):
    kv_bytes = batch * ctx * HKV * D * 2 * DTYPE.itemsize
    copies = max(1, min(64, triton.cdiv(ROTATE_BYTES, kv_bytes)))
    caches, bt, _, lens, q = layer_batch(batch, [ctx] * batch, copies)
    outs = [torch.empty_like(x) for x in q]
    floor_us = kv_bytes / HBM_BYTES_PER_S * 1e6
    auto_splits = pa.choose_num_splits(batch * HKV, ctx, torch.cuda.get_device_properties(0).multi_processor_count)
    row = dict(batch=batch, ctx=ctx, kv_bytes=kv_bytes, copies=copies, floor_us=floor_us, auto_splits=auto_splits,
               variants={})
    for name, kw in DECODE_VARIANTS:
        def fn(i, kw=kw):
            pa.paged_attention_decode(q[i], *caches[i], bt, lens, SCALE, out=outs[i], max_seq_len=ctx, **kw)
        try:
            us, spread = time_graph(fn, copies)
            row["variants"][name] = dict(graph_us=us, spread_us=spread, floor_over_measured=floor_us / us)
            if name == "auto":
                row["variants"][name]["eager_us"] = time_eager(fn, copies)
        except Exception as e:  # keep going: one bad variant must not cost the whole run
            row["variants"][name] = dict(error=repr(e)[:300])
    del caches, q, outs
    torch.cuda.empty_cache()
    return row


PREFILL_VARIANTS = [
    ("auto", {}),
    ("m128w8", dict(block_m=128, num_warps=8)),
    ("n32", dict(block_n=32)),
    ("stages3", dict(num_stages=3)),
]


def bench_prefill(batch, q_len, ctx):
    """batch sequences, each a q_len-token chunk at the end of a ctx-token context."""
    kv_bytes = batch * ctx * HKV * D * 2 * DTYPE.itemsize
    q_bytes = 2 * batch * q_len * HQ * D * DTYPE.itemsize  # q read, out written
    copies = max(1, min(16, triton.cdiv(ROTATE_BYTES, kv_bytes + q_bytes)))
    caches, bt, qsl, lens, q = layer_batch(batch, [ctx] * batch, copies, q_len=[q_len] * batch)
    outs = [torch.empty_like(x) for x in q]
    # Causal: query i of the chunk sees ctx - q_len + i + 1 keys; QK^T and PV are 2 FLOPs a MAC each.
    keys_seen = sum(ctx - q_len + i + 1 for i in range(q_len))
    flops = 4 * batch * HQ * D * keys_seen
    floor_us = max((kv_bytes + q_bytes) / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S) * 1e6
    row = dict(batch=batch, q_len=q_len, ctx=ctx, flops=flops, bytes=kv_bytes + q_bytes, floor_us=floor_us,
               variants={})
    for name, kw in PREFILL_VARIANTS:
        def fn(i, kw=kw):
            pa.paged_attention_prefill(q[i], *caches[i], bt, qsl, lens, SCALE, q_len, out=outs[i], **kw)
        try:
            us, spread = time_graph(fn, copies)
            row["variants"][name] = dict(graph_us=us, spread_us=spread, tflops=flops / us / 1e6,
                                         floor_over_measured=floor_us / us)
        except Exception as e:
            row["variants"][name] = dict(error=repr(e)[:300])
    del caches, q, outs
    torch.cuda.empty_cache()
    return row


def bench_write(num_tokens):
    k = torch.randn(num_tokens, HKV, D, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    num_blocks = triton.cdiv(num_tokens, BS) * 64
    kc = torch.randn(num_blocks, BS, HKV, D, device=DEV, dtype=DTYPE)
    vc = torch.randn_like(kc)
    slots = torch.randperm(num_blocks * BS, device=DEV)[:num_tokens]
    us, _ = time_graph(lambda i: pa.write_kv(k, v, kc, vc, slots), 1)
    floor_us = 2 * 2 * k.numel() * DTYPE.itemsize / HBM_BYTES_PER_S * 1e6
    return dict(tokens=num_tokens, graph_us=us, floor_us=floor_us)


def main():
    t0 = time.time()
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               commit=os.environ.get("PAGEDMOE_COMMIT", "unknown"),
               shape=dict(hq=HQ, hkv=HKV, head_dim=D, block_size=BS, dtype=str(DTYPE)),
               hbm_bytes_per_s_assumed=HBM_BYTES_PER_S)
    try:
        res["copy_bytes_per_s_measured"] = measure_copy_bandwidth()
    except Exception:
        res["copy_bytes_per_s_measured"] = float("nan")
        traceback.print_exc()
    try:
        res["correctness_rel_err"] = correctness()
    except Exception:
        res["correctness_rel_err"] = {"error": float("nan")}
        traceback.print_exc()
    res["decode"], res["prefill"], res["write_kv"] = [], [], []
    for batch, ctx in [(1, 1024), (16, 1024), (64, 1024), (256, 1024), (1, 8192), (1, 32768)]:
        try:
            res["decode"].append(bench_decode(batch, ctx))
        except Exception:
            res["decode"].append(dict(batch=batch, ctx=ctx, error=traceback.format_exc()[-500:]))
    for batch, q_len, ctx in [(8, 512, 512), (1, 512, 8192), (4, 512, 4096)]:
        try:
            res["prefill"].append(bench_prefill(batch, q_len, ctx))
        except Exception:
            res["prefill"].append(dict(batch=batch, q_len=q_len, ctx=ctx, error=traceback.format_exc()[-500:]))
    for n in (1, 64, 256, 4096):
        try:
            res["write_kv"].append(bench_write(n))
        except Exception:
            res["write_kv"].append(dict(tokens=n, error=traceback.format_exc()[-500:]))
    res["wall_s"] = time.time() - t0
    with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
        json.dump(res, f, indent=1)
    print_table(res)


def print_table(res):
    print(f"\n{res['gpu']}  torch {res['torch']}  triton {res['triton']}  commit {res['commit']}")
    print(f"copy bandwidth measured {res['copy_bytes_per_s_measured'] / 1e12:.2f} TB/s "
          f"(floors use {HBM_BYTES_PER_S / 1e12:.2f})")
    print("correctness (rel err vs fp32 reference): "
          + ", ".join(f"{k} {v:.1e}" for k, v in res["correctness_rel_err"].items()))
    print("\nDECODE  Hq32 Hkv8 D128 bf16 block16   (µs per layer call, CUDA-graph replay)")
    print(f"{'batch':>5} {'ctx':>6} {'KV MB':>7} {'floor':>7} {'S':>3} {'auto':>7} {'eager':>7} {'fl/auto':>7} "
          f"{'best':>8} {'µs':>7} {'fl/best':>7}")
    for r in res["decode"]:
        if "error" in r:
            print(f"{r['batch']:>5} {r['ctx']:>6} ERROR {r['error'][-200:]}")
            continue
        ok, auto, best = _variants(r)
        print(f"{r['batch']:>5} {r['ctx']:>6} {r['kv_bytes'] / 1e6:>7.1f} {r['floor_us']:>7.1f} {r['auto_splits']:>3} "
              f"{auto.get('graph_us', float('nan')):>7.1f} {auto.get('eager_us', float('nan')):>7.1f} "
              f"{auto.get('floor_over_measured', float('nan')):>7.2f} {best or '-':>8} "
              f"{ok[best]['graph_us'] if best else float('nan'):>7.1f} "
              f"{ok[best]['floor_over_measured'] if best else float('nan'):>7.2f}")
        _print_errors(r)
        print("      " + "  ".join(f"{k} {v['graph_us']:.1f}" for k, v in ok.items()))
    print("\nPREFILL  512-token chunks  (µs per layer call)")
    print(f"{'batch':>5} {'q':>5} {'ctx':>6} {'floor':>7} {'auto':>8} {'TFLOP/s':>8} {'best':>8} {'µs':>8} {'fl/best':>7}")
    for r in res["prefill"]:
        if "error" in r:
            print(f"{r['batch']:>5} {r['q_len']:>5} {r['ctx']:>6} ERROR {r['error'][-200:]}")
            continue
        ok, auto, best = _variants(r)
        print(f"{r['batch']:>5} {r['q_len']:>5} {r['ctx']:>6} {r['floor_us']:>7.1f} "
              f"{auto.get('graph_us', float('nan')):>8.1f} {auto.get('tflops', float('nan')):>8.1f} {best or '-':>8} "
              f"{ok[best]['graph_us'] if best else float('nan'):>8.1f} "
              f"{ok[best]['floor_over_measured'] if best else float('nan'):>7.2f}")
        _print_errors(r)
    print("\nWRITE_KV  " + "  ".join(
        f"T={r['tokens']}: {r.get('graph_us', float('nan')):.1f} µs (floor {r.get('floor_us', float('nan')):.2f})"
        for r in res["write_kv"]))
    print(f"bench wall {res['wall_s']:.0f} s")


def _variants(r: dict):
    """(variants that ran, the auto variant, the fastest one's name) of one result row."""
    ok = {k: v for k, v in r["variants"].items() if "graph_us" in v}
    best = min(ok, key=lambda k: ok[k]["graph_us"]) if ok else None
    return ok, r["variants"].get("auto", {}), best


def _print_errors(r: dict) -> None:
    errs = {k: v["error"][:120] for k, v in r["variants"].items() if "error" in v}
    if errs:
        print("      variant errors:", errs)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    main()
