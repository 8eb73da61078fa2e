"""Registers and spills of the fused lossless MoE kernels (kernels/fused_moe_lossless.py), compiled ahead of time
for a GPU target with Triton's own ptxas; runs on a machine without a GPU.

    PYTHONPATH=src python benchmarks/lossless_ptxas.py [--arch 90] [--quick] [--out DIR]

For the tiles lossless_config picks on the Mixtral-8x7B and Qwen3-30B-A3B layers at 1, 16, 64 and 256 tokens
(each distinct configuration once), both GEMMs (gated w13, split-K w2) and both escape modes (ESC_CAP -1: the
loop; 8: unrolled branches), plus the bf16 fused_moe kernel at its own tiles for comparison. A spill (stack
bytes > 0) in the decode loop costs local-memory traffic on every K step. Writes lossless_ptxas.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedmoe.kernels.fused_moe import default_config, fused_moe_kernel  # noqa: E402
from pagedmoe.kernels.fused_moe_lossless import fused_moe_lossless_kernel, lossless_config  # noqa: E402

MODELS = {"mixtral-8x7b": dict(E=8, H=4096, I=14336, A=2), "qwen3-30b-a3b": dict(E=128, H=2048, I=768, A=8)}
LOSSLESS_ARGS = ["a_ptr", "raw_ptr", "nib_ptr", "base_ptr", "esc_off_ptr", "esc_ptr", "out_ptr", "sorted_slots_ptr",
                 "block_expert_ptr", "slot_ptr", "num_slots", "num_blocks", "N", "K", "k_per_split", "part_rows", "tiles_per_part",
                 "tile_rows_pp", "tile_cols", "stride_a", "stride_os", "stride_om"]
BF16_ARGS = ["a_ptr", "w_ptr", "out_ptr", "sorted_slots_ptr", "block_expert_ptr", "ws_ptr", "slot_ptr", "num_slots",
             "num_blocks", "N", "K", "k_per_split", "stride_a", "stride_we", "stride_wn", "stride_os", "stride_om",
             "stride_se", "stride_sn", "num_experts"]


def resource_usage(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+).*STACK:(\d+)", text)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))}


def compile_kernel(kernel, names, types, const, arch, num_warps, num_stages, odd=()):
    """triton.compile for the target as the JIT specializes a launch at the model shapes: pointers 16-byte aligned
    (the launcher's tensors are) and every integer argument a multiple of 16 (sizes, strides and splits of the
    Mixtral / Qwen3 layers are; the JIT marks such values `tt.divisibility = 16`), except the kernel's
    do_not_specialize arguments and those named in `odd`. Without the integers' divisibility the compiler cannot
    prove rows aligned and loads the tiles element by element (LDG.U16, no cp.async), which is not the kernel
    the GPU runs: the K loops counted that way before 2026-12-05 were 3-5x the real ones."""
    # constexprs left out take the kernel's defaults (e.g. PDL=False), as a launch that does not pass them
    const = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **const}
    sig = dict(zip(names, types))
    sig.update({k: "constexpr" for k in const})
    generic = set(getattr(kernel, "do_not_specialize", ())) | set(odd)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(zip(names, types))
             if t.startswith("*") or (t[0] in "iu" and n not in generic)}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_one(kernel, names, types, const, arch, num_warps, num_stages) -> dict:
    return resource_usage(compile_kernel(kernel, names, types, const, arch, num_warps, num_stages).asm["cubin"])


def mma_operands(ttgir: str) -> list[dict]:
    """Per tl.dot of a compiled kernel: its MMA encoding and, per operand, "smem" or its register kWidth."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    out = []
    for line in ttgir.splitlines():
        if not re.search(r"= (tt\.dot|ttng\.warp_group_dot) ", line):
            continue
        line = line.split(" loc(")[0]
        sig = line[line[:line.index(" -> ")].rindex(" : "):]  # after the attributes ({inputPrecision = 0 : i32})
        types = re.sub(r"#\w+", lambda m: aliases.get(m.group(0), m.group(0)), sig)
        a, b = types.split(" * ", 1)
        ops = []
        for t in (a, b):
            k = re.search(r"kWidth = (\d+)", t)
            ops.append("smem" if t.lstrip(": ").startswith("!ttg.memdesc") else int(k.group(1)) if k else "fma")
        mma = re.search(r"-> tensor<[^,]+, (#ttg\.\w+<.*>)>", types)
        out.append(dict(mma=mma.group(1) if mma else types.split("->")[1].strip(), operands=ops))
    return out


