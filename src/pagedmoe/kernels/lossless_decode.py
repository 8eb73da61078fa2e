"""Triton decoder for the lossless bf16 format (``codecs/lossless.py``; spec in docs/formats.md).

One program decodes one block: ``lanes`` lanes, each walking its own Huffman code stream from a
stored start bit, ``elems_per_lane`` steps. At step k, lane j produces element k * lanes + j, so
every step reads one contiguous row of raw bytes and writes one contiguous row of bf16.

A lane keeps three stream words in registers (cur, nxt, and a prefetched third) and a bit offset
into cur. Each step: a 32-bit window = funnel shift of (cur, nxt) by the offset, one decode-table
lookup by its top ``short_bits`` bits (a second, masked lookup for the rare longer codes), then
the offset advances by the code length; crossing a word boundary shifts the words along and
issues the load of the word after next, so its latency is hidden behind the following steps.
The decode table (256 entries, 1 KB as int32, for the default 8-bit codes) stays in L1.
NOTE: a lane reads up to 3 words past the word holding its position; full blocks may read
past their own codes into the next lane's or the stream's zero padding (LosslessLayout.pad_words).
Output: bf16 bits = (sign-extended raw byte & 0x807F) | (table entry & 0x7F80), one bit-select.

The PyTorch reference is ``pagedmoe.codecs.lossless.decode_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmoe.codecs.lossless import CompressedTensor, decode_reference


@triton.jit
def _lane_steps(wptr, lut_ptr, rptr, optr, lane, cur, nxt, nn, off, n_valid,
                LANES: tl.constexpr, K: tl.constexpr, MAX_LEN: tl.constexpr,
                SHORT_BITS: tl.constexpr, MASKED: tl.constexpr, UNROLL: tl.constexpr):
    # wptr: per-lane pointer to the word holding cur (a pointer, not an index: one 64-bit add
    # per step instead of index arithmetic and an address computation)
    for k in tl.range(K, loop_unroll_factor=UNROLL):
        win = (((cur.to(tl.uint64) << 32) | nxt.to(tl.uint64)) << off.to(tl.uint64)) >> 32
        win = win.to(tl.uint32)
        e = tl.load(lut_ptr + (win >> (32 - SHORT_BITS)).to(tl.int32)).to(tl.int32)
        if SHORT_BITS < MAX_LEN:
            # rare codes longer than SHORT_BITS: second table indexed by the full MAX_LEN bits
            is_long = e < 0
            e2 = tl.load(lut_ptr + (1 << SHORT_BITS) + (win >> (32 - MAX_LEN)).to(tl.int32),
                         mask=is_long, other=0)
            e = tl.where(is_long, e2.to(tl.int32), e)
        off = off + (e & 15)
        adv = off >= 32
        off = off & 31
        cur = tl.where(adv, nxt, cur)
        nxt = tl.where(adv, nn, nxt)
        wptr = wptr + adv.to(tl.int32)
        idx = k * LANES + lane
        # the load keeps nn where it does not fire (other=nn): no separate select
        if MASKED:
            valid = idx < n_valid
            nn = tl.load(wptr + 2, mask=adv & valid, other=nn.to(tl.int32, bitcast=True)).to(tl.uint32, bitcast=True)
            r = tl.load(rptr + idx, mask=valid, other=0)
        else:
            nn = tl.load(wptr + 2, mask=adv, other=nn.to(tl.int32, bitcast=True)).to(tl.uint32, bitcast=True)
            r = tl.load(rptr + idx)
        # raw byte as int8, sign-extended: the sign lands in bit 15, the mantissa in bits 0-6
        r = r.to(tl.int8, bitcast=True).to(tl.int32)
        o = ((r & 0x807F) | (e & 0x7F80)).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if MASKED:
            tl.store(optr + idx, o, mask=valid)
        else:
            tl.store(optr + idx, o)


@triton.jit
def _decode_block(stream_ptr, block_bit_ptr, lane_bits_ptr, raw_ptr, lut_ptr, optr, part, bip, part_size,
                  blocks_per_part, LANES: tl.constexpr, K: tl.constexpr, MAX_LEN: tl.constexpr,
                  SHORT_BITS: tl.constexpr, UNROLL: tl.constexpr):
    # one block: block `bip` of part `part`, written from optr (the block's first output element)
    blk = part * blocks_per_part + bip
    elem0 = part.to(tl.int64) * part_size + bip.to(tl.int64) * (LANES * K)
    n_valid = tl.minimum(part_size - bip.to(tl.int64) * (LANES * K), LANES * K).to(tl.int32)

    lane = tl.arange(0, LANES)
    lb = tl.load(lane_bits_ptr + blk.to(tl.int64) * LANES + lane).to(tl.int32)
    base = tl.load(block_bit_ptr + blk)
    bit = (base & 31).to(tl.int32) + tl.cumsum(lb, 0) - lb  # lane start, relative to word base>>5
    wptr = stream_ptr + (base >> 5) + (bit >> 5)
    off = bit & 31
    cur = tl.load(wptr).to(tl.uint32, bitcast=True)
    nxt = tl.load(wptr + 1).to(tl.uint32, bitcast=True)
    nn = tl.load(wptr + 2).to(tl.uint32, bitcast=True)
    rptr = raw_ptr + elem0
    if n_valid == LANES * K:
        _lane_steps(wptr, lut_ptr, rptr, optr, lane, cur, nxt, nn, off, n_valid,
                    LANES, K, MAX_LEN, SHORT_BITS, False, UNROLL)
    else:
        _lane_steps(wptr, lut_ptr, rptr, optr, lane, cur, nxt, nn, off, n_valid,
                    LANES, K, MAX_LEN, SHORT_BITS, True, 1)


@triton.jit
def lossless_decode_kernel(
    stream_ptr,  # *int32 [num_words]
    block_bit_ptr,  # *int64 [num_blocks]
    lane_bits_ptr,  # *uint8 or *int16 [num_blocks, LANES]
    raw_ptr,  # *uint8 [numel]
    lut_ptr,  # *int16 or *int32 [2**SHORT_BITS (+ 2**MAX_LEN)]
    out_ptr,  # *bf16: part p0 + i starts at out_ptr + i * out_part_stride (INDEXED: row r at r * out_part_stride)
    part_ids_ptr,  # INDEXED: *int [n] the parts to decode (else unused)
    dst_rows_ptr,  # INDEXED: *int [n] the output row of each (-1: skip it; else unused)
    block_start,  # first block decoded by program 0 (not INDEXED)
    part_start,  # p0, the first part decoded (not INDEXED)
    out_part_stride,  # elements between the starts of consecutive parts (rows) in out (>= part_size)
    part_size,
    blocks_per_part,
    LANES: tl.constexpr,
    K: tl.constexpr,
    MAX_LEN: tl.constexpr,
    SHORT_BITS: tl.constexpr,
    UNROLL: tl.constexpr,
    INDEXED: tl.constexpr,
):
    pid = tl.program_id(0)
    if INDEXED:
        # program i * blocks_per_part + b: block b of part part_ids[i] into row dst_rows[i]; the grid is fixed by
        # n (no host sync on which parts are wanted), the programs of a skipped entry (-1) exit at once
        i = pid // blocks_per_part
        bip = pid - i * blocks_per_part
        row = tl.load(dst_rows_ptr + i)
        if row >= 0:
            part = tl.load(part_ids_ptr + i).to(tl.int32)
            optr = out_ptr + row.to(tl.int64) * out_part_stride + bip.to(tl.int64) * (LANES * K)
            _decode_block(stream_ptr, block_bit_ptr, lane_bits_ptr, raw_ptr, lut_ptr, optr, part, bip, part_size,
                          blocks_per_part, LANES, K, MAX_LEN, SHORT_BITS, UNROLL)
    else:
        blk = block_start + pid
        part = blk // blocks_per_part
        bip = blk - part * blocks_per_part
        optr = out_ptr + (part - part_start).to(tl.int64) * out_part_stride + bip.to(tl.int64) * (LANES * K)
        _decode_block(stream_ptr, block_bit_ptr, lane_bits_ptr, raw_ptr, lut_ptr, optr, part, bip, part_size,
                      blocks_per_part, LANES, K, MAX_LEN, SHORT_BITS, UNROLL)


def _launch_info(ct: CompressedTensor) -> tuple[int, int]:
    """Checks ct's arrays once (then cached on ct): (part_size, blocks_per_part)."""
    if ct.version != 1:
        raise ValueError(f"lossless_decode reads format version 1; this tensor is version {ct.version} "
                         f"(tiled: decoded inside the MoE GEMM by kernels/fused_moe_lossless.py)")
    info = ct.cache.get("launch")
    if info is None:
        lay = ct.layout
        for name, t, dtype in (("stream", ct.stream, torch.int32), ("block_bit_offsets", ct.block_bit_offsets, torch.int64),
                               ("lane_bits", ct.lane_bits, lay.lane_bits_dtype), ("raw", ct.raw, torch.uint8)):
            if t.dtype != dtype or not t.is_contiguous() or t.device != ct.device:
                raise ValueError(f"{name} must be a contiguous {dtype} tensor on {ct.device}")
        if ct.lane_bits.shape != (ct.num_blocks, lay.lanes) or ct.raw.numel() != ct.numel:
            raise ValueError(f"lane_bits {tuple(ct.lane_bits.shape)} / raw {ct.raw.numel()} do not match the shape")
        info = ct.cache["launch"] = (ct.part_size, ct.blocks_per_part)
    return info


