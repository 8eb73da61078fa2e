"""Triton building blocks of the MoE GEMM kernels (kernels/fused_moe.py, kernels/fused_moe_lossless.py): a
block's rows and masks, the weight tile (as stored, or dequantized), the accumulator, the MMA in either operand
order and the block's store (SiLU-and-mul when gated). Shared so both kernels reduce in the same order."""
import os

import triton
import triton.language as tl

# Compiled for a GPU (not run by the interpreter, which has no inline assembly): see mma_operand.
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def mma_operand(w):
    """w, a weight tile computed in registers (decoded or dequantized), handed to tl.dot as a loaded tile is.

    NOTE: Triton picks an MMA v2 operand's register layout (kWidth) from the narrowest load the operand derives
    from through elementwise ops: a bf16 tile decoded from uint8 bytes gets kWidth 4, a loaded bf16 tile kWidth
    2. The two layouts put the K elements in different slots of each mma.sync, which sums them in a different
    grouping: the fp32 accumulators differ in the last bits, and on the H200 1-2 bf16 ulp of the output at the
    Mixtral shapes (the MMA v3 path, with both tiles in shared memory, was equal). An opaque copy (inline
    assembly with side effects, which that search does not look through) ends the search at the tile itself:
    both kernels get the same layout, the same sums and the same bits. benchmarks/compile_sm90.py
    (tests/kernels/test_fused_moe_compile.py) checks the layouts match for sm_90. Used by the lossless decode
    (bit-exactness is its contract), not by the lossy dequantization (weight_tile)."""
    if COMPILED:
        if w.dtype.primitive_bitwidth == 16:
            w = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=w.dtype, is_pure=False, pack=2)
        else:
            w = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [w], dtype=w.dtype, is_pure=False, pack=1)
    return w


@triton.jit
def weight_tile(w_ptrs, s_ptrs, k0, mask, n_mask, like_ptr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile in like_ptr's dtype (the activations'). QUANT 0: as stored. 1 (fp8 /
    int8, one float32 scale per output channel): q * s. 2 (int4 stored v + 8, two per byte, a scale per
    GROUP inputs; the tile lies in one group, starting at an even K): w_ptrs / mask address the tile's
    BLOCK_K / 2 bytes, each loaded once and split into its two nibbles, interleaved back into K order:
    (nibble - 8) * s. Products in float32, rounded once to nearest even: the values kernels/dequant.py
    writes, so the GEMM sees the same weights as through a dequantized copy."""
    if QUANT == 0:
        w = tl.load(w_ptrs, mask=mask, other=0.0)
    else:
        if QUANT == 1:
            s = tl.load(s_ptrs, mask=n_mask, other=0.0)
            # no `other` (an int constant does not cast to fp8 when compiled): masked lanes zeroed after
            q = tl.where(mask, tl.load(w_ptrs, mask=mask).to(tl.float32), 0.0)
        else:
            s = tl.load(s_ptrs + k0 // GROUP, mask=n_mask, other=0.0)
            byte = tl.load(w_ptrs, mask=mask, other=0)  # [BLOCK_N, BLOCK_K // 2]: each byte once
            q = tl.interleave((byte & 0xF).to(tl.float32) - 8.0, (byte >> 4).to(tl.float32) - 8.0)
        # NOTE: not through mma_operand: under MMA v2 these tiles keep the kWidth of their 8-bit loads, so the sums
        # may differ from fused_moe's on the dequantized weights in the last bits (lossy weights: the values are
        # the same, only the rounding of their sums); the copy would cost w2 ~200 more spilled bytes at 64 tokens
        w = (q * s[:, None]).to(like_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return w


@triton.jit
def block_rows(sorted_slots_ptr, pid_m, pid_n, num_slots, N, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """A block's slots (padding rows hold the sentinel num_slots), their rows of a (slot // TOP_K), its output
    columns and their masks."""
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    offs_n, n_mask = block_cols(pid_n, N, BLOCK_N, EVEN_N)
    return slots, slots < num_slots, (slots // TOP_K).to(tl.int64), offs_n, n_mask


@triton.jit
def block_cols(pid_n, N, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Output columns of column tile pid_n and their mask."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        n_mask = tl.full([BLOCK_N], 1, tl.int1)
    else:
        n_mask = offs_n < N
    return offs_n, n_mask


@triton.jit
def acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """fp32 accumulator: [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with the weight tile on the MMA's M side."""
    # NOTE: one return statement: compiled, Triton checks every return of a function against the first, even
    # under a constexpr branch, so two returns of different shapes fail ("Inconsistent return types").
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return acc


@triton.jit
def mma(acc, w, a, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a @ w^T ([BLOCK_M, BLOCK_N]), or with SWAP_AB acc += w @ a^T ([BLOCK_N, BLOCK_M]: the weight tile
    on the MMA's M side)."""
    if SWAP_AB:  # one return (see acc_zeros)
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def slot_block_rows(pid_m, pid_n, num_slots, N, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_N: tl.constexpr):
    """block_rows of block pid_m when each block is one slot (fused_moe's SLOT_BLOCKS): row 0 holds slot pid_m,
    the padding rows the sentinel num_slots, as moe_align lays out a token's experts (no load)."""
    slots = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_slots)
    offs_n, n_mask = block_cols(pid_n, N, BLOCK_N, EVEN_N)
    return slots, slots < num_slots, (slots // TOP_K).to(tl.int64), offs_n, n_mask


@triton.jit
def store_block(acc_g, acc_u, out_ptr, pid_k, stride_os, stride_om, slots, offs_n, m_mask, n_mask,
                 GATED: tl.constexpr, SWAP_AB: tl.constexpr):
    """Writes a block's rows: silu(gate) * up when GATED, else the plain product (of split pid_k)."""
    if GATED:
        res = acc_g * tl.sigmoid(acc_g) * acc_u
    else:
        res = acc_g
    if SWAP_AB:
        res = tl.trans(res)
    out_ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os + slots.to(tl.int64)[:, None] * stride_om
                + offs_n[None, :])
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
