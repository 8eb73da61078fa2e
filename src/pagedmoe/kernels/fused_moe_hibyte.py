"""Triton MoE expert GEMMs on experts in the lossless candidate version 3 (codecs/hibyte.py), decoded per weight
tile in registers, written for the fewest instructions per weight (issue 23; benchmarks/lossless_sass.py counts
them): per 64-column slice of a [BLOCK_N, 64] weight tile,
  - one code byte per two weights splits into the slice's two K halves (AND, shift: columns j and j + 32), joined
    back into the slice's [BLOCK_N, 64] tile for one K = 64 dot, as the bf16 kernel's (_join_k: two dots on one
    accumulator made Triton's MMA v3 layouts convert the accumulator between them);
  - the high byte is code + base + 120 * (code >> 3), the low byte is loaded as it is, bits = hi << 8 | lo;
  - raw tiles (a 16 x 64 tile with a weight outside its row's window): one branch per slice on "any raw tile
    among these rows", then hi = code | high << 4 on their rows (a select), no per-weight escape.
Same launcher, blocks, splits and store as kernels/fused_moe.py (its `launch` hook, as fused_moe_lossless's v2
kernel). Reference: fused_moe on hibyte.decode_reference's weights. The engine's fused-hibyte tier runs it through
fused_moe_mixed with one of TIER_KERNELS on tile_major-order bytes (docs/benchmarks.md, "The fused lossless GEMM
on the H200").
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from pagedmoe.codecs import hibyte

from .device_info import sm_count
from .fused_moe import FusedMoEConfig, fused_moe, fused_moe_groups
from .fused_moe_lossless import lossless_config
from .fused_moe_tiles import acc_zeros, block_rows, mma, mma_operand, store_block


# Four weights of one row per call (pack=4: lo, code, base as four bytes of one register each): the high bytes
# from the codes' nibbles at SHIFT (0: the slice's first 32 columns, 4: the last 32), then the bf16 pairs
# (lo0 | hi0 << 8, lo1 | hi1 << 8) and (lo2 | hi2 << 8, lo3 | hi3 << 8) by two byte permutes. Every byte of
# (code & 7) + base is at most 127, so the word add carries across no byte.
_CODED = """
 shr.b32 c, $3, SHIFT;
 and.b32 t, c, 0x07070707;
 add.u32 t, t, $4;
 and.b32 s, c, 0x08080808;
 shl.b32 s, s, 4;
 or.b32 t, t, s;"""
_PAIRS = """
 prmt.b32 $0, $2, t, 0x5140;
 prmt.b32 $1, $2, t, 0x7362;
}"""
_ASM = "{\n .reg .b32 c, t, s;" + _CODED + _PAIRS
_ASM_LO = tl.constexpr(_ASM.replace("SHIFT", "0"))
_ASM_HI = tl.constexpr(_ASM.replace("SHIFT", "4"))
# The same where rows may be raw ($5: the raw tiles' high nibbles, $6: 0xFF bytes on raw rows): there the high
# byte is the code's nibble | the high nibble << 4, selected bytewise (t ^ ((t ^ r) & mask)).
_ASM_RAW = "{\n .reg .b32 c, t, s, r, h;" + _CODED + """
 and.b32 r, c, 0x0F0F0F0F;
 HIGH
 or.b32 r, r, h;
 xor.b32 r, r, t;
 and.b32 r, r, $6;
 xor.b32 t, t, r;""" + _PAIRS
_ASM_RAW_LO = tl.constexpr(_ASM_RAW.replace("SHIFT", "0").replace("HIGH", "shl.b32 h, $5, 4;\n and.b32 h, h, 0xF0F0F0F0;"))
_ASM_RAW_HI = tl.constexpr(_ASM_RAW.replace("SHIFT", "4").replace("HIGH", "and.b32 h, $5, 0xF0F0F0F0;"))


TM_TILE_BYTES = tl.constexpr(hibyte.TILE_ROWS * hibyte.TM_ROW_BYTES)  # tile_major: a 16 x 64 tile's lo and codes

# The engine tier's kernels on its tile_major bytes (HiByteExperts' fields; --compressed-gemm, config_sections.py):
#   fast   fused-hibyte: the decode straight in the MMA operand registers (exact=False) at 4 warps in both GEMMs,
#          the layer's tiles otherwise: bench_fused_lossless.py's row tm-k4-warps4 (0.87-0.96x of bf16's layer time
#          on the H200 at Mixtral 1-16 and Qwen3 16-64 tokens, 2026-12-05). Outputs within bf16 GEMM tolerance of
#          decode-then-GEMM (the MMA groups K differently), not bit-equal.
#   exact  fused-hibyte-exact: the bf16 kernel's K grouping (mma_operand), a dot per K = 32 half (join_k=False): the
#          one hibyte kernel bit-equal to bf16's GEMM at all 8 sizes of that H200 run (the joined K = 64 dot was not
#          at 5 of 8), at 1.5-5.8x bf16's time there.
TIER_KERNELS = {"fast": dict(exact=False, num_warps=4), "exact": dict(exact=True, join_k=False)}


def tile_major(h: "hibyte.HiByteTensor") -> torch.Tensor:
    """h's low bytes and codes in the tile_major order (hibyte.to_tile_major; the bench's tm rows pass these as
    tile_major_bytes): the kernel's three loads of a K step then cover whole 128-byte lines of one region instead
    of 32-byte pieces of rows K (and K / 2) bytes apart."""
    return hibyte.to_tile_major(h).lo


@triton.jit
def _pairs(lo, code, base, HIGH_NIBBLE: tl.constexpr):
    """bf16 bits (int16) of coded weights by packed byte arithmetic (inline PTX, four weights a call)."""
    if HIGH_NIBBLE:
        bits = tl.inline_asm_elementwise(_ASM_HI, "=r,=r,r,r,r", [lo, code, base], dtype=tl.int16, is_pure=True,
                                         pack=4)
    else:
        bits = tl.inline_asm_elementwise(_ASM_LO, "=r,=r,r,r,r", [lo, code, base], dtype=tl.int16, is_pure=True,
                                         pack=4)
    return bits


@triton.jit
def _raw_pairs(lo, code, base, high, rmask, HIGH_NIBBLE: tl.constexpr):
    if HIGH_NIBBLE:
        bits = tl.inline_asm_elementwise(_ASM_RAW_HI, "=r,=r,r,r,r,r,r", [lo, code, base, high, rmask],
                                         dtype=tl.int16, is_pure=True, pack=4)
    else:
        bits = tl.inline_asm_elementwise(_ASM_RAW_LO, "=r,=r,r,r,r,r,r", [lo, code, base, high, rmask],
                                         dtype=tl.int16, is_pure=True, pack=4)
    return bits


@triton.jit
def _raw_high(high_ptr, raw_idx, rows16, offs_h, m):
    """Rows in raw tiles ([BLOCK_N, 1]) and their tiles' high-nibble bytes [BLOCK_N, 32] (0 elsewhere)."""
    raw = (raw_idx >= 0)[:, None]
    at = tl.maximum(raw_idx, 0)  # in-bounds addresses under the mask too
    hn = tl.load(high_ptr + at[:, None] * 512 + rows16[:, None] * 32 + offs_h[None, :], mask=raw & m, other=0)
    return raw, hn


