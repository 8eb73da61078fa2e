"""Length-limited canonical Huffman codes over a byte alphabet (the bf16 exponents).

Everything here works on at most 256 symbols, so it runs in Python/numpy on the host; the
per-element work (encoding, decoding) lives in ``lossless.py`` and ``kernels/lossless_decode.py``.

Conventions (shared by the encoder, the reference decoder and the Triton decoder):
  - code lengths are a uint8 array [256]; 0 means "symbol absent".
  - codes are canonical: symbols sorted by (length, symbol value) get consecutive codes, and a
    code is written most-significant bit first.
  - a tensor whose exponents are all equal gets a zero-length code: its exponent stream is empty.
"""
from __future__ import annotations

import numpy as np
import torch

ALPHABET = 256
# Bits of one decode-table entry: bits 0-3 the code length, bits 7-14 the exponent (already in
# its bf16 position, so the decoder ORs it in with one bit-select). Bit 15 (negative int16)
# marks "code longer than the short table's index": look again in the long table.
LEN_MASK = 0xF
EXP_SHIFT = 7
LONG_MARKER = -1


def package_merge(counts: np.ndarray, max_len: int) -> np.ndarray:
    """Optimal code lengths under a length limit (Larmore-Hirschberg package-merge).

    counts [n] > 0, n >= 2, n <= 2**max_len. Returns int lengths [n] with sum 2**-l == 1.
    Each item carries a count vector saying how many times it contains each symbol; a symbol's
    code length is how many of the first 2n-2 items of the last level contain it.
    """
    n = len(counts)
    assert 2 <= n <= (1 << max_len)
    order = np.argsort(counts, kind="stable")
    leaf_w = counts[order].astype(np.float64)
    leaf_c = np.eye(n, dtype=np.int32)[order]
    w, c = leaf_w, leaf_c
    for _ in range(max_len - 1):
        m = len(w) // 2 * 2
        pw = w[0:m:2] + w[1:m:2]
        pc = c[0:m:2] + c[1:m:2]
        w = np.concatenate([leaf_w, pw])
        c = np.concatenate([leaf_c, pc])
        keep = np.argsort(w, kind="stable")
        w, c = w[keep], c[keep]
    return c[: 2 * n - 2].sum(axis=0)


def code_lengths_from_histogram(hist, max_len: int) -> np.ndarray:
    """Length-limited Huffman code lengths [256] (uint8) for an exponent histogram [256]."""
    hist = np.asarray(hist, dtype=np.int64)
    assert hist.shape == (ALPHABET,)
    if not 8 <= max_len <= 15:
        raise ValueError(f"max_code_len must be in [8, 15] (256 symbols, 4-bit length field), got {max_len}")
    present = np.nonzero(hist)[0]
    lengths = np.zeros(ALPHABET, dtype=np.uint8)
    if len(present) >= 2:
        lengths[present] = package_merge(hist[present], max_len)
    # one symbol (or none): length 0, the stream is empty and the decode table is constant
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values [256] (int64) for code lengths [256]; absent symbols get 0."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(ALPHABET, dtype=np.int64)
    syms = sorted((int(l), s) for s, l in enumerate(lengths) if l > 0)
    code, prev = 0, 0
    for l, s in syms:
        code <<= l - prev
        codes[s] = code
        code += 1
        prev = l
    if syms and code != (1 << prev):
        raise ValueError("code lengths do not form a complete prefix code")
    return codes


def check_lengths(lengths: np.ndarray, max_len: int) -> None:
    """Refuses code lengths that a decoder could not use (corrupt metadata)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (ALPHABET,) or lengths.min() < 0 or lengths.max() > max_len:
        raise ValueError(f"code lengths must be [256] in [0, {max_len}]")
    nz = lengths[lengths > 0]
    if len(nz) == 1:
        raise ValueError("a single present symbol must have code length 0")
    if len(nz) >= 2 and sum(2.0 ** -int(l) for l in nz) != 1.0:
        raise ValueError("code lengths do not form a complete prefix code")


def decode_table(lengths: np.ndarray, max_len: int, short_bits: int, const_symbol: int = 0) -> torch.Tensor:
    """int16 decode table [2**short_bits + 2**max_len] (the long part empty if short_bits == max_len).

    Entry i of the short part describes the code that starts with the short_bits-bit prefix i:
    (exponent << 7) | length, or LONG_MARKER if that code is longer than short_bits; the long
    part is indexed by the full max_len-bit window. ``const_symbol`` names the exponent of an
    all-equal tensor (no code has a length then).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    assert 1 <= short_bits <= max_len
    full = np.full(1 << max_len, const_symbol << EXP_SHIFT, dtype=np.int64)  # length 0
    codes = canonical_codes(lengths)
    for s in np.nonzero(lengths)[0]:
        l = int(lengths[s])
        lo = int(codes[s]) << (max_len - l)
        full[lo : lo + (1 << (max_len - l))] = (int(s) << EXP_SHIFT) | l
    if short_bits == max_len:
        return torch.from_numpy(full.astype(np.int16))
    short = full[:: 1 << (max_len - short_bits)].copy()
    short[(short & LEN_MASK) > short_bits] = LONG_MARKER
    return torch.from_numpy(np.concatenate([short, full]).astype(np.int16))
