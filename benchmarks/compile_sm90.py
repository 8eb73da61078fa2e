"""Compiles every variant of the fused MoE kernels the engine and the tests launch, ahead of time for a GPU target
with Triton's own compiler and ptxas (no GPU needed), and checks that the kernels whose weight tiles are computed in
registers hand tl.dot the operand layouts of the bf16 kernel at the same tiles: the condition for their outputs to
equal fused_moe on the decoded weights bit for bit. Required of the lossless kernel (format v2); reported for the
fp8 / int8 / int4 ones (lossy, left at their loads' layout under MMA v2: fused_moe_tiles.weight_tile).

    PYTHONPATH=src python benchmarks/compile_sm90.py [--arch 90] [--out DIR]

Variants: the tiles default_config and lossless_config pick on the Mixtral-8x7B and Qwen3-30B-A3B layers at 1-512
tokens (both GEMMs), and every constexpr branch the launchers reach (SWAP_AB, masked N / K tails, USE_SLOTS, each
QUANT, each escape mode, fp16 / fp32 activations, narrow and wide K steps, split-K's fp32 output), plus moe_sum.
A variant fails on a compile error, or (lossless) when an MMA operand's layout differs from the bf16 kernel's: the MMA
encoding must be the same, and a register operand must have the loaded tile's kWidth (2 for 16-bit types, 1 for
fp32: each mma's K slots then hold the same K elements as from shared memory). Writes compile_sm90.json and exits 1
on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from lossless_ptxas import BF16_ARGS, LOSSLESS_ARGS, MODELS, compile_kernel, mma_operands  # also leaves the interpreter

import torch  # noqa: E402
import triton  # noqa: E402

from pagedmoe.kernels._attention_checks import dot_precision  # noqa: E402
from pagedmoe.kernels.fused_moe import (SILU_BLOCK_I, SILU_BLOCK_M, default_config, fused_moe_kernel,  # noqa: E402
                                        moe_sum_kernel, silu_mul_kernel)
from pagedmoe.kernels.fused_moe_config import FusedMoEConfig  # noqa: E402
from pagedmoe.kernels.fused_moe_lossless import fused_moe_lossless_kernel, lossless_config  # noqa: E402

PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
WEIGHT = {0: None, "int8": "*i8", "fp8": "*fp8e4nv", "int4": "*u8"}  # QUANT 1 (int8 / fp8), QUANT 2 (int4)
SUM_ARGS = ["y_ptr", "weights_ptr", "ids_ptr", "out_ptr", "row_ptr", "T", "H", "num_splits", "num_experts",
            "stride_ys", "stride_ym", "stride_wt", "stride_it", "stride_ot"]
SILU_ARGS = ["x_ptr", "out_ptr", "M", "I", "stride_xm", "stride_om"]
CANONICAL_KWIDTH = {16: 2, 32: 1}


def gemm_variants():
    """(tiles, gemm, act dtype, weights, options): the launches fused_moe_groups makes, as constexpr sets."""
    seen = []

    def add(cfg, gated, act=torch.bfloat16, weights="bf16", **opt):
        v = dict(cfg=cfg, gated=gated, act=act, weights=weights, swap=opt.get("swap", cfg.swap_ab),
                 even_k=opt.get("even_k", True), even_n=opt.get("even_n", True), slots=opt.get("slots", False),
                 esc=opt.get("esc", -1), split=opt.get("split", not gated))
        if v not in seen:
            seen.append(v)

    for m in MODELS.values():  # the engine's tiles at decode and prefill sizes, bf16 and lossless
        for T in (1, 16, 64, 256, 512):
            for cfg_fn, kind in ((default_config, "bf16"), (lossless_config, "lossless")):
                cfg = cfg_fn(T, m["A"], m["E"], m["H"], m["I"], torch.bfloat16)
                for gated in (True, False):
                    add(cfg, gated, weights=kind)
                    if kind == "lossless":
                        add(cfg, gated, weights=kind, esc=8)  # escapes="unrolled" (the benchmarks' variant)
                        add(cfg, gated, weights="bf16")  # its reference: the bf16 kernel at the same tiles
    small = FusedMoEConfig()
    for gated in (True, False):  # each branch, at the tests' small tiles
        for swap in (False, True):
            for weights in ("bf16", "lossless", "int8", "fp8", "int4"):
                add(small, gated, weights=weights, swap=swap, even_k=False, even_n=False, slots=True)
        for esc in (0, 2, 8, 32):
            add(small, gated, weights="lossless", esc=esc, even_k=False)
        for cfg in (FusedMoEConfig(block_k=32, block_k2=16), FusedMoEConfig(block_n=128, block_k=128, num_warps=8,
                    block_n2=16, block_k2=256), FusedMoEConfig(block_m=64, block_n2=32, block_k2=128)):
            for weights in ("bf16", "lossless", "int4"):
                if weights == "int4" and (128 % cfg.block_k or 128 % cfg.block_k2):
                    continue
                add(cfg, gated, weights=weights, even_k=False, esc=8 if cfg.block_k == 128 else -1)
        add(small, gated, split=False)  # w2 without split-K: y in the activations' dtype
        for act in (torch.float16, torch.float32):
            add(small, gated, act=act)
            add(small, gated, act=act, weights="int8")
        add(small, gated, act=torch.float32, weights="lossless")
    return seen


def compile_gemm(v, arch, weights=None, pdl=False, slot_blocks=False):
    cfg, gated = v["cfg"], v["gated"]
    bn, bk, nw, ns = ((cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) if gated else
                      (cfg.block_n2, cfg.block_k2, cfg.num_warps2, cfg.num_stages2))
    act = PTR[v["act"]]
    out = act if gated or not v["split"] else "*fp32"
    const = dict(TOP_K=2 if gated else 1, GATED=gated, SWAP_AB=v["swap"], EVEN_K=v["even_k"], EVEN_N=v["even_n"],
                 BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=dot_precision(v["act"]),
                 USE_SLOTS=v["slots"])
    weights = weights or v["weights"]
    if weights == "lossless":
        types = [act, "*u8", "*u8", "*u8", "*i32", "*i32", out, "*i32", "*i32", "*i32"] + ["i32"] * 12
        return compile_kernel(fused_moe_lossless_kernel, LOSSLESS_ARGS, types, dict(const, ESC_CAP=v["esc"]), arch, nw, ns)
    quant = {"bf16": 0, "int8": 1, "fp8": 1, "int4": 2}[weights]
    w = act if quant == 0 else WEIGHT[weights]
    types = [act, w, out, "*i32", "*i32", act if quant == 0 else "*fp32", "*i32"] + ["i32"] * 13
    return compile_kernel(fused_moe_kernel, BF16_ARGS, types,
                          dict(const, QUANT=quant, GROUP=128, PDL=pdl, SLOT_BLOCKS=slot_blocks), arch, nw, ns)


def error_line(e: Exception) -> str:
    """A compile error in one line: its cause (Triton's CompilationError wraps it) and the source line."""
    lines = [ln for ln in str(e).splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
    return f"{type(e).__name__}: {lines[-1].strip() if lines else ''}{cause}"[:600]


def same_operands(ref: list[dict], got: list[dict], bits: int) -> bool:
    """The MMAs of got take their operands as ref's do: same encodings; a register operand where ref reads shared
    memory (MMA v3 keeps a computed A tile in registers) must have the canonical kWidth."""
    if len(ref) != len(got):
        return False
    for r, g in zip(ref, got):
        if r["mma"] != g["mma"]:
            return False
        for ro, go in zip(r["operands"], g["operands"]):
            if ro != go and not (ro == "smem" and go == CANONICAL_KWIDTH.get(bits)):
                return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows, refs = [], {}
    for v in gemm_variants():
        cfg = v["cfg"]
        row = dict(kernel="fused_moe_lossless_kernel" if v["weights"] == "lossless" else "fused_moe_kernel",
                   weights=v["weights"], gemm="w13" if v["gated"] else "w2", act=str(v["act"]).removeprefix("torch."),
                   swap_ab=v["swap"], even_k=v["even_k"], even_n=v["even_n"], use_slots=v["slots"],
                   esc_cap=v["esc"] if v["weights"] == "lossless" else None, split_out=v["split"],
                   tiles=dict(block_m=cfg.block_m, **({k: getattr(cfg, k) for k in ("block_n", "block_k", "num_warps",
                              "num_stages")} if v["gated"] else {k[:-1]: getattr(cfg, k) for k in ("block_n2",
                              "block_k2", "num_warps2", "num_stages2")})))
        try:
            mma = mma_operands(compile_gemm(v, args.arch).asm["ttgir"])
            row.update(ok=True, mma=mma)
            if v["weights"] != "bf16":
                key = json.dumps(dict(row, weights="bf16", esc_cap=None, kernel=None, mma=None), sort_keys=True)
                if key not in refs:
                    refs[key] = mma_operands(compile_gemm(v, args.arch, weights="bf16").asm["ttgir"])
                row["same_mma_operands_as_bf16"] = same_operands(refs[key], mma, v["act"].itemsize * 8)
                # the lossless kernel must match (bit-exactness); fp8/int8/int4 are reported (lossy: their sums
                # may round otherwise under MMA v2, fused_moe_tiles.weight_tile)
                row["ok"] = row["same_mma_operands_as_bf16"] or v["weights"] != "lossless"
        except Exception as e:  # a compile error: reported with the variant, the others still compiled
            row.update(ok=False, error=error_line(e))
        rows.append(row)
        print(("ok  " if row["ok"] else "FAIL"), row["kernel"], row["weights"], row["gemm"], row["act"], row["tiles"],
              f"swap={v['swap']} even_k={v['even_k']} even_n={v['even_n']} slots={v['slots']} esc={row['esc_cap']}",
              row.get("error", ""), flush=True)
    # moe_sum over split-K's fp32 partials or one bf16 split (decode), or over grouped_mm's expert-ordered rows
    for y_dtype, permuted in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        const = dict(TOP_K=8, BLOCK_T=8, BLOCK_H=512, PERMUTED=permuted)
        types = [PTR[y_dtype], "*fp32", "*i64", "*bf16", "*i64"] + ["i32"] * 9
        row = dict(kernel="moe_sum_kernel", y=str(y_dtype), permuted=permuted)
        try:
            compile_kernel(moe_sum_kernel, SUM_ARGS, types, const, args.arch, 8, 3)
            rows.append(dict(row, ok=True))
        except Exception as e:
            rows.append(dict(row, ok=False, error=error_line(e)))
    # the batch-1 decode launch of both GEMMs (one block per slot, no moe_align; PDL, kernels/pdl.py) and moe_sum's:
    # griddepcontrol in their PTX
    cfg = default_config(1, 8, 128, 2048, 768, torch.bfloat16)
    for gated in (True, False):
        row = dict(kernel="fused_moe_kernel", weights="bf16", gemm="w13" if gated else "w2", pdl=True, slot_blocks=True)
        try:
            v = dict(cfg=cfg, gated=gated, act=torch.bfloat16, weights="bf16", swap=False, even_k=True, even_n=True,
                     slots=False, esc=-1, split=False)
            ptx = compile_gemm(v, args.arch, pdl=True, slot_blocks=True).asm["ptx"]
            rows.append(dict(row, ok="griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx))
        except Exception as e:
            rows.append(dict(row, ok=False, error=error_line(e)))
    try:
        ptx = compile_kernel(moe_sum_kernel, SUM_ARGS, ["*bf16", "*fp32", "*i64", "*bf16", "*i64"] + ["i32"] * 9,
                             dict(TOP_K=8, BLOCK_T=8, BLOCK_H=512, PERMUTED=False, PDL=True), args.arch, 8, 3).asm["ptx"]
        rows.append(dict(kernel="moe_sum_kernel", pdl=True, ok="griddepcontrol.wait" in ptx))
    except Exception as e:
        rows.append(dict(kernel="moe_sum_kernel", pdl=True, ok=False, error=error_line(e)))
    try:  # grouped_mm's activation
        compile_kernel(silu_mul_kernel, SILU_ARGS, ["*bf16", "*bf16"] + ["i32"] * 4,
                       dict(BLOCK_M=SILU_BLOCK_M, BLOCK_I=SILU_BLOCK_I), args.arch, 4, 3)
        rows.append(dict(kernel="silu_mul_kernel", ok=True))
    except Exception as e:
        rows.append(dict(kernel="silu_mul_kernel", ok=False, error=error_line(e)))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_sm90.json"), "w") as f:
        json.dump(dict(arch=args.arch, triton=triton.__version__, rows=rows), f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} variants compiled for sm_{args.arch}"
          + ("" if not bad else f"; {len(bad)} FAILED"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