@triton.jit
def _half_tiles(lo_row, code_row, high_ptr, raw_idx, rows16, base, base8, k0, offs_h, n_mask, like_ptr,
                HAS_RAW: tl.constexpr, PACKED: tl.constexpr, EXACT: tl.constexpr, TILE_MAJOR: tl.constexpr):
    """The two [BLOCK_N, 32] halves (columns k0 .. k0 + 31 and k0 + 32 .. k0 + 63) of a weight tile, in
    like_ptr's dtype. lo_row / code_row: [BLOCK_N, 1] pointers to the rows' first byte; raw_idx: each row's
    raw-tile index at this slice, or -1; base / base8: the rows' bases as int32 [BLOCK_N] / uint8 [BLOCK_N, 32].
    PACKED: by packed byte arithmetic (inline PTX; compiled only: the interpreter runs no PTX), else per weight.
    EXACT (with the caller's _operand): the tiles reach tl.dot through mma_operand, so the MMA sums K in the bf16
    kernel's grouping (its outputs bit-equal to fused_moe's on the decoded weights; on the H200 of 2026-12-05 only
    with JOIN_K off at every size), at the cost of a shared-memory round trip of the decoded tile (STS, a barrier,
    LDSM). Else Triton decodes straight in the MMA operand registers from the
    bytes' own layout (kWidth 4 under MMA v2): no round trip, sums grouped differently (bf16 GEMM tolerance).
    TILE_MAJOR: lo_row / code_row address the rows in tile_major()'s layout (a slice's bytes 1536 apart)."""
    m = n_mask[:, None]
    if TILE_MAJOR:
        lo_off = (k0 // 64) * TM_TILE_BYTES
        code_off = lo_off
    else:
        lo_off = k0
        code_off = k0 // 2
    code = tl.load(code_row + code_off + offs_h[None, :], mask=m, other=0)
    lo0 = tl.load(lo_row + lo_off + offs_h[None, :], mask=m, other=0)
    lo1 = tl.load(lo_row + lo_off + 32 + offs_h[None, :], mask=m, other=0)
    if PACKED:
        b0 = _pairs(lo0, code, base8, False)
        b1 = _pairs(lo1, code, base8, True)
        if HAS_RAW:
            if EXACT:
                if tl.max(raw_idx, 0) >= 0:  # any raw tile among these rows (~28% of 64-row tiles on N(0, s))
                    raw, hn = _raw_high(high_ptr, raw_idx, rows16, offs_h, m)
                    rmask = tl.where(raw, 255, 0).to(tl.uint8) + tl.zeros_like(code)
                    b0 = _raw_pairs(lo0, code, base8, hn, rmask, False)
                    b1 = _raw_pairs(lo1, code, base8, hn, rmask, True)
            else:  # branch-free (the select on every slice): a branch's scf.if stops Triton's layout hoisting
                raw, hn = _raw_high(high_ptr, raw_idx, rows16, offs_h, m)
                rmask = tl.where(raw, 255, 0).to(tl.uint8) + tl.zeros_like(code)
                b0 = _raw_pairs(lo0, code, base8, hn, rmask, False)
                b1 = _raw_pairs(lo1, code, base8, hn, rmask, True)
    else:
        c0 = code.to(tl.int32) & 0xF
        c1 = code.to(tl.int32) >> 4
        hi0 = c0 + base[:, None] + 120 * (c0 >> 3)
        hi1 = c1 + base[:, None] + 120 * (c1 >> 3)
        if HAS_RAW:
            if tl.max(raw_idx, 0) >= 0:
                raw, hn = _raw_high(high_ptr, raw_idx, rows16, offs_h, m)
                hn = hn.to(tl.int32)
                hi0 = tl.where(raw, c0 | ((hn & 0xF) << 4), hi0)
                hi1 = tl.where(raw, c1 | (hn & 0xF0), hi1)
        b0 = ((hi0 << 8) | lo0.to(tl.int32)).to(tl.int16)
        b1 = ((hi1 << 8) | lo1.to(tl.int32)).to(tl.int16)
    w0 = b0.to(tl.bfloat16, bitcast=True).to(like_ptr.dtype.element_ty)
    w1 = b1.to(tl.bfloat16, bitcast=True).to(like_ptr.dtype.element_ty)
    return w0, w1


@triton.jit
def _operand(w, EXACT: tl.constexpr):
    """A decoded tile as the dot's operand: through mma_operand when EXACT (the copy must wrap the very tile the
    dot takes: one made per half and joined after leaves the joined tile's layout to Triton, and on the H200 the
    MMA then summed K in another grouping, 1-2 ulp off the bf16 kernel at the Mixtral shapes, 2026-12-05)."""
    if EXACT:
        w = mma_operand(w)
    return w


@triton.jit
def _join_k(w0, w1, BLOCK_N: tl.constexpr):
    """The [BLOCK_N, 64] tile of a K step from its two K = 32 halves (columns 0-31, 32-63), for one K = 64 dot:
    two dots a step on one accumulator count as chained for Triton's MMA v3 warp layout (8 warps: [8, 1] for the
    first, [4, 2] for the second), which then converts the fp32 accumulators between them through shared memory
    four times a K step (benchmarks/lossless_sass.py, Mixtral T = 256: 28 STS and 33 barriers a step)."""
    return tl.reshape(tl.permute(tl.join(w0, w1), (0, 2, 1)), (BLOCK_N, 64))


@triton.jit
def _tm_rows(rows, K):
    """Byte offsets of rows (int64 [BLOCK_N], global over the parts) at slice 0 in tile_major()'s layout."""
    return (rows // 16) * (K // 64) * TM_TILE_BYTES + (rows % 16) * 96


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def fused_moe_hibyte_kernel(
    a_ptr, lo_ptr, code_ptr, base_ptr, tile_raw_ptr, high_ptr, out_ptr, sorted_slots_ptr, block_expert_ptr, slot_ptr,
    num_slots, num_blocks, N, K, k_per_split, part_rows, stride_a, stride_os, stride_om,
    TOP_K: tl.constexpr, GATED: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_RAW: tl.constexpr, USE_SLOTS: tl.constexpr = False, PACKED: tl.constexpr = False,
    EXACT: tl.constexpr = True, TILE_MAJOR: tl.constexpr = False, JOIN_K: tl.constexpr = True,
):
    """As fused_moe_lossless_kernel (one block of one expert, GATED: silu(gate) * up), W decoded from the hibyte
    arrays. BLOCK_K a multiple of 64; K a multiple of 64 (the format's)."""
    pid = tl.program_id(0)
    pid_m = pid % num_blocks
    pid_n = pid // num_blocks
    pid_k = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    if USE_SLOTS:
        expert = tl.load(slot_ptr + expert)
        if expert < 0:
            return
    slots, m_mask, a_rows, offs_n, n_mask = block_rows(sorted_slots_ptr, pid_m, pid_n, num_slots, N, TOP_K,
                                                        BLOCK_M, BLOCK_N, EVEN_N)
    offs_h = tl.arange(0, 32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    e64 = expert.to(tl.int64)
    tiles_rows = part_rows // 16
    tile0 = expert * tiles_rows * (K // 64)
    if TILE_MAJOR:  # lo_ptr: tile_major()'s bytes (code_ptr unused)
        lo_g = lo_ptr + _tm_rows(e64 * part_rows + offs_n, K)[:, None]
        code_g = lo_g + 64
    else:
        lo_g = lo_ptr + e64 * part_rows * K + offs_n[:, None] * K
        code_g = code_ptr + e64 * part_rows * (K // 2) + offs_n[:, None] * (K // 2)
    base_g = tl.load(base_ptr + e64 * part_rows + offs_n, mask=n_mask, other=0).to(tl.int32)
    tr_g = offs_n // 16
    r16_g = offs_n % 16
    base8_g = tl.broadcast_to(base_g.to(tl.uint8)[:, None], (BLOCK_N, 32))
    if GATED:
        if TILE_MAJOR:
            lo_u = lo_ptr + _tm_rows(e64 * part_rows + N + offs_n, K)[:, None]
            code_u = lo_u + 64
        else:
            lo_u = lo_g + N * K
            code_u = code_g + N * (K // 2)
        base_u = tl.load(base_ptr + e64 * part_rows + N + offs_n, mask=n_mask, other=0).to(tl.int32)
        tr_u = (offs_n + N) // 16
        r16_u = (offs_n + N) % 16
        base8_u = tl.broadcast_to(base_u.to(tl.uint8)[:, None], (BLOCK_N, 32))
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + (k_start + offs_h)[None, :]
    a64_ptrs = a_ptr + a_rows[:, None] * stride_a + (k_start + tl.arange(0, 64))[None, :]
    acc_g = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(k_start, k_end, BLOCK_K):
        for s in tl.static_range(BLOCK_K // 64):
            ks = k0 + s * 64
            if JOIN_K:
                a64 = tl.load(a64_ptrs + s * 64, mask=m_mask[:, None], other=0.0)
            else:
                a0 = tl.load(a_ptrs + s * 64, mask=m_mask[:, None], other=0.0)
                a1 = tl.load(a_ptrs + s * 64 + 32, mask=m_mask[:, None], other=0.0)
            tcol = tile0 + (ks // 64) * tiles_rows
            raw_g = tl.full([BLOCK_N], -1, tl.int32)
            if HAS_RAW:
                raw_g = tl.load(tile_raw_ptr + tcol + tr_g, mask=n_mask, other=-1)
            w0, w1 = _half_tiles(lo_g, code_g, high_ptr, raw_g, r16_g, base_g, base8_g, ks, offs_h, n_mask, a_ptr,
                                 HAS_RAW, PACKED, EXACT, TILE_MAJOR)
            if JOIN_K:
                acc_g = mma(acc_g, _operand(_join_k(w0, w1, BLOCK_N), EXACT), a64, SWAP_AB, DOT_PRECISION)
            else:
                acc_g = mma(acc_g, _operand(w0, EXACT), a0, SWAP_AB, DOT_PRECISION)
                acc_g = mma(acc_g, _operand(w1, EXACT), a1, SWAP_AB, DOT_PRECISION)
            if GATED:
                raw_u = tl.full([BLOCK_N], -1, tl.int32)
                if HAS_RAW:
                    raw_u = tl.load(tile_raw_ptr + tcol + tr_u, mask=n_mask, other=-1)
                u0, u1 = _half_tiles(lo_u, code_u, high_ptr, raw_u, r16_u, base_u, base8_u, ks, offs_h, n_mask,
                                     a_ptr, HAS_RAW, PACKED, EXACT, TILE_MAJOR)
                if JOIN_K:
                    acc_u = mma(acc_u, _operand(_join_k(u0, u1, BLOCK_N), EXACT), a64, SWAP_AB, DOT_PRECISION)
                else:
                    acc_u = mma(acc_u, _operand(u0, EXACT), a0, SWAP_AB, DOT_PRECISION)
                    acc_u = mma(acc_u, _operand(u1, EXACT), a1, SWAP_AB, DOT_PRECISION)
        a_ptrs += BLOCK_K
        a64_ptrs += BLOCK_K
    store_block(acc_g, acc_u, out_ptr, pid_k, stride_os, stride_om, slots, offs_n, m_mask, n_mask, GATED, SWAP_AB)


@triton.jit
def hibyte_decode_kernel(lo_ptr, code_ptr, base_ptr, tile_raw_ptr, high_ptr, out_ptr, parts_ptr, K, part_rows,
                         stride_oe, HAS_RAW: tl.constexpr, PACKED: tl.constexpr, TILE_MAJOR: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """One [BLOCK_N, 64] tile of part parts[program 2] decoded to out[program 2] (rows of the part, K columns):
    the GEMM's own tile decode (_half_tiles), stored instead of multiplied."""
    pid_n = tl.program_id(0)
    ks = tl.program_id(1) * 64
    j = tl.program_id(2)
    part = tl.load(parts_ptr + j).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < part_rows
    offs_h = tl.arange(0, 32)
    rows = part * part_rows + offs_n
    if TILE_MAJOR:
        lo_r = lo_ptr + _tm_rows(rows, K)[:, None]
        code_r = lo_r + 64
    else:
        lo_r = lo_ptr + rows[:, None] * K
        code_r = code_ptr + rows[:, None] * (K // 2)
    base = tl.load(base_ptr + rows, mask=n_mask, other=0).to(tl.int32)
    base8 = tl.broadcast_to(base.to(tl.uint8)[:, None], (BLOCK_N, 32))
    raw = tl.full([BLOCK_N], -1, tl.int32)
    if HAS_RAW:
        tiles_rows = part_rows // 16
        raw = tl.load(tile_raw_ptr + part * tiles_rows * (K // 64) + (ks // 64) * tiles_rows + offs_n // 16,
                      mask=n_mask, other=-1)
    w0, w1 = _half_tiles(lo_r, code_r, high_ptr, raw, offs_n % 16, base, base8, ks, offs_h, n_mask, out_ptr,
                         HAS_RAW, PACKED, True, TILE_MAJOR)
    o = out_ptr + j.to(tl.int64) * stride_oe + offs_n[:, None] * K + ks + offs_h[None, :]
    tl.store(o, w0, mask=n_mask[:, None])
    tl.store(o + 32, w1, mask=n_mask[:, None])


def hibyte_decode(h: "hibyte.HiByteTensor", parts: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  block_n: int = 64) -> torch.Tensor:
    """Parts `parts` (int32 [n] on h's device; None: every part) of h decoded into bf16 [n, part_rows, C] (out, or
    new; a float32 out holds the same values), bit for bit hibyte.decode_reference's rows of those parts, in one
    launch from either byte order. HiByteExperts decodes its experts with it where a GEMM over large blocks beats
    the decode in the tile loads (_launch_decoded)."""
    _, C = h.rows_cols
    Rp = h.part_rows
    dev = h.lo.device
    if parts is None:
        parts = torch.arange(h.num_parts, dtype=torch.int32, device=dev)
    if parts.dtype != torch.int32 or parts.dim() != 1 or parts.device != dev:
        raise ValueError(f"parts must be int32 [n] on {dev}, got {parts.dtype} {tuple(parts.shape)} on {parts.device}")
    n = parts.numel()
    if out is None:
        out = torch.empty(n, Rp, C, dtype=torch.bfloat16, device=dev)
    if (out.dtype not in (torch.bfloat16, torch.float32) or out.device != dev or tuple(out.shape[-2:]) != (Rp, C)
            or out.shape[0] < n or out.stride(2) != 1 or out.stride(1) != C):
        raise ValueError(f"out must be bf16 or float32 [>= {n}, {Rp}, {C}] on {dev} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if n == 0:
        return out
    high = h.high if h.high.numel() else h.lo
    tm = h.order == "tile_major"
    hibyte_decode_kernel[(triton.cdiv(Rp, block_n), C // 64, n)](
        h.lo, h.lo if tm else h.code, h.base, h.tile_raw, high, out, parts, C, Rp, out.stride(0),
        HAS_RAW=h.high.shape[0] > 0, PACKED=os.environ.get("TRITON_INTERPRET") != "1", TILE_MAJOR=tm,
        BLOCK_N=block_n, num_warps=4)
    return out


@dataclasses.dataclass(frozen=True)
class HiByteExperts:
    """One GEMM's experts in the hibyte format as fused_moe.py's launcher runs them (its `launch` hook). exact:
    the bf16 kernel's K grouping in the MMA (bit-equal outputs; see _half_tiles' EXACT). A tensor held in the
    tile_major order is read as such (tm need not be given)."""
    h: "hibyte.HiByteTensor"
    exact: bool = True
    tm: torch.Tensor | None = None  # tile_major(h) of a row-order h, read in place of h.lo / h.code when given
    join_k: bool = True  # one K = 64 dot a step (_join_k); False: a dot per K = 32 half (before 2026-12-05)
    num_warps: int | None = None  # in place of the launch config's (this GEMM's: num_warps or num_warps2)

    version = hibyte.FORMAT_VERSION  # fused_moe_mixed takes these where it takes hibyte tensors

    @property
    def shape(self) -> tuple:
        return tuple(self.h.shape)

    def launch(self, grid, a, out, sorted_slots, block_expert, slots, num_slots, num_blocks, N, K, k_per_split,
               stride_os, stride_om, top_k, gated, cfg, precision) -> None:
        h = self.h
        num_experts = h.num_parts if slots is None else slots.numel()
        if decodes(num_slots, num_experts):
            self._launch_decoded(grid, a, out, sorted_slots, block_expert, slots, num_slots, num_blocks, N, K,
                                 k_per_split, stride_os, stride_om, top_k, gated, cfg, precision, num_experts)
            return
        bn, bk, warps, stages = ((cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) if gated else
                                 (cfg.block_n2, cfg.block_k2, cfg.num_warps2, cfg.num_stages2))
        warps = self.num_warps or warps
        if bk % 64 or k_per_split % bk or K % bk:
            # K steps of 64 (the format's slices): on a GPU the same MMA instructions in the same K order as the
            # launch's own step, so the same sums
            bk = 64
        if K % 64 or k_per_split % 64:
            raise ValueError(f"the hibyte kernel steps K by 64: K ({K}) and the split ({k_per_split}) must be "
                             f"multiples of 64")
        high = h.high if h.high.numel() else h.lo  # any pointer: never read without raw tiles
        tm = h.lo if h.order == "tile_major" else self.tm
        code = h.code if tm is None else h.lo  # tile_major: the codes are in lo's array (code_ptr unused, may be empty)
        fused_moe_hibyte_kernel[grid](
            a, h.lo if tm is None else tm, code, h.base, h.tile_raw, high, out, sorted_slots, block_expert,
            block_expert if slots is None else slots, num_slots, num_blocks, N, K, k_per_split,
            h.part_rows, a.stride(0), stride_os, stride_om,
            TOP_K=top_k, GATED=gated, SWAP_AB=cfg.swap_ab, EVEN_N=N % bn == 0, BLOCK_M=cfg.block_m, BLOCK_N=bn,
            BLOCK_K=bk, DOT_PRECISION=precision, HAS_RAW=h.high.shape[0] > 0, USE_SLOTS=slots is not None,
            PACKED=os.environ.get("TRITON_INTERPRET") != "1", EXACT=self.exact, TILE_MAJOR=tm is not None,
            JOIN_K=self.join_k, num_warps=warps, num_stages=stages)

    def _launch_decoded(self, grid, a, out, sorted_slots, block_expert, slots, num_slots, num_blocks, N, K,
                        k_per_split, stride_os, stride_om, top_k, gated, cfg, precision, num_experts) -> None:
        """Large blocks (prefill): the experts decoded once, a chunk of DECODE_CHUNK_BYTES at a time, into a bf16
        buffer the bf16 kernel then reads with the same tiles, over the blocks of that chunk's experts. In the
        GEMM each of an expert's blocks decodes its tiles again (16 decodes of every weight at 1024 rows an expert
        in blocks of 64), which at prefill sizes costs more than the MMA; decoded once, a weight costs a write
        and a read of its bf16 bytes. The outputs are bit for bit fused_moe's on the decoded weights."""
        from .fused_moe import _ExpertWeights, launch_dense

        h, dev = self.h, a.device
        n, rows = h.num_parts, h.part_rows
        per = max(1, min(n, DECODE_CHUNK_BYTES // (2 * rows * K)))
        starts = torch.arange(0, n, per, dtype=torch.int32, device=dev)
        index = torch.arange(num_experts, dtype=torch.int32, device=dev) if slots is None else slots
        local = index[None, :] - starts[:, None]    # [chunks, E]: each expert's row in each chunk's buffer
        chunk_slots = torch.where((local >= 0) & (local < per), local, -1)
        parts = torch.arange(n, dtype=torch.int32, device=dev)
        buf = torch.empty(per, rows, K, dtype=a.dtype, device=dev)  # bf16 (float32 in the interpreter's tests)
        w = _ExpertWeights.of(buf)
        for c in range(starts.numel()):
            j = c * per
            hibyte_decode(h, parts[j:j + per], out=buf)
            launch_dense(w, grid, a, out, sorted_slots, block_expert, chunk_slots[c], num_slots, num_blocks, N, K,
                         k_per_split, stride_os, stride_om, top_k, gated, cfg, precision, num_experts)


# Mean routed rows per expert of the layer (slots / experts) from which HiByteExperts decodes its experts and runs the
# bf16 kernel (_launch_decoded) instead of decoding in the GEMM's tile loads; PAGEDMOE_HIBYTE_DECODE_ROWS overrides
# (0: always, a large value: never). Measured by benchmarks/bench_fused_prefill.py.
DECODE_MIN_ROWS = 256
DECODE_CHUNK_BYTES = 128 << 20   # bf16 bytes decoded at a time (at least one expert's GEMM weights)


def decode_min_rows() -> int:
    v = os.environ.get("PAGEDMOE_HIBYTE_DECODE_ROWS")
    if v is None:
        return DECODE_MIN_ROWS
    if not v.strip().isdigit():
        raise ValueError(f"PAGEDMOE_HIBYTE_DECODE_ROWS must be a whole number of rows (0: always decode), got {v!r}")
    return int(v)


def decodes(num_slots: int, num_experts: int) -> bool:
    """Whether a hibyte launch over `num_slots` routed rows of a layer of `num_experts` decodes its experts first
    (decode_min_rows() rows an expert or more)."""
    return num_slots >= decode_min_rows() * num_experts


# The bf16 kernel's tiles where the hibyte launches decode (bench_fused_prefill.py on the H100, 2026-12-07: at 512 and
# 2048 rows an expert, 128 x 128 tiles at 8 warps and 3 stages took the Triton MoE from 21.7 to 12.3 ms at Mixtral's
# 8192 tokens and from 3.46 to 2.41 ms at Qwen3's, the best of the five tilings timed at every such size)
DECODED_TILES = dict(block_m=128, block_n=128, num_warps=8, num_stages=3, block_n2=128, num_warps2=8, num_stages2=3)


# The fast kernel's tiles (decoding in its tile loads) from FAST_LARGE_ROWS routed rows an expert up to where the
# launches decode: 128-row blocks decode each weight half as often (the same bench, 128 rows an expert: Mixtral's 512
# tokens 2455 -> 1967 us, Qwen3's 2048 tokens 1868 -> 1690 us; the bf16 kernel of the layer's other experts gains
# too, 1413 -> 1319 and 1445 -> 1368). At 32 rows (Qwen3's 512 tokens) they were slower (670 -> 829 us). At 64 rows
# (Mixtral's 256 tokens, bench_fused_lossless.py on the H100, 2026-12-08) faster: 1579 -> 1484 us.
FAST_LARGE_ROWS = 64
FAST_LARGE_TILES = dict(block_m=128, block_n=64, num_warps=4, num_stages=3, block_n2=64, num_warps2=4, num_stages2=3)


def layer_tiles(cfg, num_slots: int, num_experts: int, dtype: torch.dtype, fast: bool = False):
    """The tiles fused_moe_mixed runs a layer holding hibyte experts at (half precision): DECODED_TILES where its
    launches decode (HiByteExperts.launch: decode_min_rows() routed rows an expert or more); with every hibyte part
    on the fast kernel (`fast`), FAST_LARGE_TILES from FAST_LARGE_ROWS rows; cfg elsewhere."""
    if dtype not in (torch.bfloat16, torch.float16):
        return cfg
    if decodes(num_slots, num_experts):
        return dataclasses.replace(cfg, **DECODED_TILES)
    if fast and num_slots >= FAST_LARGE_ROWS * num_experts:
        return dataclasses.replace(cfg, **FAST_LARGE_TILES)
    return cfg


def hibyte_pair(w13, w2, H: int, I: int, device, **kernel) -> tuple[HiByteExperts, HiByteExperts]:
    """A group of n experts in the hibyte format (w13 [n, 2I, H], w2 [n, H, I], one part each), checked, as
    fused_moe_mixed runs it: hibyte tensors run with `kernel` (HiByteExperts' fields, e.g. TIER_KERNELS["fast"];
    none: exact, one K = 64 dot a step), HiByteExperts as they are."""
    n = w13.shape[0] if len(getattr(w13, "shape", ())) == 3 else -1
    pair = tuple(w if isinstance(w, HiByteExperts) else HiByteExperts(w, **kernel) for w in (w13, w2))
    _check(getattr(w13, "h", w13), "w13", (n, 2 * I, H), device)
    _check(getattr(w2, "h", w2), "w2", (n, H, I), device)
    return pair


def _check(h, name: str, shape: tuple, device) -> None:
    if not isinstance(h, hibyte.HiByteTensor):
        raise ValueError(f"{name} must be a hibyte tensor (codecs/hibyte.py), got {type(h).__name__}")
    if tuple(h.shape) != shape or h.num_parts != shape[0]:
        raise ValueError(f"{name} must be {list(shape)} with one part per expert, got {list(h.shape)} in "
                         f"{h.num_parts} parts")
    if h.order not in hibyte.ORDERS:
        raise ValueError(f"{name}: unknown byte order {h.order!r}")
    for a in ("base", "lo", "code", "tile_raw", "high"):
        t = getattr(h, a)
        if not t.is_contiguous() or t.device != device:
            raise ValueError(f"{name}.{a} must be contiguous on {device}, got {t.device}")


def fused_moe_hibyte(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                     config: FusedMoEConfig | None = None, exact: bool = True, tile_major_bytes=None,
                     join_k: bool = True, **overrides) -> torch.Tensor:
    """fused_moe on experts in the hibyte format (w13 [E, 2I, H], w2 [E, H, I], one part per expert). config:
    lossless_config's tiles (K steps of 64). exact=False: the decoded tiles skip the layout copy that keeps the
    bf16 kernel's sums (faster candidate; outputs within bf16 GEMM tolerance, not bit-equal). tile_major_bytes:
    (tile_major(w13), tile_major(w2)) to read instead of row-order arrays (tensors held in the tile_major order,
    hibyte.to_tile_major, are read as such). join_k=False: a dot per K = 32 half, as before 2026-12-05."""
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused_moe_hibyte runs on CUDA (or under TRITON_INTERPRET=1), got {x.device}")
    E, two_i, H = w13.shape
    I = two_i // 2
    T, A = topk_ids.shape
    _check(w13, "w13", (E, 2 * I, H), x.device)
    _check(w2, "w2", (E, H, I), x.device)
    cfg = config or lossless_config(T, A, E, H, I, x.dtype, sm_count(x.device), x.device)
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    tm13, tm2 = tile_major_bytes or (None, None)
    for h, tm, name in ((w13, tm13, "w13"), (w2, tm2, "w2")):
        if tm is not None and (tm.dtype != torch.uint8 or tm.numel() != h.lo.numel() + h.code.numel()
                               or not tm.is_contiguous() or tm.device != x.device or h.order != "rows"):
            raise ValueError(f"tile_major_bytes[{name}] must be tile_major({name}) (contiguous uint8 on {x.device}) "
                             f"of a row-order tensor")
    return fused_moe_groups(x, [(HiByteExperts(w13, exact, tm13, join_k), HiByteExperts(w2, exact, tm2, join_k), None)],
                            topk_weights, topk_ids, T, A, E, H, I, None, cfg, {})


def fused_moe_hibyte_reference(x, w13, w2, topk_weights, topk_ids, *, config: FusedMoEConfig | None = None,
                               **overrides) -> torch.Tensor:
    """Decode-then-GEMM with the same tiles."""
    T, A = topk_ids.shape
    E, two_i, H = w13.shape
    cfg = config or lossless_config(T, A, E, H, two_i // 2, x.dtype, sm_count(x.device), x.device)
    return fused_moe(x, hibyte.decode_reference(w13).to(x.device, x.dtype),
                     hibyte.decode_reference(w2).to(x.device, x.dtype), topk_weights, topk_ids, config=cfg, **overrides)
