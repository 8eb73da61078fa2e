"""GEMM-friendly lossless bf16 layouts compared on CPU: ratio, bytes a fused GEMM reads per weight, escape
rate, decode arithmetic per element, and the encoder's CPU rate (docs/formats.md, "Version 2: choosing it").

    PYTHONPATH=src python benchmarks/lossless_formats.py [--quick] [--out DIR]

Inputs: N(0, 0.02) bf16 at the Mixtral-8x7B expert shapes (w1/w3 [14336, 4096], w2 [4096, 14336]) and the
Qwen3-30B-A3B ones ([768, 2048], [2048, 768]); and every expert tensor of the embedded default model
(src/pagedmoe/default_model, trained). Candidates (every exponent stored exactly; sign+mantissa raw bytes):
  huffman  version 1 (codecs/lossless.py): canonical Huffman exponent codes, 1024 lanes x 30 steps; the real
           encoder. A GEMM cannot start at an arbitrary tile: decoded to bf16 in HBM first.
  tiled    version 2 (codecs/tiled.py): 4-bit offset from a per-row base exponent, nibble 15 = escape; escapes
           (int32 each) grouped by 16 x 64 tile with an int32 offset per tile. The real encoder.
  nib4-global  the same with one base per part instead of per row (byte accounting).
  nib3-row     3-bit offsets (7 exponents + escape) from a per-row base (byte accounting).
  cb3-tile     3-bit index into a per-16x64-tile codebook of its 7 most frequent exponents + escape (7 bytes
               per tile; byte accounting).
Decode arithmetic: integer ops per weight to rebuild the bf16 bits in registers (kernel instruction mix, see
OPS), plus escapes: each costs one compare-and-select over the GEMM's 64 x 64 weight tile (2 ops per
element of the tile), i.e. 2 * 4096 * escape rate per weight. Writes lossless_formats.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pagedmoe.codecs import lossless, tiled

MIXTRAL_EXPERT_WEIGHTS = 32 * 3 * 8 * 14336 * 4096  # 45.1e9
GEMM_TILE = 64 * 64
# ops per weight without escapes: tiled/nib4: nibble shift or mask, interleave, + base, << 7, raw sign-extend,
# & 0x807F, |  (7); nib3: a 3-bit field straddles bytes (2 loads' shifts, or, mask) + the same 5 (10);
# cb3: the 3-bit field (5) + a codebook gather from L1 per weight (counted as 4: the LSU runs at 1/4 of the ALU
# rate) + 3 (12). huffman: not decodable inside the GEMM (a serial lane walk: ~20 ops per weight in the
# standalone kernel, plus 4 bytes of HBM round trip per weight).
OPS = {"tiled": 7, "nib4-global": 7, "nib3-row": 10, "cb3-tile": 12}


def exponents(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int16).to(torch.int32) >> 7 & 0xFF).reshape(-1, x.shape[-1])


def _window_escapes(exps: torch.Tensor, width: int, per_row: bool) -> int:
    """Escapes of a window of `width` consecutive exponents chosen per row (or once for the tensor)."""
    rows = exps if per_row else exps.reshape(1, -1)
    n = rows.shape[0]
    hist = torch.bincount((torch.arange(n)[:, None] * 256 + rows).reshape(-1), minlength=n * 256).view(n, 256)
    cs = torch.nn.functional.pad(torch.cumsum(hist, 1), (1, 0))
    covered = (cs[:, width:] - cs[:, :-width]).max(1).values
    return int(rows.shape[1] * n - covered.sum())


def _tile_codebook_escapes(exps: torch.Tensor, k: int = 7) -> tuple[int, int]:
    """(escapes, tiles) of a per-16x64-tile codebook of its k most frequent exponents."""
    R, C = exps.shape
    pr, pc = -R % 16, -C % 64
    padded = torch.nn.functional.pad(exps, (0, pc, 0, pr), value=-1)
    tiles = padded.view((R + pr) // 16, 16, (C + pc) // 64, 64).permute(0, 2, 1, 3).reshape(-1, 1024)
    n = tiles.shape[0]
    valid = tiles >= 0
    idx = (torch.arange(n)[:, None] * 256 + tiles.clamp(min=0))[valid]
    hist = torch.bincount(idx, minlength=n * 256).view(n, 256)
    top = hist.topk(k, 1).values.sum(1)
    return int(valid.sum() - top.sum()), n


def accounting(exps: torch.Tensor) -> dict[str, tuple[int, int]]:
    """(stored bytes, escapes) of the byte-accounted candidates for one [R, C] tensor."""
    R, C = exps.shape
    n = R * C
    tiles = -(-R // 16) * -(-C // 64)
    offsets = 4 * (tiles + 1)
    e_glob = _window_escapes(exps, 15, per_row=False)
    e3 = _window_escapes(exps, 7, per_row=True)
    e_cb, _ = _tile_codebook_escapes(exps)
    return {"nib4-global": (n + R * -(-C // 2) + 1 + offsets + 4 * e_glob, e_glob),
            "nib3-row": (n + -(-3 * n // 8) + R + offsets + 4 * e3, e3),
            "cb3-tile": (n + -(-3 * n // 8) + 7 * tiles + offsets + 4 * e_cb, e_cb)}


def measure(tensors, huffman: bool = True) -> dict:
    """Totals over a list of bf16 [R, C] tensors (one part each)."""
    tot = {k: [0, 0] for k in ("huffman", "tiled", *OPS)}
    numel, enc_s, enc_v1_s = 0, 0.0, 0.0
    for x in tensors:
        numel += x.numel()
        t0 = time.perf_counter()
        tt = tiled.encode(x, checksum=False)
        enc_s += time.perf_counter() - t0
        assert torch.equal(tiled.decode_reference(tt).view(torch.int16), x.view(torch.int16))
        tot["tiled"][0] += tt.nbytes
        tot["tiled"][1] += tt.escapes.numel()
        if huffman:
            t0 = time.perf_counter()
            ct = lossless.encode(x, checksum=False)
            enc_v1_s += time.perf_counter() - t0
            tot["huffman"][0] += ct.nbytes
        for k, (b, e) in accounting(exponents(x)).items():
            tot[k][0] += b
            tot[k][1] += e
    huff = tot["huffman"][0] / (2 * numel) if huffman else None
    rows = {}
    for k, (b, e) in tot.items():
        if k == "huffman" and not huffman:
            continue
        ratio = b / (2 * numel)
        esc = e / numel
        rows[k] = {"ratio": round(ratio, 4), "vs_huffman": round(ratio / huff, 3) if huff else None,
                   "gemm_bytes_per_weight": round(2 * ratio, 3) if k != "huffman" else round(2 * ratio + 4, 3),
                   "escape_rate": None if k == "huffman" else float(f"{esc:.3g}"),
                   "decode_ops_per_weight": None if k == "huffman" else round(OPS[k] + 2 * GEMM_TILE * esc, 2)}
    return {"numel": numel, "rows": rows, "tiled_encode_melem_s": round(numel / enc_s / 1e6, 1),
            "huffman_encode_melem_s": round(numel / enc_v1_s / 1e6, 1) if huffman else None}


def default_model_experts() -> list[torch.Tensor]:
    from safetensors import safe_open

    from pagedmoe.models.compressed import expert_proj

    folder = Path(__file__).resolve().parents[1] / "src" / "pagedmoe" / "default_model"
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out += [sf.get_tensor(k) for k in sf.keys() if expert_proj(k) is not None]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (the CI smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    shapes = {"mixtral w1/w3": (14336, 4096), "mixtral w2": (4096, 14336), "qwen3 gate/up": (768, 2048),
              "qwen3 down": (2048, 768)}
    if args.quick:
        shapes = {"quick a": (160, 256), "quick b": (96, 130)}
    res = {"torch_threads": torch.get_num_threads(), "inputs": {}}
    for name, shape in shapes.items():
        x = (torch.randn(shape, generator=g) * 0.02).bfloat16()
        res["inputs"][f"N(0, 0.02) {name} {list(shape)}"] = measure([x])
    experts = default_model_experts()
    if args.quick:
        experts = experts[:6]
    res["inputs"][f"default model: {len(experts)} trained expert tensors"] = measure(experts)
    mix = next((v for k, v in res["inputs"].items() if "mixtral w1" in k), None)
    if mix:
        res["mixtral_experts_tiled_encode_s_cpu"] = round(MIXTRAL_EXPERT_WEIGHTS / (mix["tiled_encode_melem_s"] * 1e6), 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "lossless_formats.json").write_text(json.dumps(res, indent=1))
    print(f"{'input':<58}{'format':<13}{'ratio':>7}{'/huff':>7}{'B/w GEMM':>9}{'escapes':>10}{'ops/w':>7}")
    for name, r in res["inputs"].items():
        for k, row in r["rows"].items():
            print(f"{name:<58}{k:<13}{row['ratio']:>7}{str(row['vs_huffman']):>7}{row['gemm_bytes_per_weight']:>9}"
                  f"{str(row['escape_rate']):>10}{str(row['decode_ops_per_weight']):>7}")
        print(f"{'':<58}encode (CPU, {res['torch_threads']} threads): tiled {r['tiled_encode_melem_s']} M weights/s, "
              f"huffman {r['huffman_encode_melem_s']} M weights/s")
    if mix:
        print(f"Mixtral-8x7B experts (45.1 G weights), tiled encode on this CPU: {res['mixtral_experts_tiled_encode_s_cpu']} s")


if __name__ == "__main__":
    main()
