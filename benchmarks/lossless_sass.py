"""Instructions per weight in the K loop of the fused lossless MoE GEMM (kernels/fused_moe_lossless.py) against the
bf16 kernel at the same tiles, from the SASS Triton's own ptxas makes for sm_90 (no GPU needed; cuobjdump -sass).

    PYTHONPATH=src python benchmarks/lossless_sass.py [--tokens 1 16] [--out DIR]

Why (issue 23): a decode step's MoE GEMM at small batches is bound by HBM, ~8 bf16 weights per clock per SM on
the H200 (4.2 TB/s over 132 SMs at 1.98 GHz). An SM issues at most 4 warp instructions per clock, so a kernel
that keeps bf16's time may spend at most ~0.5 warp instructions per weight, everything included (an issue-rate
bound: latency that too few warps cannot hide comes on top), and one that runs at the compressed bytes' own
floor (0.75 of bf16's) 0.375. The static count of the loop body (the loop that holds the MMAs) is an upper
bound for branches not taken (the escape patches) and exact for straight-line code (ESC_CAP 0: a tensor without
escapes). Writes lossless_sass.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

from lossless_ptxas import BF16_ARGS, LOSSLESS_ARGS, MODELS, compile_kernel, mma_operands  # leaves the interpreter

import torch  # noqa: E402
import triton  # noqa: E402

from pagedmoe.kernels.fused_moe import fused_moe_kernel  # noqa: E402
from pagedmoe.kernels.fused_moe_hibyte import fused_moe_hibyte_kernel  # noqa: E402
from pagedmoe.kernels.fused_moe_lossless import fused_moe_lossless_kernel, lossless_config  # noqa: E402

HIBYTE_ARGS = ["a_ptr", "lo_ptr", "code_ptr", "base_ptr", "tile_raw_ptr", "high_ptr", "out_ptr", "sorted_slots_ptr",
               "block_expert_ptr", "slot_ptr", "num_slots", "num_blocks", "N", "K", "k_per_split", "part_rows",
               "stride_a", "stride_os", "stride_om"]

ISSUE_BUDGET = 0.5  # warp instructions per weight at bf16's HBM rate (4 issues / clock / SM, ~8 weights / clock)


def sass(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def mma_loop(text: str) -> collections.Counter:
    """Opcode counts of the largest loop (a backward branch) that holds an MMA instruction."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    mmas = [a for a, t in ins if "MMA" in t.split()[1 if t.startswith("@") else 0]]
    best = None
    for a, t in ins:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if target and int(target.group(1), 16) < a:
            lo = int(target.group(1), 16)
            if any(lo <= m <= a for m in mmas):
                body = [x for x in ins if lo <= x[0] <= a]
                if best is None or len(body) > len(best):
                    best = body
    ops = collections.Counter()
    for _, t in best or []:
        op = t.split()[1] if t.startswith("@") else t.split()[0]
        ops[op.split(".")[0]] += 1
    return ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for name, m in MODELS.items():
        for T in args.tokens:
            cfg = lossless_config(T, m["A"], m["E"], m["H"], m["I"], torch.bfloat16)
            common = dict(TOP_K=m["A"], GATED=True, SWAP_AB=cfg.swap_ab, EVEN_K=True, EVEN_N=True, BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="ieee")
            weights = 2 * cfg.block_n * cfg.block_k  # gate and up tiles per K step
            variants = {"bf16": (fused_moe_kernel, BF16_ARGS, ["*bf16", "*bf16", "*bf16", "*i32", "*i32", "*fp32", "*i32"]
                                 + ["i32"] * 13, dict(common, QUANT=0, GROUP=128, USE_SLOTS=False))}
            for cap in (0, -1, 8):
                variants[f"lossless esc {cap}"] = (
                    fused_moe_lossless_kernel, LOSSLESS_ARGS,
                    ["*bf16", "*u8", "*u8", "*u8", "*i32", "*i32", "*bf16", "*i32", "*i32", "*i32"] + ["i32"] * 12,
                    dict(common, ESC_CAP=cap, USE_SLOTS=False))
            hb = {k: v for k, v in common.items() if k != "EVEN_K"}
            # candidate version 3 (codecs/hibyte.py); "k4": exact=False, no layout copy before the MMA; "tm": the
            # bytes in kernels/fused_moe_hibyte.tile_major()'s layout; "halves": a dot per K = 32 half (JOIN_K off,
            # the kernel before 2026-12-05)
            for label, raw, packed, exact in (("hibyte", False, False, True), ("hibyte raw", True, False, True),
                                              ("hibyte packed", False, True, True),
                                              ("hibyte packed raw", True, True, True),
                                              ("hibyte packed k4", False, True, False),
                                              ("hibyte packed raw k4", True, True, False),
                                              ("hibyte packed raw tm", True, True, True),
                                              ("hibyte packed raw halves", True, True, True)):
                variants[label] = (
                    fused_moe_hibyte_kernel, HIBYTE_ARGS,
                    ["*bf16", "*u8", "*u8", "*u8", "*i32", "*u8", "*bf16", "*i32", "*i32", "*i32"] + ["i32"] * 9,
                    dict(hb, HAS_RAW=raw, USE_SLOTS=False, PACKED=packed, EXACT=exact, TILE_MAJOR=label.endswith("tm"),
                         JOIN_K=not label.endswith("halves")))
            for label, (kernel, names, types, const) in variants.items():
                compiled = compile_kernel(kernel, names, types, const, args.arch, cfg.num_warps, cfg.num_stages)
                ops = mma_loop(sass(compiled.asm["cubin"]))
                # the dots' MMA encodings and operand layouts (the bit-exactness condition, compile_sm90.py)
                mmas = sorted({json.dumps(m, sort_keys=True) for m in mma_operands(compiled.asm["ttgir"])})
                total = sum(ops.values())
                per_weight = total * cfg.num_warps / weights
                rows.append(dict(model=name, tokens=T, kernel=label, block_m=cfg.block_m, block_n=cfg.block_n,
                                 block_k=cfg.block_k, num_warps=cfg.num_warps, loop_instructions=total, mma=mmas,
                                 warp_instructions_per_weight=per_weight, opcodes=dict(ops.most_common())))
                top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
                print(f"{name:14s} T={T:<4d} {label:16s} loop {total:5d} instructions per warp per K step, "
                      f"{per_weight:.3f} warp instr / weight (budget {ISSUE_BUDGET})  [{top}]", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lossless_sass.json")
    with open(path, "w") as f:
        json.dump({"triton": triton.__version__, "arch": args.arch, "issue_budget": ISSUE_BUDGET, "rows": rows}, f,
                  indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
