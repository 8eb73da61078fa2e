"""Lossless bf16 format: raw sign+mantissa bytes + Huffman-coded exponents, decodable in parallel.

A bf16 weight is sign(1) | exponent(8) | mantissa(7). The exponent carries ~2.6 bits of
information in trained (or Gaussian) weights, the rest are nearly incompressible, so:
  raw[i]    = sign << 7 | mantissa          one byte per weight, natural order
  exponents = length-limited canonical Huffman codes (``huffman.py``), one codebook per tensor

Parallel layout (``docs/formats.md`` is the precise spec). A tensor is ``num_parts`` equal
contiguous parts (a stacked [E, ...] expert tensor: one part per expert, sharing the codebook);
each part is cut into blocks of ``lanes * elems_per_lane`` elements (the last one may be
short). In a block, lane j owns elements k * lanes + j (k = 0 .. elems_per_lane - 1), so at each
step of the decoder all lanes write one contiguous row. A lane's codes are written back to back;
lanes follow each other in a block, blocks in a part; each part starts on a 32-bit word.
Stored per block: its first bit (int64); per lane: its length in bits (uint8 when
elems_per_lane * max_code_len <= 255, else int16). That is all a decoder needs to start every
lane independently; a block's output offset is a closed-form function of its index
(part * part_size + block_in_part * block_elems).
"""
from __future__ import annotations

import functools
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pagedmoe.codecs import huffman

from pagedmoe.codecs.lossless_format import (ARRAYS, FORMAT_NAME, FORMAT_VERSION, PAD_SYMBOL, CompressedTensor,
                                             CorruptCheckpointError, LosslessLayout)

__all__ = ["ARRAYS", "FORMAT_NAME", "FORMAT_VERSION", "PAD_SYMBOL", "CompressedTensor", "CorruptCheckpointError",
           "LosslessLayout", "Codebook", "split_bf16", "encode", "pack_exponents", "crc32_parts", "compute_checksums",
           "verify", "decode_reference"]