def prepare_launch(ct: CompressedTensor, device: torch.device | None = None) -> None:
    """Check ct's arrays and build its default decode table now (on `device`: default ct's; the GPU for a tensor in
    mapped host memory, lossless_decode_indexed): both touch the host, which a decode inside a CUDA-graph capture
    (or a forward) must not do."""
    _launch_info(ct)
    ct.decode_table(None, torch.int32, device)


def decode_runs(ct: CompressedTensor, runs) -> None:
    """Decode parts of ct into rows: runs of (p0, p1, rows [p1 - p0, part_size] or a contiguous range of that
    many elements). On CUDA one launch per run; on the CPU the PyTorch reference decodes ct once."""
    if ct.device.type == "cuda":
        for p0, p1, dst in runs:
            lossless_decode(ct, dst, parts=(p0, p1))
        return
    rows = decode_reference(ct, torch.empty(ct.num_parts, ct.part_size, dtype=torch.bfloat16))
    for p0, p1, dst in runs:
        dst.copy_(rows[p0:p1].reshape(dst.shape))


def lossless_decode(ct: CompressedTensor, out: torch.Tensor, *, parts: tuple[int, int] | None = None,
                    short_bits: int | None = None, num_warps: int = 4, unroll: int = 2,
                    table_dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Decodes ct (or its parts [p0, p1)) into out, a bf16 tensor on ct's device: contiguous with
    (p1 - p0) * part_size elements, or [p1 - p0, part_size] with unit last stride, one row per part (the
    rows of an expert compute buffer padded past the expert's size). Launches one kernel; no host sync. Performance knobs only (any value
    decodes the same bits; defaults are the fastest measured on the H200): short_bits, the index
    width of the first decode table (default max_code_len: one table; smaller values add a second
    lookup for longer codes); num_warps; unroll, the step loop's unroll factor; table_dtype,
    int16 or int32 decode-table entries.
    """
    part_size, bpp = _launch_info(ct)
    p0, p1 = (0, ct.num_parts) if parts is None else parts
    if not 0 <= p0 <= p1 <= ct.num_parts:
        raise ValueError(f"parts {parts} out of range for {ct.num_parts} parts")
    if out.dtype != torch.bfloat16:
        raise TypeError(f"out must be bf16, got {out.dtype}")
    if out.is_contiguous():
        if out.numel() != (p1 - p0) * part_size:
            raise ValueError(f"out has {out.numel()} elements, parts [{p0}, {p1}) hold {(p1 - p0) * part_size}")
        part_stride = part_size
    elif (out.dim() == 2 and tuple(out.shape) == (p1 - p0, part_size) and out.stride(1) == 1
          and out.stride(0) >= part_size):  # one row per part, rows further apart than a part
        part_stride = out.stride(0)
    else:
        raise ValueError(f"out must be contiguous, or [{p1 - p0}, {part_size}] with unit last stride (one row "
                         f"per part); got {tuple(out.shape)} with strides {out.stride()}")
    if out.device != ct.raw.device:
        raise ValueError(f"out is on device {out.device}, the compressed tensor on {ct.raw.device}")
    lay = ct.layout
    short_bits = lay.max_code_len if short_bits is None else min(short_bits, lay.max_code_len)
    num_blocks = (p1 - p0) * bpp
    if num_blocks == 0:
        return out
    lossless_decode_kernel[(num_blocks,)](
        ct.stream, ct.block_bit_offsets, ct.lane_bits, ct.raw, ct.decode_table(short_bits, table_dtype),
        out, out, out, p0 * bpp, p0, part_stride, part_size, bpp,   # (the part / row pointers unused)
        LANES=lay.lanes, K=lay.elems_per_lane, MAX_LEN=lay.max_code_len, SHORT_BITS=short_bits,
        UNROLL=unroll, INDEXED=False, num_warps=num_warps,
    )
    return out


def lossless_decode_indexed(ct: CompressedTensor, out: torch.Tensor, part_ids: torch.Tensor, dst_rows: torch.Tensor,
                            *, num_warps: int = 4, unroll: int = 2) -> torch.Tensor:
    """out[dst_rows[i], :part_size] = part part_ids[i] of ct, for every i with dst_rows[i] >= 0, where `part_ids`
    and `dst_rows` are int32 / int64 device tensors [n]: which parts are decoded, and where, is read on the device
    (routed fetching's path (b), experts/routed_uva.py: the misses of a layer), so the launch (grid n x blocks per
    part, fixed) needs no host sync and a CUDA graph can capture it. `out` [S, row] bf16 with unit last stride and
    rows of at least part_size (the expert cache's pool); the rest of each row is left as it is. Decodes the bits
    lossless_decode decodes (the same kernel, its INDEXED variant). ct may also live in pinned host memory mapped
    into the device's address space (experts/tiers/host.py::mapped_layer) while `out` is on the GPU: the kernel then
    reads the compressed arrays over PCIe, each byte once (the decode table on out's device: prepare_launch)."""
    part_size, bpp = _launch_info(ct)
    n = part_ids.shape[0]
    if part_ids.dim() != 1 or tuple(dst_rows.shape) != (n,):
        raise ValueError(f"part_ids {tuple(part_ids.shape)} and dst_rows {tuple(dst_rows.shape)} must be [n] alike")
    if part_ids.dtype not in (torch.int32, torch.int64) or dst_rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"part_ids and dst_rows must be int32 or int64, got {part_ids.dtype} and {dst_rows.dtype}")
    if out.dtype != torch.bfloat16:
        raise TypeError(f"out must be bf16, got {out.dtype}")
    if out.dim() != 2 or out.stride(1) != 1 or out.shape[1] < part_size:
        raise ValueError(f"out must be [rows, >= {part_size}] with unit last stride (one row per part); got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    devices = {out.device, part_ids.device, dst_rows.device}
    mapped = out.is_cuda and ct.raw.device.type == "cpu" and ct.raw.is_pinned()
    if len(devices) != 1 or not (devices == {ct.raw.device} or mapped):
        raise ValueError(f"out, part_ids and dst_rows must be on one device: the compressed tensor's "
                         f"({ct.raw.device}), or a GPU reading it from pinned host memory")
    if n == 0:
        return out
    lay = ct.layout
    lossless_decode_kernel[(n * bpp,)](
        ct.stream, ct.block_bit_offsets, ct.lane_bits, ct.raw, ct.decode_table(None, torch.int32, out.device),
        out, part_ids, dst_rows, 0, 0, out.stride(0), part_size, bpp,
        LANES=lay.lanes, K=lay.elems_per_lane, MAX_LEN=lay.max_code_len, SHORT_BITS=lay.max_code_len,
        UNROLL=unroll, INDEXED=True, num_warps=num_warps,
    )
    return out
