"""The lossless bf16 format's types (codecs/lossless.py encodes and decodes them; docs/formats.md is the
spec): the layout fixed at encode time and the CompressedTensor a tensor becomes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedmoe.codecs import huffman

FORMAT_NAME = "pagedmoe-lossless-bf16"
FORMAT_VERSION = 1
PAD_SYMBOL = 256  # past-the-end element of a short block: a zero-length "code"


class CorruptCheckpointError(ValueError):
    """Stored compressed data does not match its checksum (or is malformed)."""


@dataclass(frozen=True)
class LosslessLayout:
    """Format parameters fixed at encode time (the decoder must use the same).

    The default follows the fastest layout measured on the H200 (docs/benchmarks.md, "Lossless
    codec"): 1024 short lanes, 8-bit maximum code length (a 256-entry decode table). 30 steps
    per lane (not 32) keep a lane's length <= 240 bits, so lane lengths fit one byte: 0.27 bits
    per weight instead of 0.5 with 32 steps and int16 lengths; an even count keeps the
    2x-unrolled step loop free of a remainder iteration (same machine code as the measured
    32-step variant, same 80 registers).
    """

    lanes: int = 1024  # lanes per block; power of two
    elems_per_lane: int = 30
    max_code_len: int = 8

    def __post_init__(self):
        if self.lanes < 16 or self.lanes > 4096 or self.lanes & (self.lanes - 1):
            raise ValueError(f"lanes must be a power of two in [16, 4096], got {self.lanes}")
        if not 8 <= self.max_code_len <= 15:
            raise ValueError(f"max_code_len must be in [8, 15], got {self.max_code_len}")
        if not 1 <= self.elems_per_lane or self.elems_per_lane * self.max_code_len > 32767:
            raise ValueError("elems_per_lane * max_code_len must fit an int16 lane length")

    @property
    def block_elems(self) -> int:
        return self.lanes * self.elems_per_lane

    @property
    def lane_bits_dtype(self) -> torch.dtype:
        """uint8 when a lane's bits always fit a byte, else int16."""
        return torch.uint8 if self.elems_per_lane * self.max_code_len <= 255 else torch.int16

    @property
    def pad_words(self) -> int:
        # NOTE: the decoders read up to 3 words past the word holding a lane's current bit
        # (current, next, prefetched); the zero words at the end of the stream keep that in bounds.
        return 4


# The device arrays of a CompressedTensor, in its field order (docs/formats.md, "Arrays").
ARRAYS = ("stream", "part_word_offsets", "block_bit_offsets", "lane_bits", "raw")


@dataclass
class CompressedTensor:
    """One bf16 tensor in the lossless format. All tensors live on the same device."""

    shape: tuple[int, ...]
    num_parts: int
    layout: LosslessLayout
    code_lengths: torch.Tensor  # uint8 [256], on the CPU
    fill_exponent: int  # the exponent when every code length is 0 (one exponent value)
    stream: torch.Tensor  # int32 [num_words + pad_words], codes MSB-first in each word
    part_word_offsets: torch.Tensor  # int64 [num_parts + 1], word where each part's codes start
    block_bit_offsets: torch.Tensor  # int64 [num_blocks], first bit of each block
    lane_bits: torch.Tensor  # layout.lane_bits_dtype (uint8 or int16) [num_blocks, lanes]
    raw: torch.Tensor  # uint8 [numel], sign << 7 | mantissa
    checksums: tuple[int, ...] = ()  # crc32 per part over its stored bytes (checksum_parts)
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # decode tables, launch info

    version = FORMAT_VERSION  # a class attribute, not a field: codecs/tiled.py's TiledTensor says 2

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def part_size(self) -> int:
        return self.numel // self.num_parts if self.num_parts else 0

    @property
    def blocks_per_part(self) -> int:
        return -(-self.part_size // self.layout.block_elems)

    @property
    def num_blocks(self) -> int:
        return self.num_parts * self.blocks_per_part

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        """Bytes stored for this tensor (what the compressed tier holds)."""
        ts = (self.stream, self.part_word_offsets, self.block_bit_offsets, self.lane_bits, self.raw)
        return sum(t.numel() * t.element_size() for t in ts) + 256

    @property
    def ratio(self) -> float:
        return self.nbytes / max(1, 2 * self.numel)

    def to(self, device) -> "CompressedTensor":
        mv = lambda t: t.to(device, non_blocking=True)
        return CompressedTensor(self.shape, self.num_parts, self.layout, self.code_lengths,
                                self.fill_exponent, mv(self.stream), mv(self.part_word_offsets),
                                mv(self.block_bit_offsets), mv(self.lane_bits), mv(self.raw),
                                self.checksums)

    def part(self, p: int) -> "CompressedTensor":
        """Part p alone, as a one-part tensor of part_size elements (see parts)."""
        if not 0 <= p < self.num_parts:
            raise IndexError(f"part {p} of {self.num_parts}")
        return self.parts(p, p + 1)

    def parts(self, p0: int, p1: int) -> "CompressedTensor":
        """Parts [p0, p1) alone, as a (p1 - p0)-part tensor of (p1 - p0) * part_size elements: their words of
        the stream (with the pad words the decoder may read past them), their blocks with the bit offsets
        rebased to the first word, their raw bytes. Shares the codebook; decodes to the same bits (copies,
        not views)."""
        if not 0 <= p0 < p1 <= self.num_parts:
            raise IndexError(f"parts [{p0}, {p1}) of {self.num_parts}")
        w = self.part_word_offsets
        w0, w1 = int(w[p0]), int(w[p1])
        pad = self.stream.numel() - int(w[-1])
        bpp, ps = self.blocks_per_part, self.part_size
        blocks = slice(p0 * bpp, p1 * bpp)
        return CompressedTensor(((p1 - p0) * ps,), p1 - p0, self.layout, self.code_lengths, self.fill_exponent,
                                self.stream[w0:w1 + pad].clone(), (w[p0:p1 + 1] - w0).clone(),
                                self.block_bit_offsets[blocks] - 32 * w0, self.lane_bits[blocks].clone(),
                                self.raw[p0 * ps:p1 * ps].clone())

    def decode_table(self, short_bits: int | None = None, dtype: torch.dtype = torch.int16,
                     device: torch.device | None = None) -> torch.Tensor:
        """Decode table (``huffman.decode_table``) on `device` (default: this tensor's; another where a GPU kernel
        reads this tensor's arrays from mapped host memory), built once, then cached."""
        short_bits = self.layout.max_code_len if short_bits is None else short_bits
        device = self.device if device is None else torch.device(device)
        key = (short_bits, dtype, device)
        if key not in self.cache:
            t = huffman.decode_table(self.code_lengths.numpy(), self.layout.max_code_len,
                                     short_bits, self.fill_exponent)
            self.cache[key] = t.to(dtype).to(device)
        return self.cache[key]


# ---------------------------------------------------------------------------------------------
# encoder