def split_bf16(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int16 bf16 bit patterns -> (exponent uint8, sign << 7 | mantissa uint8)."""
    exps = ((bits >> 7) & 0xFF).to(torch.uint8)
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    return exps, raw


# Elements split at a time: the int16 temporaries of split_bf16 (~10 bytes per element) stay at ~160 MB
# however large the tensor (a whole Mixtral-8x7B layer split at once held 4 of them, 10.5 GiB, on the device).
SPLIT_ELEMS = 1 << 24


def split_bf16_into(bits: torch.Tensor, exps: torch.Tensor, raw: torch.Tensor, split_elems: int = SPLIT_ELEMS) -> None:
    """split_bf16 of the flat int16 `bits`, written into `exps` and `raw` (uint8, same numel) a slice at a time."""
    for a in range(0, bits.numel(), split_elems):
        e, r = split_bf16(bits[a:a + split_elems])
        exps[a:a + e.numel()].copy_(e)
        raw[a:a + r.numel()].copy_(r)


def exponent_histogram(exps: torch.Tensor, split_elems: int = SPLIT_ELEMS) -> torch.Tensor:
    """int64 [256] counts of the uint8 exponents (on their device), a slice at a time. An integer index_add_ (exact
    in any order), not bincount, which syncs with the host on CUDA to size its output."""
    hist = torch.zeros(256, dtype=torch.int64, device=exps.device)
    one = torch.ones(1, dtype=torch.int64, device=exps.device)
    for a in range(0, exps.numel(), split_elems):
        idx = exps[a:a + split_elems].to(torch.int64)
        hist.index_add_(0, idx, one.expand(idx.numel()))
    return hist


@dataclass(frozen=True)
class Codebook:
    """One tensor's exponent code: canonical Huffman code lengths [256] (uint8), their codes, the fill
    exponent (the most frequent; the only one when every length is 0)."""
    lengths: np.ndarray
    codes: np.ndarray
    fill: int

    @classmethod
    def of_histogram(cls, hist: np.ndarray, max_code_len: int) -> "Codebook":
        lengths = huffman.code_lengths_from_histogram(hist, max_code_len)
        return cls(lengths, huffman.canonical_codes(lengths), int(np.argmax(hist)) if hist.any() else 0)


def _block_chunks(num_parts: int, part_size: int, bpp: int, block_elems: int, chunk_blocks: int):
    """Ranges [g0, g1) of blocks to encode together: full blocks that are contiguous in memory
    (then a view gives stream order), and each part's short last block on its own."""
    if part_size % block_elems == 0:  # every block is full: chunks may cross parts
        for g0 in range(0, num_parts * bpp, chunk_blocks):
            yield g0, min(num_parts * bpp, g0 + chunk_blocks)
        return
    full = part_size // block_elems
    for p in range(num_parts):
        for b0 in range(0, full, chunk_blocks):
            yield p * bpp + b0, p * bpp + min(full, b0 + chunk_blocks)
        yield p * bpp + full, (p + 1) * bpp


def _stream_order(exps: torch.Tensor, g0: int, g1: int, part_size: int, bpp: int, layout) -> torch.Tensor:
    """Exponents of blocks [g0, g1) in stream order: int64 [g1 - g0, lanes, elems_per_lane]."""
    L, K, B = layout.lanes, layout.elems_per_lane, layout.block_elems
    p, b0 = divmod(g0, bpp)
    if part_size % B == 0 or (b0 + g1 - g0) * B <= part_size:  # full blocks, contiguous: a view
        e0 = p * part_size + b0 * B
        v = exps[e0 : e0 + (g1 - g0) * B].view(g1 - g0, K, L).transpose(1, 2)
        return v.to(torch.int64)
    g = torch.arange(g0, g1, device=exps.device)
    in_part = ((g % bpp) * B)[:, None, None] + (torch.arange(K, device=exps.device) * L)[None, None, :] \
        + torch.arange(L, device=exps.device)[None, :, None]
    idx = (g // bpp * part_size)[:, None, None] + in_part
    valid = in_part < part_size
    out = exps[idx.clamp(max=max(exps.numel() - 1, 0))].to(torch.int64)
    return out.masked_fill_(~valid, PAD_SYMBOL)


def _pack_words(codes: torch.Tensor, lens: torch.Tensor, pos: torch.Tensor, stream: torch.Tensor, w0: int,
                num_words: int) -> None:
    """ORs codes [n] (lengths lens, first bits pos) into the int32 stream, MSB-first; the codes lie in words
    [w0, w0 + num_words) (known on the host: no sync here, so a chunk's packing queues behind the last one).

    Integer sums, so exact in any order: the high part of each code is added into the word it starts in (the
    codes of a word cover disjoint bits, so sum == OR), the low part of a code that spills into the next word
    into that word.
    """
    if codes.numel() == 0:
        return
    off = pos & 31
    end = off + lens  # <= 31 + 15
    hi = torch.where(end <= 32, codes << (32 - end).clamp(min=0), codes >> (end - 32).clamp(min=0))
    wl = (pos >> 5) - w0
    words = torch.zeros(num_words, dtype=torch.int64, device=codes.device)
    words.index_add_(0, wl, hi)
    lo = torch.where(end > 32, (codes << (64 - end).clamp(max=63)) & 0xFFFFFFFF, 0)
    words.index_add_(0, wl + 1, lo)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    n = min(num_words, stream.numel() - w0)
    stream[w0 : w0 + n] |= words[:n]


@torch.no_grad()
def encode(x: torch.Tensor, *, num_parts: int = 1, layout: LosslessLayout = LosslessLayout(),
           checksum: bool = True, chunk_blocks: int | None = None) -> CompressedTensor:
    """Compresses a bf16 tensor (CPU or CUDA; the result lives on the same device).

    num_parts: equal contiguous parts with their own checksum and independently decodable
    range (a stacked [E, ...] expert tensor: num_parts = E). chunk_blocks bounds the
    temporary memory of the packing pass (~80 bytes per element of a chunk).
    Beside x and the result, the device holds its exponents (1 byte per weight) and chunk temporaries
    (codecs/lossless_groups.py encodes a stacked tensor a group of parts at a time, in bounded memory).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"lossless encode takes bf16, got {x.dtype}")
    if num_parts < 1 or x.numel() % num_parts:
        raise ValueError(f"numel {x.numel()} is not a multiple of num_parts {num_parts}")
    bits = x.contiguous().view(torch.int16).reshape(-1)
    if bits.numel() <= SPLIT_ELEMS:
        exps, raw = split_bf16(bits)
    else:
        exps = torch.empty(bits.shape, dtype=torch.uint8, device=x.device)
        raw = torch.empty_like(exps)
        split_bf16_into(bits, exps, raw)
    book = Codebook.of_histogram(exponent_histogram(exps).cpu().numpy(), layout.max_code_len)
    arrays = pack_exponents(exps, num_parts, book, layout, chunk_blocks)
    del exps
    ct = CompressedTensor(tuple(x.shape), num_parts, layout, torch.from_numpy(book.lengths), book.fill, *arrays, raw)
    if checksum:
        ct.checksums = compute_checksums(ct)
    return ct


def pack_exponents(exps: torch.Tensor, num_parts: int, book: Codebook, layout: LosslessLayout,
                   chunk_blocks: int | None = None) -> tuple[torch.Tensor, ...]:
    """The coded arrays of the flat uint8 exponents `exps` (num_parts equal parts) under `book`: (stream,
    part_word_offsets, block_bit_offsets, lane_bits), on exps' device. Each part's words depend only on its
    own exponents and the codebook (a part starts on a word): encoding parts [p0, p1) alone gives
    the whole tensor's `parts(p0, p1)` arrays, bar the pad words."""
    dev = exps.device
    len_t = torch.tensor(np.append(book.lengths, 0), dtype=torch.int64, device=dev)  # [257], pad = 0
    code_t = torch.tensor(np.append(book.codes, 0), dtype=torch.int64, device=dev)
    P = exps.numel() // num_parts
    bpp = -(-P // layout.block_elems)
    nb = num_parts * bpp
    if chunk_blocks is None:
        chunk_blocks = max(1, (1 << 24) // layout.block_elems)
    # pass 1: bits per lane -> block and part offsets
    chunks = list(_block_chunks(num_parts, P, bpp, layout.block_elems, chunk_blocks))
    lane_bits = torch.empty(nb, layout.lanes, dtype=torch.int32, device=dev)
    for g0, g1 in chunks:
        lane_bits[g0:g1] = len_t[_stream_order(exps, g0, g1, P, bpp, layout)].sum(-1)
    block_bits = lane_bits.sum(1, dtype=torch.int64).view(num_parts, bpp)
    part_words = (block_bits.sum(1) + 31) // 32
    part_word_offsets = torch.zeros(num_parts + 1, dtype=torch.int64, device=dev)
    part_word_offsets[1:] = torch.cumsum(part_words, 0)
    block_bit_offsets = (part_word_offsets[:-1, None] * 32 + torch.cumsum(block_bits, 1) - block_bits).reshape(-1)
    # the one sync of the packing: the block offsets on the host name each chunk's words
    starts = block_bit_offsets.cpu().tolist() + [32 * int(part_word_offsets[-1])]
    stream = torch.zeros(starts[-1] // 32 + layout.pad_words, dtype=torch.int32, device=dev)
    # pass 2: codes -> words
    for g0, g1 in chunks:
        sym = _stream_order(exps, g0, g1, P, bpp, layout).reshape(g1 - g0, -1)
        lens = len_t[sym]
        cum = torch.cumsum(lens, 1) - lens  # exclusive, within each block
        pos = (block_bit_offsets[g0:g1, None] + cum).reshape(-1)
        w0 = starts[g0] >> 5
        _pack_words(code_t[sym].reshape(-1), lens.reshape(-1), pos, stream, w0, (starts[g1] >> 5) - w0 + 2)
    return stream, part_word_offsets, block_bit_offsets, lane_bits.to(layout.lane_bits_dtype)


# ---------------------------------------------------------------------------------------------
# checksums


_STAGE_BYTES = 128 << 20  # pinned staging for device->host copies (pageable ones ran at 1.5 GB/s on the H200 host)


@functools.lru_cache(maxsize=1)
def _pinned_stages() -> tuple[torch.Tensor, torch.Tensor]:
    """Two pinned host buffers, made on first use and kept: copies into one overlap the crc of the other."""
    return tuple(torch.empty(_STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2))


def _part_spans(ct: CompressedTensor, pwo) -> list[tuple[str, list[tuple[int, int]]]]:
    """Per stored array, in checksum order, the byte range [start, end) of each part."""
    bpp, P, parts = ct.blocks_per_part, ct.part_size, range(ct.num_parts)
    row = ct.layout.lanes * ct.lane_bits.element_size()
    return [("block_bit_offsets", [(p * bpp * 8, (p + 1) * bpp * 8) for p in parts]),
            ("lane_bits", [(p * bpp * row, (p + 1) * bpp * row) for p in parts]),
            ("stream", [(int(pwo[p]) * 4, int(pwo[p + 1]) * 4) for p in parts]),
            ("raw", [(p * P, (p + 1) * P) for p in parts])]


def _byte_chunks(t: torch.Tensor):
    """(offset, numpy uint8 view) of t's bytes in order, _STAGE_BYTES at a time: views of t on the CPU;
    on CUDA copies through pinned buffers, the next chunk's copy running while the caller reads this one."""
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    starts = list(range(0, n, _STAGE_BYTES))
    if flat.device.type != "cuda":
        host = flat.numpy()
        for a in starts:
            yield a, host[a:a + _STAGE_BYTES]
        return
    stages = _pinned_stages()

    def start_copy(i):
        a = starts[i]
        buf = stages[i % 2][:min(n, a + _STAGE_BYTES) - a]
        buf.copy_(flat[a:a + buf.numel()], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return buf, ev

    pending = start_copy(0) if starts else None
    for i, a in enumerate(starts):
        buf, ev = pending
        ev.synchronize()
        if i + 1 < len(starts):
            pending = start_copy(i + 1)   # the other buffer: its last reader finished with the previous chunk
        yield a, buf.numpy()


def crc32_parts(head: np.ndarray, num_parts: int, spans, max_workers: int = 16) -> tuple[int, ...]:
    """crc32 per part: of head, then of each (tensor, [(start, end) bytes of part p]) of spans in order.
    Parts run in parallel threads (zlib releases the GIL); tensors on a GPU are read through pinned
    staging buffers, a chunk at a time."""
    crcs = [zlib.crc32(head)] * num_parts

    def update(p: int, buf: np.ndarray) -> None:
        crcs[p] = zlib.crc32(buf, crcs[p])

    with ThreadPoolExecutor(min(max_workers, max(1, num_parts))) as pool:
        for tensor, ranges in spans:
            for off, chunk in _byte_chunks(tensor):
                end = off + chunk.size
                jobs = [pool.submit(update, p, chunk[max(s, off) - off:min(e, end) - off])
                        for p, (s, e) in enumerate(ranges) if s < end and e > off]
                for j in jobs:
                    j.result()    # one chunk at a time: the staging buffer is reused two chunks later
    return tuple(crcs)


def compute_checksums(ct: CompressedTensor, max_workers: int = 16) -> tuple[int, ...]:
    """crc32 per part over its stored bytes (codebook, offsets, lane lengths, codes, raw bytes)."""
    head = np.concatenate([ct.code_lengths.numpy(), np.array([ct.fill_exponent], np.uint8)])
    spans = [(getattr(ct, name), ranges) for name, ranges in _part_spans(ct, ct.part_word_offsets.cpu().numpy())]
    return crc32_parts(head, ct.num_parts, spans, max_workers)


def verify(ct, name: str = "tensor", compute=compute_checksums) -> None:
    """Raises CorruptCheckpointError naming the tensor and part (expert) whose bytes changed.
    compute: the checksum function of ct's format version."""
    if len(ct.checksums) != ct.num_parts:
        raise CorruptCheckpointError(f"{name}: {len(ct.checksums)} checksums for {ct.num_parts} parts")
    for p, (want, got) in enumerate(zip(ct.checksums, compute(ct))):
        if want != got:
            raise CorruptCheckpointError(
                f"{name}: part {p} (expert {p} of a stacked tensor) fails its crc32 "
                f"(stored {want:#010x}, computed {got:#010x}); the file is corrupted")


# ---------------------------------------------------------------------------------------------
# reference decoder (CPU or any device; vectorised over lanes, one Python step per element of a lane)


@torch.no_grad()
def decode_reference(ct: CompressedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bit-exact decode with torch ops; mirrors the Triton kernel's lane walk."""
    lay, dev = ct.layout, ct.device
    if out is None:
        out = torch.empty(ct.shape, dtype=torch.bfloat16, device=dev)
    if out.dtype != torch.bfloat16 or out.numel() != ct.numel or not out.is_contiguous():
        raise ValueError("out must be a contiguous bf16 tensor with the tensor's numel")
    if ct.numel == 0:
        return out
    L, K, B, ML = lay.lanes, lay.elems_per_lane, lay.block_elems, lay.max_code_len
    table = ct.decode_table(ML).to(torch.int64)
    words = ct.stream.to(torch.int64) & 0xFFFFFFFF
    nb, bpp, P = ct.num_blocks, ct.blocks_per_part, ct.part_size
    lane_bits = ct.lane_bits.to(torch.int64)
    start = ct.block_bit_offsets[:, None] + torch.cumsum(lane_bits, 1) - lane_bits  # [nb, L]
    g = torch.arange(nb, device=dev)
    elem0 = (g // bpp) * P + (g % bpp) * B  # first element of each block
    n_valid = torch.clamp(P - (g % bpp) * B, max=B)
    lane = torch.arange(L, device=dev)
    exps = torch.empty(ct.numel, dtype=torch.int64, device=dev)
    pos = start
    last_word = words.numel() - 2
    for k in range(K):
        w = (pos >> 5).clamp(max=last_word)
        window = (((words[w] << 32) | words[w + 1]) << (pos & 31)) >> 32 & 0xFFFFFFFF
        e = table[window >> (32 - ML)]
        pos = pos + (e & huffman.LEN_MASK)
        idx = k * L + lane
        valid = idx[None, :] < n_valid[:, None]
        exps[(elem0[:, None] + idx[None, :])[valid]] = (e >> huffman.EXP_SHIFT)[valid]
    sm = ct.raw.view(torch.int8).to(torch.int64)
    bits = (sm & 0x807F) | (exps << huffman.EXP_SHIFT)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    out.view(torch.int16).view(-1).copy_(bits.to(torch.int16))
    return out
