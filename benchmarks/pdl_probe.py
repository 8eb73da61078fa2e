"""Programmatic dependent launch (PDL) on the GPU, inside CUDA graphs: does it shorten a chain of dependent
decode-sized kernels, and does prefetching a GEMV's weights into L2 before its wait hide their read?

Three chains, each captured in one CUDA graph and replayed (benchmarks/timing.py), with and without PDL:
  tiny    400 dependent kernels, each y = x * 1.0001 + 1 over 2048 bf16 (one program): the per-kernel cost
          of a latency-bound step (the batch-1 decode runs ~700 kernels a step)
  gemv    48 x (a tiny kernel, then y = W x with W [N, K] bf16, a different W per layer, > L2 in all): the
          decode step's backbone linears after a norm; with PDL the GEMV may also prefetch its weight rows
          into L2 before griddepcontrol.wait (weights never depend on the previous kernel)
Each PDL chain's output is compared with the plain chain's (equal bit for bit: the same kernels, same order).

    PYTHONPATH=src python benchmarks/pdl_probe.py --out $OUT/pdl_probe.json      # < 1 min
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def tiny_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * 1.0001 + 1.0).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def prefetch_l2(ptrs, mask):
    # one L2 prefetch per element's address (pointers 128 bytes apart: one per line)
    return tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                     "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                LINES: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if PREFETCH:  # the whole [BLOCK_N, K] slab, one prefetch per 128-byte line, before the wait
        offs_l = tl.arange(0, LINES) * 64
        prefetch_l2(rows + offs_l[None, :], n_mask[:, None] & (offs_l < K)[None, :])
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_mask)


def time_chain(fn, pdl: bool):
    from timing import time_graph

    return time_graph(lambda i: fn(pdl), 1, reps=7, sample_ms=5.0)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "pdl_probe.json"))
    args = p.parse_args()
    dev = torch.device("cuda")
    res = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__, rows=[])

    # tiny chain
    bufs = [torch.randn(2048, device=dev).to(torch.bfloat16) for _ in range(2)]

    def tiny(pdl, n=400):
        for i in range(n):
            tiny_kernel[(1,)](bufs[i % 2], bufs[(i + 1) % 2], 2048, BLOCK=2048, PDL=pdl, launch_pdl=pdl, num_warps=4)
        return bufs[n % 2]

    start = bufs[0].clone()
    ref = tiny(False).clone()
    bufs[0].copy_(start)
    got = tiny(True).clone()
    row = dict(chain="tiny", kernels=400, equal=bool(torch.equal(ref, got)))
    for pdl in (False, True):
        row["pdl" if pdl else "plain"] = time_chain(tiny, pdl)
    row["us_per_kernel"] = {k: row[k] / 400 for k in ("plain", "pdl")}
    res["rows"].append(row)
    print(row)

    # gemv chain
    for N, K in ((5120, 2048), (2048, 4096), (128, 2048)):
        layers = max(48, -(-(256 << 20) // (N * K * 2)))
        ws = [(torch.randn(N, K, device=dev) * K ** -0.5).to(torch.bfloat16) for _ in range(layers)]
        x = torch.randn(K, device=dev).to(torch.bfloat16)
        xb = torch.empty_like(x)
        y = torch.empty(N, device=dev, dtype=torch.bfloat16)
        block_n = 16 if N >= 4096 else 8 if N >= 1024 else 2
        lines = triton.next_power_of_2(-(-K // 64))

        def chain(pdl, prefetch=False):
            for w in ws:
                tiny_kernel[(1,)](x, xb, K, BLOCK=triton.next_power_of_2(K), PDL=pdl, launch_pdl=pdl, num_warps=4)
                gemv_kernel[(triton.cdiv(N, block_n),)](xb, w, y, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=512,
                                                        LINES=lines, PDL=pdl, PREFETCH=prefetch, launch_pdl=pdl,
                                                        num_warps=4)
            return y

        ref = chain(False).clone()
        row = dict(chain="gemv", N=N, K=K, layers=layers,
                   floor_us=layers * N * K * 2 / 4.0e12 * 1e6,
                   equal=bool(torch.equal(ref, chain(True))) and bool(torch.equal(ref, chain(True, True))),
                   torch_f_linear=None)
        row["plain"] = time_chain(chain, False)
        row["pdl"] = time_chain(chain, True)
        from timing import time_graph
        row["pdl_prefetch"] = time_graph(lambda i: chain(True, True), 1, reps=7, sample_ms=5.0)[0]
        row["prefetch_no_pdl"] = time_graph(lambda i: chain(False, True), 1, reps=7, sample_ms=5.0)[0]

        def cublas():
            for w in ws:
                tiny_kernel[(1,)](x, xb, K, BLOCK=triton.next_power_of_2(K), PDL=False, num_warps=4)
                torch.nn.functional.linear(xb[None], w)
        row["torch_f_linear"] = time_graph(lambda i: cublas(), 1, reps=7, sample_ms=5.0)[0]
        row["us_per_layer"] = {k: row[k] / layers for k in ("plain", "pdl", "pdl_prefetch", "prefetch_no_pdl",
                                                            "torch_f_linear", "floor_us")}
        res["rows"].append(row)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row["us_per_layer"].items()},
              N, K, "equal", row["equal"])
        del ws
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
