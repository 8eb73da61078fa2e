"""Triton MoE expert GEMMs on losslessly compressed experts (format version 2, codecs/tiled.py): each weight
tile is decoded in registers right before its tl.dot, so the GEMM reads ~1.5 bytes per weight instead of
bf16's 2 and no decoded copy is ever written (the version 1 path decodes every expert to bf16 in HBM and then
reads it back).

Same structure, tiles and launch order as kernels/fused_moe.py (moe_align, the gated w13 GEMM with SiLU-and-mul,
the split-K w2 GEMM, moe_sum), so with the same config the per-program reductions are the same and the output
equals fused_moe on the decoded weights bit for bit. Per [BLOCK_N, BLOCK_K] weight tile:
  - raw bytes [BLOCK_N, BLOCK_K] and nibble bytes [BLOCK_N, BLOCK_K / 2] load from fixed addresses (row
    strides K and ceil(K / 2)), the nibbles split and interleaved back into K order (as int4 weights are);
  - exponent = base[row] + nibble (base: one byte per row, loaded once per program);
  - escapes: the tile's rows cover consecutive 16-row escape tiles of one 64-column tile column, whose
    escapes are one contiguous range of the escape list (tile order is column-major); each (usually 0-2 per
    tile on N(0, s) weights) replaces one exponent through a compare-and-select over the tile;
  - bf16 bits = (sign-extended raw & 0x807F) | exponent << 7, bitcast.
Shapes as in fused_moe.py: w13 holds [E, 2I, H] (gate rows then up rows), w2 [E, H, I], one part per expert.
Reference: ``fused_moe_lossless_reference`` (decode with tiled.decode_reference, then fused_moe).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from pagedmoe.codecs import tiled

from ._attention_checks import check_float, check_index, check_same_device
from .device_info import sm_count
from .fused_moe import FusedMoEConfig, default_config, fused_moe, fused_moe_groups
from .fused_moe_tuned import tuned_config
from .fused_moe_tiles import acc_zeros, block_rows, mma, mma_operand, store_block

ESC_FIRST = tl.constexpr(2)  # escapes patched under the first branch (see _decode_tile)
MAX_UNROLLED_ESCAPES = 32    # above this many escapes in one weight tile's column, the kernel loops over them


@triton.jit
def _patch(e, ent, rows17, cols, tc):
    """e with the exponent of escape entry ent (row in part mod 2**17 << 14 | column in tile << 8 | exponent)
    put in place: one compare-and-select over the tile, separable into a row and a column test."""
    hit = (rows17 == (ent >> 14))[:, None] & (cols == tc * 64 + ((ent >> 8) & 63))[None, :]
    return tl.where(hit, ent & 0xFF, e)


@triton.jit
def _decode_tile(raw_ptrs, nib_ptrs, base, esc_off_ptr, esc_ptr, rows17, row0, row_end, tile0, k0, offs_k,
                 w_mask, nib_mask, tile_rows_pp, tile_cols, like_ptr,
                 BLOCK_K: tl.constexpr, MASKED: tl.constexpr, ESC_CAP: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of rows [row0, row_end) (rows of one part) at columns k0.., in
    like_ptr's dtype. rows17: each tile row's row in its part mod 2**17 (what an escape entry records).
    ESC_CAP: 0, the tensor has no escape; -1, a loop over the tile's escapes; > 0 (escapes_cap), at most that
    many in any 64-column slice of a weight tile: a branch on "any escape here" around ESC_FIRST unrolled
    patches, a second one around the rest (no loop nested in the K loop; Triton then pipelines the escape
    loads, but at 64 x 64 tiles it needs more registers than the loop: ptxas for sm_90)."""
    byte = tl.load(nib_ptrs, mask=nib_mask, other=0)  # [BLOCK_N, BLOCK_K // 2]: two K positions each
    e = base[:, None] + tl.interleave(byte & 0xF, byte >> 4).to(tl.int32)
    if ESC_CAP != 0:
        cols = k0 + offs_k
        for c in tl.static_range(max(1, BLOCK_K // 64)):
            tc = k0 // 64 + c
            t0 = tile0 + tc * tile_rows_pp
            in_k = tc < tile_cols
            lo = tl.load(esc_off_ptr + t0 + row0 // 16, mask=in_k, other=0)
            hi = tl.load(esc_off_ptr + t0 + (row_end - 1) // 16 + 1, mask=in_k, other=0)
            if ESC_CAP < 0:
                for i in range(lo, hi):
                    e = _patch(e, tl.load(esc_ptr + i), rows17, cols, tc)
            else:
                if hi > lo:  # ~half the 64x64 tiles of N(0, s) weights have an escape, few have more than 2
                    for j in tl.static_range(min(ESC_CAP, ESC_FIRST)):
                        ent = tl.load(esc_ptr + lo + j, mask=lo + j < hi, other=-1)  # -1: matches no row
                        e = _patch(e, ent, rows17, cols, tc)
                    if ESC_CAP > ESC_FIRST:
                        if hi > lo + ESC_FIRST:
                            for j in tl.static_range(ESC_FIRST, ESC_CAP):
                                ent = tl.load(esc_ptr + lo + j, mask=lo + j < hi, other=-1)
                                e = _patch(e, ent, rows17, cols, tc)
    r = tl.load(raw_ptrs, mask=w_mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)  # sign to bit 15
    bits = (r & 0x807F) | (e << 7)
    if MASKED:  # past N or K: +0.0 (the activations there are 0 too)
        bits = tl.where(w_mask, bits, 0)
    w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return mma_operand(w.to(like_ptr.dtype.element_ty))  # the MMA layout of a loaded tile (mma_operand)


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def fused_moe_lossless_kernel(
    a_ptr, raw_ptr, nib_ptr, base_ptr, esc_off_ptr, esc_ptr, out_ptr, sorted_slots_ptr, block_expert_ptr, slot_ptr,
    num_slots, num_blocks, N, K, k_per_split, part_rows, tiles_per_part, tile_rows_pp, tile_cols,
    stride_a, stride_os, stride_om,
    TOP_K: tl.constexpr, GATED: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ESC_CAP: tl.constexpr, USE_SLOTS: tl.constexpr = False,
):
    """out[slot, n] (+ split offset) = act(a[slot // TOP_K, k-range] @ W[e, n, k-range]^T) for one block, W
    decoded from the tiled format tile by tile. GATED: rows n (gate) and N + n (up) of a part of 2N rows,
    output silu(gate) * up. Not GATED: plain product of one split of K (part of N rows). USE_SLOTS: the tensor
    holds some experts of the layer (fused_moe_mixed); slot_ptr [E] gives each expert's part, or -1 (skipped)."""
    pid = tl.program_id(0)
    pid_m = pid % num_blocks
    pid_n = pid // num_blocks
    pid_k = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last used block
        return
    if USE_SLOTS:
        expert = tl.load(slot_ptr + expert)
        if expert < 0:  # another group's expert
            return
    slots, m_mask, a_rows, offs_n, n_mask = block_rows(sorted_slots_ptr, pid_m, pid_n, num_slots, N, TOP_K,
                                                        BLOCK_M, BLOCK_N, EVEN_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kh = tl.arange(0, BLOCK_K // 2)
    k_start = pid_k * k_per_split  # even: a whole number of BLOCK_K steps
    k_end = tl.minimum(k_start + k_per_split, K)
    half = (K + 1) // 2

    # NOTE: the expert's arrays by scalar pointers plus int32 offsets inside the expert (< 2**31 for any real
    # expert), not loop-carried [BLOCK_N, BLOCK_K] 64-bit pointer tensors: those alone took ~200 registers
    # per thread at 64 x 64 tiles, and the kernel spilled (checked with ptxas for sm_90).
    e64 = expert.to(tl.int64)
    raw_e = raw_ptr + e64 * part_rows * K
    nib_e = nib_ptr + e64 * part_rows * half
    raw_off = offs_n[:, None] * K + offs_k[None, :]
    nib_off = offs_n[:, None] * half + offs_kh[None, :]
    base_g = tl.load(base_ptr + e64 * part_rows + offs_n, mask=n_mask, other=0).to(tl.int32)
    rows17_g = offs_n & 0x1FFFF
    tile0 = expert * tiles_per_part
    n_end = tl.minimum(pid_n * BLOCK_N + BLOCK_N, N)
    if GATED:
        base_u = tl.load(base_ptr + e64 * part_rows + N + offs_n, mask=n_mask, other=0).to(tl.int32)
        rows17_u = (offs_n + N) & 0x1FFFF
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + (k_start + offs_k)[None, :]
    acc_g = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            k_mask = tl.full([BLOCK_K], 1, tl.int1)
            kh_mask = tl.full([BLOCK_K // 2], 1, tl.int1)
        else:
            k_mask = (k0 + offs_k) < k_end
            kh_mask = (k0 + 2 * offs_kh) < k_end
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        nib_mask = n_mask[:, None] & kh_mask[None, :]
        wg = _decode_tile(raw_e + k0 + raw_off, nib_e + k0 // 2 + nib_off, base_g, esc_off_ptr, esc_ptr, rows17_g,
                          pid_n * BLOCK_N, n_end, tile0, k0, offs_k, w_mask, nib_mask, tile_rows_pp, tile_cols, a_ptr,
                          BLOCK_K, not (EVEN_K and EVEN_N), ESC_CAP)
        acc_g = mma(acc_g, wg, a, SWAP_AB, DOT_PRECISION)
        if GATED:  # the up rows: N rows further in the part
            wu = _decode_tile(raw_e + N * K + k0 + raw_off, nib_e + N * half + k0 // 2 + nib_off, base_u, esc_off_ptr,
                              esc_ptr, rows17_u, N + pid_n * BLOCK_N, N + n_end, tile0, k0, offs_k, w_mask, nib_mask,
                              tile_rows_pp, tile_cols, a_ptr, BLOCK_K, not (EVEN_K and EVEN_N), ESC_CAP)
            acc_u = mma(acc_u, wu, a, SWAP_AB, DOT_PRECISION)
        a_ptrs += BLOCK_K

    store_block(acc_g, acc_u, out_ptr, pid_k, stride_os, stride_om, slots, offs_n, m_mask, n_mask, GATED, SWAP_AB)


def _check_tiled(tt, name: str, shape: tuple, device) -> None:
    if getattr(tt, "version", None) != tiled.FORMAT_VERSION:
        raise ValueError(f"{name}: fused_moe_lossless reads lossless format version {tiled.FORMAT_VERSION} "
                         f"(tiled); got {type(tt).__name__} version {getattr(tt, 'version', None)}")
    if tuple(tt.shape) != shape or tt.num_parts != shape[0]:
        raise ValueError(f"{name} must be {list(shape)} with one part per expert, got {list(tt.shape)} in "
                         f"{tt.num_parts} parts")
    for a in tiled.ARRAYS:
        t = getattr(tt, a)
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"{name}.{a} must be contiguous on {device}, got {t.device}")
    if tt.escapes.dtype != torch.int32 or tt.escape_offsets.dtype != torch.int32:
        raise ValueError(f"{name}: escapes and escape_offsets must be int32")


def escapes_cap(tt, block_n: int) -> int:
    """The kernel's ESC_CAP for tt under BLOCK_N rows per tile: 0 without escapes; else the most escapes any
    weight tile's column of 64 can meet (its rows span at most block_n / 16 + 1 escape tiles: the up half of a
    gated tile need not start on a 16-row boundary), rounded up to a power of two (fewer compiles), or -1 (a
    loop) above MAX_UNROLLED_ESCAPES. Reads the device once per (tensor, block_n), then cached on tt: call
    prepare_lossless before capturing a CUDA graph."""
    key = ("escapes_cap", block_n)
    if key not in tt.cache:
        counts = torch.diff(tt.escape_offsets.to(torch.int64))
        if counts.numel() == 0 or int(counts.sum()) == 0:
            cap = 0
        else:
            per_col = counts.view(tt.num_parts * tt.tile_cols, tt.tile_rows_per_part)
            w = min(block_n // 16 + 1, per_col.shape[1])
            cs = torch.nn.functional.pad(torch.cumsum(per_col, 1), (1, 0))
            m = int((cs[:, w:] - cs[:, :-w]).max())
            cap = -1 if m > MAX_UNROLLED_ESCAPES else 1 << (m - 1).bit_length()
        tt.cache[key] = cap
    return tt.cache[key]


def prepare_lossless(w13, w2, config: FusedMoEConfig) -> None:
    """Computes (and caches) what fused_moe_lossless reads from the device before a launch under config."""
    escapes_cap(w13, config.block_n)
    escapes_cap(w2, config.block_n2)


@dataclasses.dataclass(frozen=True)
class TiledExperts:
    """One GEMM's experts in lossless format v2 as fused_moe.py's launcher runs them (its `launch` hook)."""
    tt: "tiled.TiledTensor"
    escapes: str = "loop"
    # the K step, warps and stages to run at instead of the launch's config (fused_moe_mixed: lossless_tiles of
    # the layer's; the blocks, column tiles and splits stay the launch's)
    tiles: FusedMoEConfig | None = None

    def launch(self, grid, a, out, sorted_slots, block_expert, slots, num_slots, num_blocks, N, K, k_per_split,
               stride_os, stride_om, top_k, gated, cfg, precision) -> None:
        tt = self.tt
        cfg = self.tiles or cfg
        bn, bk, warps, stages = ((cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) if gated else
                                 (cfg.block_n2, cfg.block_k2, cfg.num_warps2, cfg.num_stages2))
        if self.escapes == "loop":  # from shapes only: no device read
            cap = -1 if tt.escapes.numel() else 0
        else:
            cap = escapes_cap(tt, bn)
        fused_moe_lossless_kernel[grid](
            a, tt.raw, tt.nibbles, tt.base, tt.escape_offsets, tt.escapes, out, sorted_slots, block_expert,
            block_expert if slots is None else slots,
            num_slots, num_blocks, N, K, k_per_split, tt.part_rows, tt.tiles_per_part, tt.tile_rows_per_part,
            tt.tile_cols, a.stride(0), stride_os, stride_om,
            TOP_K=top_k, GATED=gated, SWAP_AB=cfg.swap_ab, EVEN_K=K % bk == 0, EVEN_N=N % bn == 0,
            BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision, ESC_CAP=cap,
            USE_SLOTS=slots is not None, num_warps=warps, num_stages=stages)


def tiled_pair(w13, w2, H: int, I: int, device, dtype, tiles: FusedMoEConfig | None = None
               ) -> tuple[TiledExperts, TiledExperts]:
    """A group of n experts in lossless format v2 (w13 [n, 2I, H], w2 [n, H, I], one part each), checked, for
    activations of dtype (bf16, or float32 in the interpreter: both hold the bf16 weights exactly); tiles: see
    TiledExperts."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"experts in lossless format v2 take bf16 activations (or float32), got {dtype}")
    n = w13.shape[0] if len(getattr(w13, "shape", ())) == 3 else -1
    _check_tiled(w13, "w13", (n, 2 * I, H), device)
    _check_tiled(w2, "w2", (n, H, I), device)
    return TiledExperts(w13, tiles=tiles), TiledExperts(w2, tiles=tiles)


def check_lossless_args(x, w13, w2, topk_weights, topk_ids) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes, contiguity, one device; never reads device data. -> (T, A, E, H, I)."""
    check_float(x, "x", 2)
    check_float(topk_weights, "topk_weights", 2)
    check_index(topk_ids, "topk_ids", 2, (torch.int32, torch.int64))
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bf16 (or float32, which holds bf16 weights exactly), got {x.dtype}")
    if len(getattr(w13, "shape", ())) != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be a tiled [E, 2I, H] tensor, got shape {getattr(w13, 'shape', None)}")
    E, two_i, H = w13.shape
    I = two_i // 2
    T = x.shape[0]
    if x.shape[1] != H or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)} do not fit experts of hidden size {H}")
    check_same_device(x=x, topk_weights=topk_weights, topk_ids=topk_ids)
    _check_tiled(w13, "w13", (E, 2 * I, H), x.device)
    _check_tiled(w2, "w2", (E, H, I), x.device)
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused_moe_lossless runs on CUDA (or under TRITON_INTERPRET=1), got {x.device}")
    return T, topk_ids.shape[1], E, H, I


def lossless_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                    num_sms: int = 132, device: torch.device | None = None) -> FusedMoEConfig:
    """The tiles fused_moe itself would take for this layer and batch (its tuned table on device, else
    default_config), changed only where the in-register decode needs it to stay within 255 registers without
    spilling (benchmarks/lossless_ptxas.py, sm_90): 8 warps for the gated GEMM at 64 columns, 64-wide K steps for w2
    (a decoded [64, 128] tile spilled ~900 bytes per thread), 8 warps for w2 at 64-row blocks.

    None of these changes the order of any sum, so the output stays equal to fused_moe's on the decoded weights at
    its own tiles: warps only share out the output tile; a narrower K step runs the same mma instructions in the
    same K order; split_step keeps the w2 split boundaries of the original K step. Untuned on a GPU:
    benchmarks/bench_fused_lossless.py."""
    cfg = (tuned_config(num_tokens, top_k, num_experts, hidden, inter, dtype, device) if device is not None else None) \
        or default_config(num_tokens, top_k, num_experts, hidden, inter, dtype, num_sms)
    if dtype == torch.float32:  # the interpreter's small tiles
        return cfg
    return lossless_tiles(cfg)


def lossless_tiles(cfg: FusedMoEConfig) -> FusedMoEConfig:
    """cfg (fused_moe's tiles for a layer) with lossless_config's changes: warps and w2's K step, split_step kept."""
    return dataclasses.replace(cfg, num_warps=8 if cfg.block_n >= 64 else cfg.num_warps,
                               block_k2=min(64, cfg.block_k2), split_step=cfg.split_step or cfg.block_k2,
                               num_warps2=8 if cfg.block_m >= 64 else cfg.num_warps2)


def fused_moe_lossless(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                       out: torch.Tensor | None = None, config: FusedMoEConfig | None = None,
                       escapes: str = "loop", **overrides) -> torch.Tensor:
    """fused_moe on experts held in the tiled lossless format: w13 a TiledTensor [E, 2I, H], w2 [E, H, I], one
    part per expert, on x's device. config: lossless_config by default. escapes (same bits either way; a
    benchmark knob): "loop", a loop over each weight tile's escapes (fewer registers); "unrolled", branches
    around unrolled patches (_decode_tile; reads the device once per tensor and tile height, escapes_cap:
    call prepare_lossless before capturing a CUDA graph). No host sync otherwise. Returns out [T, H] in x's
    dtype; with the same config it equals fused_moe on the decoded weights bit for bit."""
    if escapes not in ("loop", "unrolled"):
        raise ValueError(f"escapes must be loop or unrolled, got {escapes!r}")
    T, A, E, H, I = check_lossless_args(x, w13, w2, topk_weights, topk_ids)
    cfg = config or lossless_config(T, A, E, H, I, x.dtype, sm_count(x.device), x.device)
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    return fused_moe_groups(x, [(TiledExperts(w13, escapes), TiledExperts(w2, escapes), None)], topk_weights, topk_ids,
                      T, A, E, H, I, out, cfg, {})


def fused_moe_lossless_reference(x, w13, w2, topk_weights, topk_ids, *, config: FusedMoEConfig | None = None,
                                 **overrides) -> torch.Tensor:
    """Decode-then-GEMM: the tiled experts decoded by the PyTorch reference (to x's dtype), then fused_moe with
    the tiles fused_moe_lossless would use (so the reductions, and the bits, are the same)."""
    T, A = topk_ids.shape
    E, two_i, H = w13.shape
    cfg = config or lossless_config(T, A, E, H, two_i // 2, x.dtype, sm_count(x.device), x.device)
    d13 = tiled.decode_reference(w13).to(x.dtype)
    d2 = tiled.decode_reference(w2).to(x.dtype)
    return fused_moe(x, d13, d2, topk_weights, topk_ids, config=cfg, **overrides)