def configs(quick: bool):
    import torch

    seen = {}
    for name, m in MODELS.items():
        for T in ((64,) if quick else (1, 16, 64, 256)):
            cfg = lossless_config(T, m["A"], m["E"], m["H"], m["I"], torch.bfloat16)
            seen.setdefault(cfg, []).append(f"{name} T={T}")
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true", help="Mixtral and Qwen3 at 64 tokens, loop mode only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import torch

    rows = []
    for cfg, where in configs(args.quick).items():
        for gated in (True, False):
            bn, bk, nw, ns = ((cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) if gated else
                              (cfg.block_n2, cfg.block_k2, cfg.num_warps2, cfg.num_stages2))
            common = dict(TOP_K=2 if gated else 1, GATED=gated, SWAP_AB=cfg.swap_ab, EVEN_K=True, EVEN_N=True,
                          BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION="ieee")
            out_t = "*bf16" if gated else "*fp32"
            for cap in ((-1,) if args.quick else (-1, 8)):
                types = ["*bf16", "*u8", "*u8", "*u8", "*i32", "*i32", out_t, "*i32", "*i32", "*i32"] + ["i32"] * 12
                use = compile_one(fused_moe_lossless_kernel, LOSSLESS_ARGS, types,
                                  dict(common, ESC_CAP=cap, USE_SLOTS=False),
                                  args.arch, nw, ns)
                rows.append(dict(kernel="lossless", gemm="w13" if gated else "w2", esc_cap=cap, block_m=cfg.block_m,
                                 block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, used_by=where, **use))
                print(f"lossless {rows[-1]['gemm']:3s} cap {cap:2d} m{cfg.block_m} n{bn} k{bk} w{nw} s{ns}: "
                      f"{use['registers']} registers, {use['stack_bytes']} stack bytes  ({', '.join(where)})", flush=True)
    if not args.quick:
        for name, m in MODELS.items():  # the bf16 kernel at its own tiles, for comparison
            cfg = default_config(64, m["A"], m["E"], m["H"], m["I"], torch.bfloat16)
            for gated in (True, False):
                bn, bk, nw, ns = ((cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) if gated else
                                  (cfg.block_n2, cfg.block_k2, cfg.num_warps2, cfg.num_stages2))
                types = ["*bf16", "*bf16", "*bf16" if gated else "*fp32", "*i32", "*i32", "*fp32", "*i32"] + ["i32"] * 13
                const = dict(TOP_K=2 if gated else 1, GATED=gated, SWAP_AB=False, EVEN_K=True, EVEN_N=True,
                             BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION="ieee", QUANT=0, GROUP=128,
                             USE_SLOTS=False)
                use = compile_one(fused_moe_kernel, BF16_ARGS, types, const, args.arch, nw, ns)
                rows.append(dict(kernel="bf16", gemm="w13" if gated else "w2", block_m=cfg.block_m, block_n=bn,
                                 block_k=bk, num_warps=nw, num_stages=ns, used_by=[f"{name} T=64"], **use))
                print(f"bf16     {rows[-1]['gemm']:3s} m{cfg.block_m} n{bn} k{bk} w{nw} s{ns}: {use['registers']} "
                      f"registers, {use['stack_bytes']} stack bytes ({name} T=64)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lossless_ptxas.json"), "w") as f:
        json.dump(dict(arch=args.arch, triton=triton.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
