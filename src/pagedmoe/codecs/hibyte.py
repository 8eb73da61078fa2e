"""Lossless bf16, candidate version 3 ("hibyte"): the low byte verbatim, the high byte in 4 bits, raw tiles.

Why (issue 23, docs/benchmarks.md "The fused lossless GEMM on the H200"): version 2 costs a GEMM ~17 integer
instructions per weight to decode (nibble interleave, exponent add, sign and mantissa assembly, escape patches),
over the issue rate an SM has at HBM speed (~0.375 warp instructions per weight at the compressed floor). This
layout is chosen for the fewest instructions:

  lo[r, c]     the bf16's low byte verbatim (exponent bit 0 and the 7 mantissa bits): no arithmetic at all
  code[r, j]   4 bits per weight for the high byte (sign and exponent bits 7..1): bit 3 the sign, bits 0..2
               (e >> 1) - base[r]; byte j of each 64-column slice holds column j (low nibble) and column
               j + 32 (high nibble), so a GEMM splits a loaded byte into its two K halves with one AND and one
               shift, with no interleave (it multiplies the halves as two K = 32 steps, in K order)
  base[r]      the row's window of the high byte's exponent bits: (e >> 1) in [base, base + 7] (16 exponents)
  raw tiles    a tile of 16 rows x 64 columns with any weight outside its row's window keeps its high bytes
               whole: code holds their low nibbles and high[tile_raw[t]] (same packing) their high nibbles
               (tile_raw[t] = -1 for a coded tile), so a GEMM never patches single weights: it selects whole
               rows of a weight tile between the two ways of making the high byte

Decoding a weight: in a coded tile hi = code + base + 120 * (code >> 3) (the sign bit moves from bit 3 to bit
7), in a raw tile hi = code | high << 4; then bits = hi << 8 | lo. On N(0, 0.02) bf16 about 7.5% of 16 x 64
tiles are raw (a 16-exponent window leaves 28% of 4096-long rows with an outlier): 0.77 of bf16's bytes,
against 0.752 for version 2 and 0.683 for version 1.
This module is the reference (encode, decode, sizes); codecs/lossless_io.py writes it to files (version 3) and
kernels/fused_moe_hibyte.py multiplies it in the MoE GEMM.

Byte order held (`order`): "rows" as above (the files' order), or "tile_major" (to_tile_major: the order the
engine's fused-hibyte tier holds, one copy): per 16-row tile and 64-column slice its 16 rows of 64 low bytes then
32 code bytes, 1536 contiguous bytes, so a GEMM's K step reads whole 128-byte lines (with the decode in the MMA
operand registers, 0.87-0.96x of bf16's MoE layer time on the H200 at Mixtral 1-16 and Qwen3 16-64 tokens; the
exact kernels >= 1.29x: docs/benchmarks.md, issue 23). Then `lo` holds those bytes [R / 16, C / 64, 16, 96] and
`code` is empty; base, tile_raw, high and the checksums (always of the row order's bytes, as a file holds them)
are the same.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pagedmoe.codecs.lossless import CorruptCheckpointError, crc32_parts

FORMAT_VERSION = 3
ARRAYS = ("base", "lo", "code", "tile_raw", "high")
TILE_ROWS = 16
TILE_COLS = 64
HALF = TILE_COLS // 2
WINDOW = 8          # values of e >> 1 a row codes in place (16 exponents)
MAX_BASE = 127 - (WINDOW - 1)
TM_ROW_BYTES = TILE_COLS + HALF   # tile_major order: a tile row's 64 low bytes then its 32 code bytes
ORDERS = ("rows", "tile_major")


@dataclass
class HiByteTensor:
    shape: tuple[int, ...]
    num_parts: int
    base: torch.Tensor       # uint8 [R]
    lo: torch.Tensor         # uint8 [R, C]
    code: torch.Tensor       # uint8 [R, C / 2]
    tile_raw: torch.Tensor   # int32 [num_tiles]: index into high, or -1
    high: torch.Tensor       # uint8 [num_raw, TILE_ROWS, HALF]: the raw tiles' high-byte high nibbles
    checksums: tuple[int, ...] = ()  # crc32 per part of the row order's bytes, whatever the order held
    order: str = "rows"      # "tile_major": lo [R / 16, C / 64, 16, 96] holds lo and code tile by tile, code is empty

    version = FORMAT_VERSION

    def to(self, device) -> "HiByteTensor":
        arrays = (getattr(self, a).to(device, non_blocking=True) for a in ARRAYS)
        return HiByteTensor(self.shape, self.num_parts, *arrays, checksums=self.checksums, order=self.order)

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(R, C) of the weights as the format tiles them (from the shape: lo's shape depends on the order)."""
        C = self.shape[-1] if self.shape else 1
        return int(np.prod(self.shape)) // max(1, C), C

    @property
    def part_rows(self) -> int:
        return self.rows_cols[0] // self.num_parts

    @property
    def tiles_per_part(self) -> int:
        return (self.part_rows // TILE_ROWS) * (self.rows_cols[1] // TILE_COLS)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.base, self.lo, self.code, self.tile_raw, self.high))

    @property
    def ratio(self) -> float:
        """Stored bytes / bf16 bytes (the same in either order)."""
        return self.nbytes / (2 * max(1, int(np.prod(self.shape))))

    @property
    def raw_tile_share(self) -> float:
        return self.high.shape[0] / max(1, self.tile_raw.numel())


def _geometry(x: torch.Tensor, num_parts: int) -> tuple[int, int, int]:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the hibyte format stores bfloat16 tensors, got {x.dtype}")
    return _dims(tuple(x.shape), num_parts)


def _dims(shape: tuple, num_parts: int) -> tuple[int, int, int]:
    """(rows, columns, rows per part) of a tensor of this shape in the format, or ValueError."""
    C = shape[-1] if shape else 1
    R = int(np.prod(shape)) // max(1, C)
    if C % TILE_COLS:
        raise ValueError(f"the hibyte format needs a multiple of {TILE_COLS} columns, got {C}")
    if num_parts < 1 or R % num_parts or (R // num_parts) % TILE_ROWS:
        raise ValueError(f"{R} rows do not split into {num_parts} parts of a multiple of {TILE_ROWS} rows")
    return R, C, R // num_parts


def choose_base(hi7: torch.Tensor) -> torch.Tensor:
    """Per row [R, C] of e >> 1 values (0..127): the lowest b whose window [b, b + WINDOW) holds the most."""
    R = hi7.shape[0]
    counts = torch.zeros(R, 128 + WINDOW, dtype=torch.int32, device=hi7.device)
    counts.scatter_add_(1, hi7.long(), torch.ones_like(hi7, dtype=torch.int32))
    csum = torch.cat([torch.zeros(R, 1, dtype=torch.int32, device=hi7.device), counts.cumsum(1, dtype=torch.int32)], 1)
    cover = csum[:, WINDOW:WINDOW + MAX_BASE + 1] - csum[:, :MAX_BASE + 1]
    return cover.argmax(1).to(torch.uint8)  # argmax: the first maximum, the lowest base on ties


# Weights encoded at once: the encode's temporaries take ~40 bytes a weight (int32 planes, choose_base's int64
# indices), so a whole MoE layer at once took ~15 GiB more than the tier it built on the GPU (Qwen3-30B-A3B's 125
# compressed experts of a layer: the start-up peak of session35, 101.4% of the budget). Whole parts at a time, so
# the bytes are the same.
ENCODE_CHUNK_WEIGHTS = 1 << 25


def encode(x: torch.Tensor, *, num_parts: int = 1, checksum: bool = True, order: str = "rows",
           chunk_weights: int = ENCODE_CHUNK_WEIGHTS) -> HiByteTensor:
    """x (bf16, rows a multiple of num_parts x 16, columns of 64) in the format, held in `order`. Encoded whole
    parts at a time, at most `chunk_weights` weights (one part when a part is larger): the same bytes as at once,
    with the temporaries of a chunk."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    R, C, Rp = _geometry(x, num_parts)
    per = max(1, chunk_weights // (Rp * C))
    flat = x.detach().reshape(R, C)
    chunks = []
    for p in range(0, num_parts, per):
        k = min(per, num_parts - p)
        h = _encode_rows(flat[p * Rp:(p + k) * Rp], k)
        chunks.append(to_tile_major(h) if order == "tile_major" else h)   # (the chunk's row arrays freed here)
    h = concat_parts(chunks, tuple(x.shape))
    if checksum:
        h.checksums = compute_checksums(h)
    return h


def concat_parts(hs: list[HiByteTensor], shape: tuple) -> HiByteTensor:
    """The tensor of `shape` whose parts are those of `hs` in turn (one order, the same columns): rows and tiles
    are ordered part by part, so the arrays join end to end, raw-tile indices shifted by the raw tiles before."""
    if len(hs) == 1:
        return dataclasses.replace(hs[0], shape=shape)
    if len({h.order for h in hs}) != 1:
        raise ValueError("concat_parts joins tensors held in one order")
    raw, shifted = 0, []
    for h in hs:
        shifted.append(torch.where(h.tile_raw >= 0, h.tile_raw + raw, h.tile_raw))
        raw += h.high.shape[0]
    cat = {a: torch.cat([getattr(h, a) for h in hs]) for a in ("base", "lo", "code", "high")}
    return HiByteTensor(shape, sum(h.num_parts for h in hs), cat["base"], cat["lo"], cat["code"], torch.cat(shifted),
                        cat["high"], checksums=sum((h.checksums for h in hs), ()), order=hs[0].order)


def _encode_rows(x: torch.Tensor, num_parts: int) -> HiByteTensor:
    """[R, C] bf16 rows of `num_parts` parts, at once, in the row order, without checksums."""
    R, C, Rp = _geometry(x, num_parts)
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    lo = (bits & 0xFF).to(torch.uint8)
    sign, hi7 = bits >> 15, (bits >> 8) & 0x7F
    base = choose_base(hi7)
    off = hi7 - base.to(torch.int32)[:, None]
    fits = (off >= 0) & (off < WINDOW)
    tiles = (~fits).view(num_parts, Rp // TILE_ROWS, TILE_ROWS, C // TILE_COLS, TILE_COLS).any(4).any(2)
    tiles = tiles.transpose(1, 2).reshape(-1)  # tile order: part, tile column, tile row (as version 2)
    tile_raw = torch.full((tiles.numel(),), -1, dtype=torch.int32, device=x.device)
    idx = tiles.nonzero().flatten()
    tile_raw[idx] = torch.arange(idx.numel(), dtype=torch.int32, device=x.device)
    hi = bits >> 8
    raw_rows = _tile_rows_mask(tiles, num_parts, Rp, C)  # [R, C] True inside raw tiles
    code = torch.where(raw_rows, hi & 0xF, torch.where(fits, (sign << 3) | off.clamp(0, WINDOW - 1), 0))
    high = _tile_view(_pack(hi >> 4), num_parts, Rp)[idx].clone()
    return HiByteTensor(tuple(x.shape), num_parts, base, lo, _pack(code), tile_raw, high)


def _raw_ranges(h: HiByteTensor) -> list[tuple[int, int]]:
    """Each part's raw tiles: one contiguous range of high (indices are given in tile order, parts in turn)."""
    tpp = h.tiles_per_part
    counts = (h.tile_raw.view(h.num_parts, tpp) >= 0).sum(1).cpu().tolist() if tpp else [0] * h.num_parts
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(int(starts[p]), int(starts[p + 1])) for p in range(h.num_parts)]


def compute_checksums(h: HiByteTensor) -> tuple[int, ...]:
    """crc32 per part over its base bytes, lo rows, code rows, tile_raw entries (int32 LE) and raw tiles' high
    nibbles (docs/formats.md, version 3), in the row order whatever order h holds (so they name the content)."""
    h = to_rows(h)
    P, Rp, C, tpp = h.num_parts, h.part_rows, h.lo.shape[1], h.tiles_per_part
    parts = range(P)
    raw = _raw_ranges(h)
    spans = [(h.base, [(p * Rp, (p + 1) * Rp) for p in parts]),
             (h.lo, [(p * Rp * C, (p + 1) * Rp * C) for p in parts]),
             (h.code, [(p * Rp * C // 2, (p + 1) * Rp * C // 2) for p in parts]),
             (h.tile_raw, [(p * tpp * 4, (p + 1) * tpp * 4) for p in parts]),
             (h.high, [(s * TILE_ROWS * HALF, e * TILE_ROWS * HALF) for s, e in raw])]
    return crc32_parts(np.zeros(0, np.uint8), P, spans)


def check_arrays(h: HiByteTensor, name: str = "tensor") -> None:
    """Refuses arrays of the wrong dtype or shape, bases past MAX_BASE and raw-tile indices that are not 0, 1, 2..
    in tile order (corrupt metadata; the checksums cover the bytes)."""
    try:
        R, C, _ = _dims(tuple(h.shape), h.num_parts)
    except ValueError as e:
        raise CorruptCheckpointError(f"{name}: {e}") from None
    tiles = (R // TILE_ROWS) * (C // TILE_COLS)
    if h.order not in ORDERS:
        raise CorruptCheckpointError(f"{name}: byte order {h.order!r}, expected one of {', '.join(ORDERS)}")
    lo, code = ((R, C), (R, C // 2)) if h.order == "rows" else \
        ((R // TILE_ROWS, C // TILE_COLS, TILE_ROWS, TM_ROW_BYTES), (0,))
    want = {"base": (torch.uint8, (R,)), "lo": (torch.uint8, lo), "code": (torch.uint8, code),
            "tile_raw": (torch.int32, (tiles,))}
    for a, (dtype, shape) in want.items():
        t = getattr(h, a)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise CorruptCheckpointError(f"{name}.{a}: stored {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    raw = h.tile_raw[h.tile_raw >= 0].to(torch.int64)
    if h.high.dtype != torch.uint8 or tuple(h.high.shape) != (raw.numel(), TILE_ROWS, HALF) \
            or bool((h.tile_raw < -1).any()) or not torch.equal(raw.cpu(), torch.arange(raw.numel())):
        raise CorruptCheckpointError(f"{name}: the raw-tile indices do not number the raw tiles in order")
    if R and int(h.base.max()) > MAX_BASE:
        raise CorruptCheckpointError(f"{name}: a base above {MAX_BASE}")


def verify(h: HiByteTensor, name: str = "tensor") -> None:
    """Raises CorruptCheckpointError naming the tensor and part (expert) whose bytes changed."""
    from pagedmoe.codecs.lossless import verify as verify_parts

    verify_parts(h, name, compute_checksums)


def _pack(nib: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C / 2] bytes: byte j of each 64-column slice = column j | column j + 32 << 4."""
    R, C = nib.shape
    c = nib.view(R, C // TILE_COLS, 2, HALF)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(R, C // 2).to(torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    R, C2 = packed.shape
    p = packed.view(R, C2 // HALF, HALF).to(torch.int32)
    return torch.stack([p & 0xF, p >> 4], 2).reshape(R, 2 * C2)


def _tile_rows_mask(tiles: torch.Tensor, num_parts: int, Rp: int, C: int) -> torch.Tensor:
    t = tiles.view(num_parts, C // TILE_COLS, Rp // TILE_ROWS).transpose(1, 2)  # part, tile row, tile column
    m = t[:, :, None, :, None].expand(num_parts, Rp // TILE_ROWS, TILE_ROWS, C // TILE_COLS, TILE_COLS)
    return m.reshape(num_parts * Rp, C)


def _tile_view(a: torch.Tensor, num_parts: int, Rp: int) -> torch.Tensor:
    """[R, 32 * n] packed nibbles as [num_tiles, 16, 32] in flat tile order (part, tile column, tile row)."""
    v = a.view(num_parts, Rp // TILE_ROWS, TILE_ROWS, a.shape[1] // HALF, HALF).permute(0, 3, 1, 2, 4)
    return v.reshape(-1, TILE_ROWS, HALF)



def to_tile_major(h: HiByteTensor) -> HiByteTensor:
    """h in the tile_major order (the module docstring): lo and code rearranged tile by tile into one array, the
    other arrays shared. A new array of lo + code's size; h's own are left as they are (drop h to free them)."""
    if h.order == "tile_major":
        return h
    R, C = h.rows_cols
    lo = h.lo.view(R // TILE_ROWS, TILE_ROWS, C // TILE_COLS, TILE_COLS).permute(0, 2, 1, 3)
    code = h.code.view(R // TILE_ROWS, TILE_ROWS, C // TILE_COLS, HALF).permute(0, 2, 1, 3)
    return dataclasses.replace(h, lo=torch.cat([lo, code], dim=-1).contiguous(), code=h.code.new_empty(0),
                               order="tile_major")


def to_rows(h: HiByteTensor) -> HiByteTensor:
    """h in the row order (the files'): the inverse of to_tile_major."""
    if h.order == "rows":
        return h
    R, C = h.rows_cols
    t = h.lo.permute(0, 2, 1, 3)  # [R / 16, 16, C / 64, 96]
    return dataclasses.replace(h, lo=t[..., :TILE_COLS].reshape(R, C), code=t[..., TILE_COLS:].reshape(R, C // 2),
                               order="rows")


def decode_reference(h: HiByteTensor) -> torch.Tensor:
    """The bf16 tensor, bit for bit (vectorised PyTorch; the GEMM does the same per weight tile), in either order."""
    h = to_rows(h)
    R = h.lo.shape[0]
    Rp = R // h.num_parts
    code = _unpack(h.code)
    hi = code + h.base.to(torch.int32)[:, None] + 120 * (code >> 3)
    if h.high.shape[0]:
        P, C2 = h.num_parts, h.code.shape[1]
        tiles = torch.zeros(h.tile_raw.numel(), TILE_ROWS, HALF, dtype=torch.uint8, device=h.code.device)
        tiles[h.tile_raw >= 0] = h.high
        high = tiles.view(P, C2 // HALF, Rp // TILE_ROWS, TILE_ROWS, HALF).permute(0, 2, 3, 1, 4).reshape(R, C2)
        raw_rows = _tile_rows_mask(h.tile_raw >= 0, h.num_parts, Rp, h.lo.shape[1])
        hi = torch.where(raw_rows, code | (_unpack(high) << 4), hi)
    bits = (hi << 8) | h.lo.to(torch.int32)
    return bits.to(torch.int16).view(torch.bfloat16).reshape(h.shape)
