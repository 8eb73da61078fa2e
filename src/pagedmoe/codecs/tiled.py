"""Lossless bf16, version 2 ("tiled"): fixed-width exponent offsets a GEMM can decode per weight tile.

Version 1 (``lossless.py``) Huffman-codes the exponents: the smallest format (0.683 of bf16 on N(0, 0.02)),
but a lane's codes must be walked serially, so a GEMM cannot start at an arbitrary [BLOCK_N, BLOCK_K]
tile of the weight. Version 2 gives up ~10% of ratio for random access and branch-free decode:

  raw[r, c]      sign << 7 | mantissa, one byte per weight (as in version 1)
  base[r]        the row's base exponent (the 15 consecutive exponents [base, base + 14] that cover
                 most of the row)
  nibbles[r, j]  4-bit codes of columns 2j (low nibble) and 2j + 1 (high): exponent - base in 0..14,
                 or 15 = escape
  escapes        the escaped elements' exact exponents, grouped by tile of TILE_ROWS x TILE_COLS,
                 with escape_offsets[t] the first escape of tile t (any tile's escapes are addressable)

So every weight of a tile is decoded by arithmetic from bytes at fixed addresses (row stride C for raw,
ceil(C / 2) for nibbles), as an int4 weight would be, and the few escapes (|w| < ~2^-14 of the row's
scale: ~1e-4 of N(0, s) weights) are patched in by a short list. docs/formats.md is the precise spec.

A tensor is 2-D for the format: C = shape[-1] columns, R = numel / C rows, split into num_parts equal
groups of rows (a stacked [E, N, K] expert tensor: one part per expert, each with its own crc32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedmoe.codecs.lossless import CorruptCheckpointError, crc32_parts

FORMAT_VERSION = 2
TILE_ROWS = 16     # escape tiles: rows x columns; every fused-MoE BLOCK_N is a multiple of 16 rows
TILE_COLS = 64
WINDOW = 15        # exponents base .. base + 14 coded in place; nibble 15 = escape
ESCAPE = 15
MAX_BASE = 255 - (WINDOW - 1)
ROW_BITS = 17      # an escape entry: (row in part mod 2**17) << 14 | column in tile << 8 | exponent
ROW_MASK = (1 << ROW_BITS) - 1
ARRAYS = ("base", "nibbles", "escape_offsets", "escapes", "raw")
_CHUNK_ELEMS = 1 << 22  # rows encoded together on a CPU: bounds the temporaries (~40 bytes per element)
_CUDA_CHUNK_ELEMS = 1 << 26  # on a GPU: fewer, larger steps (each nonzero() syncs with the host)


@dataclass
class TiledTensor:
    """One bf16 tensor in the tiled lossless format (version 2). All tensors live on the same device."""

    shape: tuple[int, ...]
    num_parts: int
    base: torch.Tensor            # uint8 [R]
    nibbles: torch.Tensor         # uint8 [R, ceil(C / 2)]
    escape_offsets: torch.Tensor  # int32 [num_tiles + 1]
    escapes: torch.Tensor         # int32 [num_escapes]
    raw: torch.Tensor             # uint8 [numel]
    checksums: tuple[int, ...] = ()
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    version = FORMAT_VERSION

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return self.numel // self.cols if self.cols else 0

    @property
    def part_rows(self) -> int:
        return self.rows // self.num_parts

    @property
    def tile_rows_per_part(self) -> int:
        return -(-self.part_rows // TILE_ROWS)

    @property
    def tile_cols(self) -> int:
        return -(-self.cols // TILE_COLS)

    @property
    def tiles_per_part(self) -> int:
        return self.tile_rows_per_part * self.tile_cols

    @property
    def num_tiles(self) -> int:
        return self.num_parts * self.tiles_per_part

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, a).numel() * getattr(self, a).element_size() for a in ARRAYS)

    @property
    def ratio(self) -> float:
        return self.nbytes / max(1, 2 * self.numel)

    def to(self, device) -> "TiledTensor":
        return TiledTensor(self.shape, self.num_parts, *(getattr(self, a).to(device, non_blocking=True) for a in ARRAYS),
                           checksums=self.checksums)


def tile_index(part, row_in_part, col, part_rows: int, cols: int):
    """Tile of an element: tiles are column-major inside a part (tile column outer, tile row inner), so the
    tiles a GEMM's [BLOCK_N, BLOCK_K] weight tile covers in one tile column are consecutive."""
    trp = -(-part_rows // TILE_ROWS)
    return part * (trp * -(-cols // TILE_COLS)) + (col // TILE_COLS) * trp + row_in_part // TILE_ROWS


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [n] -> (exponent, sign << 7 | mantissa), uint8 [n] each, from the two little-endian bytes of
    each value (byte ops: ~4x faster on a CPU than int16 shifts)."""
    b = x.view(torch.uint8).view(-1, 2)
    lo, hi = b[:, 0], b[:, 1]
    return ((hi & 0x7F) << 1) | (lo >> 7), (hi & 0x80) | (lo & 0x7F)


def _geometry(x: torch.Tensor, num_parts: int) -> tuple[int, int]:
    C = x.shape[-1] if x.dim() else 1
    R = x.numel() // C if C else 0
    if num_parts < 1 or R % num_parts:
        raise ValueError(f"{R} rows (shape {tuple(x.shape)}) are not a multiple of num_parts {num_parts}")
    return R, C


@torch.no_grad()
def choose_base(exps: torch.Tensor) -> torch.Tensor:
    """Per row of uint8 exponents [n, C]: the base whose window [base, base + 14] holds the most of them
    (the lowest such base on ties). int64 [n]."""
    n = exps.shape[0]
    rows = torch.arange(n, device=exps.device, dtype=torch.int32)[:, None] * 256
    hist = torch.bincount((rows + exps).reshape(-1), minlength=n * 256).view(n, 256)
    cs = torch.zeros(n, 257, dtype=torch.int64, device=exps.device)
    cs[:, 1:] = torch.cumsum(hist, 1)
    window = cs[:, WINDOW:WINDOW + MAX_BASE + 1] - cs[:, :MAX_BASE + 1]  # [n, 242]
    return torch.argmax(window, 1)  # first maximum


@torch.no_grad()
def encode(x: torch.Tensor, *, num_parts: int = 1, checksum: bool = True) -> TiledTensor:
    """Compresses a bf16 tensor (CPU or CUDA; the result lives on the same device). Vectorised over rows,
    a chunk of ~4M elements at a time."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"lossless encode takes bf16, got {x.dtype}")
    R, C = _geometry(x, num_parts)
    dev = x.device
    exps, raw = _split(x.contiguous().reshape(-1))
    exps = exps.view(R, C)
    Rp = R // num_parts
    half = -(-C // 2)
    base = torch.empty(R, dtype=torch.uint8, device=dev)
    nibbles = torch.zeros(R, half, dtype=torch.uint8, device=dev)
    tiles, entries = [], []
    chunk = _CUDA_CHUNK_ELEMS if dev.type == "cuda" else _CHUNK_ELEMS
    step = max(TILE_ROWS, chunk // max(C, 1) // TILE_ROWS * TILE_ROWS)
    for p in range(num_parts):
        for r0 in range(0, Rp, step):
            g0, g1 = p * Rp + r0, p * Rp + min(Rp, r0 + step)
            e = exps[g0:g1]
            b = choose_base(e).to(torch.uint8)
            base[g0:g1] = b
            off = e - b[:, None]  # uint8 wraps: exponents below base land above 14
            esc = off >= WINDOW
            code = off.masked_fill_(esc, ESCAPE)
            if C % 2:
                code = torch.nn.functional.pad(code, (0, 1))
            nibbles[g0:g1] = code[:, 0::2] | (code[:, 1::2] << 4)
            ri, ci = torch.nonzero(esc, as_tuple=True)
            rr = ri + r0
            tiles.append(tile_index(p, rr, ci, Rp, C))
            entries.append(((rr & ROW_MASK) << 14) | ((ci % TILE_COLS) << 8) | e[ri, ci].to(torch.int64))
    tr = -(-Rp // TILE_ROWS)
    num_tiles = num_parts * tr * (-(-C // TILE_COLS))
    tile = torch.cat(tiles) if tiles else torch.zeros(0, dtype=torch.int64, device=dev)
    entry = torch.cat(entries) if entries else torch.zeros(0, dtype=torch.int64, device=dev)
    order = torch.argsort(tile, stable=True)
    offsets = torch.zeros(num_tiles + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(torch.bincount(tile, minlength=num_tiles), 0)
    if int(offsets[-1]) >= 2 ** 31:
        raise ValueError("more than 2**31 escapes: this tensor is not suited to the tiled format")
    tt = TiledTensor(tuple(x.shape), num_parts, base, nibbles, offsets.to(torch.int32),
                     entry[order].to(torch.int32), raw)
    if checksum:
        tt.checksums = compute_checksums(tt)
    return tt


# ---------------------------------------------------------------------------------------------
# checksums and checks


def compute_checksums(tt: TiledTensor) -> tuple[int, ...]:
    """crc32 per part over its base bytes, nibble rows, tile offsets (its tiles' entries and the next part's
    first), escapes and raw bytes (docs/formats.md, version 2)."""
    P, Rp, C, tpp = tt.num_parts, tt.part_rows, tt.cols, tt.tiles_per_part
    off = tt.escape_offsets.cpu().numpy().astype(np.int64)
    half = tt.nibbles.shape[1] if tt.nibbles.dim() == 2 else 0
    parts = range(P)
    spans = [(tt.base, [(p * Rp, (p + 1) * Rp) for p in parts]),
             (tt.nibbles, [(p * Rp * half, (p + 1) * Rp * half) for p in parts]),
             (tt.escape_offsets, [(p * tpp * 4, ((p + 1) * tpp + 1) * 4) for p in parts]),
             (tt.escapes, [(int(off[p * tpp]) * 4, int(off[(p + 1) * tpp]) * 4) for p in parts]),
             (tt.raw, [(p * Rp * C, (p + 1) * Rp * C) for p in parts])]
    return crc32_parts(np.zeros(0, np.uint8), P, spans)


def check_arrays(tt: TiledTensor, name: str = "tensor") -> None:
    """Refuses arrays of the wrong dtype or shape, offsets that are not increasing, and escapes or bases that
    would send a decoder outside the tensor (corrupt metadata; the checksums cover the bytes)."""
    R, C = tt.rows, tt.cols
    want = {"base": (torch.uint8, (R,)), "nibbles": (torch.uint8, (R, -(-C // 2))),
            "escape_offsets": (torch.int32, (tt.num_tiles + 1,)), "raw": (torch.uint8, (tt.numel,))}
    for a, (dtype, shape) in want.items():
        t = getattr(tt, a)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise CorruptCheckpointError(f"{name}.{a}: stored {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    off = tt.escape_offsets.to(torch.int64)
    if tt.escapes.dtype != torch.int32 or tt.escapes.dim() != 1 or int(off[0]) != 0 \
            or bool((off[1:] < off[:-1]).any()) or int(off[-1]) != tt.escapes.numel():
        raise CorruptCheckpointError(f"{name}: escape offsets do not index the escapes")
    if tt.numel and int(tt.base.max()) > MAX_BASE:
        raise CorruptCheckpointError(f"{name}: a base exponent above {MAX_BASE}")
    row, col, _ = _escape_positions(tt)
    if tt.escapes.numel() and (bool((row >= tt.part_rows).any()) or bool((col >= C).any())):
        raise CorruptCheckpointError(f"{name}: an escape lies outside its tile")


def verify(tt: TiledTensor, name: str = "tensor") -> None:
    """Raises CorruptCheckpointError naming the tensor and part (expert) whose bytes changed."""
    from pagedmoe.codecs.lossless import verify as verify_parts

    verify_parts(tt, name, compute_checksums)


# ---------------------------------------------------------------------------------------------
# reference decoder


def _escape_positions(tt: TiledTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row in part, column, global row) of every escape, from its tile and entry."""
    e = tt.escapes.to(torch.int64)
    counts = torch.diff(tt.escape_offsets.to(torch.int64))
    tile = torch.repeat_interleave(torch.arange(tt.num_tiles, device=e.device), counts)
    part, t = tile // max(tt.tiles_per_part, 1), tile % max(tt.tiles_per_part, 1)
    trp = max(tt.tile_rows_per_part, 1)
    tc, tr = t // trp, t % trp
    row = tr * TILE_ROWS + (((e >> 14) - tr * TILE_ROWS) & ROW_MASK)  # the one row of tile tr with those low bits
    col = tc * TILE_COLS + ((e >> 8) & (TILE_COLS - 1))
    return row, col, part * tt.part_rows + row


@torch.no_grad()
def decode_exponents(tt: TiledTensor) -> torch.Tensor:
    """int64 [R, C]: base + nibble, escapes patched in."""
    R, C = tt.rows, tt.cols
    nib = tt.nibbles.to(torch.int64)
    codes = torch.stack((nib & 15, nib >> 4), -1).reshape(R, -1)[:, :C]
    exps = tt.base.to(torch.int64)[:, None] + codes
    if tt.escapes.numel():
        _, col, grow = _escape_positions(tt)
        exps[grow, col] = tt.escapes.to(torch.int64) & 0xFF
    return exps


@torch.no_grad()
def decode_reference(tt: TiledTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bit-exact decode with torch ops on tt's device (vectorised; also the CPU/GPU loader's decoder)."""
    if out is None:
        out = torch.empty(tt.shape, dtype=torch.bfloat16, device=tt.device)
    if out.dtype != torch.bfloat16 or out.numel() != tt.numel or not out.is_contiguous():
        raise ValueError("out must be a contiguous bf16 tensor with the tensor's numel")
    if tt.numel == 0:
        return out
    sm = tt.raw.view(torch.int8).to(torch.int32)  # sign-extended: the sign lands in bit 15
    bits = (sm & 0x807F) | (decode_exponents(tt).reshape(-1).to(torch.int32) << 7)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
    out.view(torch.int16).view(-1).copy_(bits.to(torch.int16))
    return out


def escape_rate(tt: TiledTensor) -> float:
    return tt.escapes.numel() / max(1, tt.numel)
