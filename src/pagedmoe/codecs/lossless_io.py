"""Lossless tensors in safetensors files: arrays as tensors, codebooks and checksums as JSON.

File layout (docs/formats.md): for a compressed tensor NAME the file holds
  NAME.lx.stream  int32   NAME.lx.part_word_offsets  int64   NAME.lx.block_bit_offsets  int64
  NAME.lx.lane_bits  uint8 or int16 (by layout)   NAME.lx.raw  uint8
and ``__metadata__["pagedmoe.lossless"]`` is a JSON object {"format", "version", "tensors":
{NAME: {shape, dtype, num_parts, lanes, elems_per_lane, max_code_len, code_lengths,
fill_exponent, checksums}}}. Version 2 files (codecs/tiled.py) hold NAME.lx.base, .nibbles,
.escape_offsets, .escapes, .raw and headers {shape, dtype, num_parts, tile_rows, tile_cols,
checksums}; a file holds one version. Uncompressed tensors (the backbone) sit beside them under
their own names. Loading checks every part's crc32 before anything is returned.
"""
from __future__ import annotations

import json

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedmoe.codecs import hibyte, huffman, tiled
from pagedmoe.codecs.lossless import (ARRAYS, FORMAT_NAME, FORMAT_VERSION, CompressedTensor,
                                      CorruptCheckpointError, LosslessLayout, compute_checksums, verify)

METADATA_KEY = "pagedmoe.lossless"
SUFFIX = ".lx."
VERSIONS = (FORMAT_VERSION, tiled.FORMAT_VERSION, hibyte.FORMAT_VERSION)  # the versions this build reads
ARRAYS_OF = {FORMAT_VERSION: ARRAYS, tiled.FORMAT_VERSION: tiled.ARRAYS, hibyte.FORMAT_VERSION: hibyte.ARRAYS}
CHECKSUMS_OF = {FORMAT_VERSION: compute_checksums, tiled.FORMAT_VERSION: tiled.compute_checksums,
                hibyte.FORMAT_VERSION: hibyte.compute_checksums}


def check_version(path, info: dict, versions=VERSIONS) -> int:
    """The file's format version, or one clear error line for a format or version this reader does not take."""
    fmt, version = info.get("format"), info.get("version")
    if fmt != FORMAT_NAME or version not in versions:
        raise CorruptCheckpointError(f"{path}: format {fmt} v{version}, this reader takes {FORMAT_NAME} "
                                     f"v{' / v'.join(map(str, versions))}")
    return version


def _header(ct) -> dict:
    if ct.version == hibyte.FORMAT_VERSION:
        return {"shape": list(ct.shape), "dtype": "bfloat16", "num_parts": ct.num_parts,
                "tile_rows": hibyte.TILE_ROWS, "tile_cols": hibyte.TILE_COLS, "checksums": list(ct.checksums)}
    if ct.version == tiled.FORMAT_VERSION:
        return {"shape": list(ct.shape), "dtype": "bfloat16", "num_parts": ct.num_parts,
                "tile_rows": tiled.TILE_ROWS, "tile_cols": tiled.TILE_COLS, "checksums": list(ct.checksums)}
    lay = ct.layout
    return {"shape": list(ct.shape), "dtype": "bfloat16", "num_parts": ct.num_parts, "lanes": lay.lanes,
            "elems_per_lane": lay.elems_per_lane, "max_code_len": lay.max_code_len,
            "code_lengths": [int(v) for v in ct.code_lengths.tolist()], "fill_exponent": ct.fill_exponent,
            "checksums": list(ct.checksums)}


def save_compressed(path: str, tensors: dict, plain: dict[str, torch.Tensor] | None = None,
                    metadata: dict[str, str] | None = None) -> None:
    """Writes compressed (CompressedTensor: version 1, TiledTensor: version 2, HiByteTensor: version 3; one
    version per file) and
    optionally plain tensors to one safetensors file."""
    out: dict[str, torch.Tensor] = {}
    headers = {}
    versions = {ct.version for ct in tensors.values()} or {FORMAT_VERSION}
    if len(versions) > 1:
        raise ValueError(f"one file holds one format version, got {sorted(versions)}")
    version = versions.pop()
    for name, ct in tensors.items():
        if version == hibyte.FORMAT_VERSION:
            ct = hibyte.to_rows(ct)  # files hold the row order (a tier's tile_major tensor written as such)
        if not ct.checksums:
            ct.checksums = CHECKSUMS_OF[version](ct)
        headers[name] = _header(ct)
        for a in ARRAYS_OF[version]:
            out[name + SUFFIX + a] = getattr(ct, a).detach().cpu().contiguous()
    for name, t in (plain or {}).items():
        if SUFFIX in name or name in out:
            raise ValueError(f"plain tensor name {name!r} collides with a compressed tensor's arrays")
        out[name] = t.detach().cpu().contiguous()
    meta = dict(metadata or {})
    meta[METADATA_KEY] = json.dumps({"format": FORMAT_NAME, "version": version, "tensors": headers})
    save_file(out, path, metadata=meta)


def _expect(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise CorruptCheckpointError(f"{name}: stored {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")


def _tile_format_from_file(f, name: str, h: dict, codec, make):
    """A version 2 or 3 tensor (codec: codecs/tiled or codecs/hibyte; make(shape, num_parts, checksums, arrays)
    builds it): header and arrays read, arrays checked, then its crc32s verified."""
    try:
        shape, num_parts = tuple(int(s) for s in h["shape"]), int(h["num_parts"])
        if h.get("dtype") != "bfloat16" or (h["tile_rows"], h["tile_cols"]) != (codec.TILE_ROWS, codec.TILE_COLS):
            raise ValueError(f"dtype {h.get('dtype')}, tiles {h['tile_rows']}x{h['tile_cols']} "
                             f"(this build: bfloat16, {codec.TILE_ROWS}x{codec.TILE_COLS})")
        cols = shape[-1] if shape else 1
        rows = int(np.prod(shape)) // cols if cols else 0
        if num_parts < 1 or rows % num_parts:
            raise ValueError("bad shape or num_parts")
        arrays = {a: f.get_tensor(name + SUFFIX + a) for a in codec.ARRAYS}
        checksums = tuple(int(c) for c in h["checksums"])
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{name}: malformed lossless header or missing array ({e})") from e
    ct = make(shape, num_parts, checksums, arrays)
    codec.check_arrays(ct, name)  # shapes first: the checksum spans depend on them
    codec.verify(ct, name)
    return ct


def read_tensor_file(f, name: str, h: dict, version: int = FORMAT_VERSION):
    """One compressed tensor of an open file, its arrays checked and its crc32s verified."""
    if version == hibyte.FORMAT_VERSION:
        return _tile_format_from_file(f, name, h, hibyte, lambda s, n, c, a: hibyte.HiByteTensor(s, n, checksums=c, **a))
    if version == tiled.FORMAT_VERSION:
        return _tile_format_from_file(f, name, h, tiled, lambda s, n, c, a: tiled.TiledTensor(s, n, checksums=c, **a))
    try:
        layout = LosslessLayout(h["lanes"], h["elems_per_lane"], h["max_code_len"])
        lengths = np.asarray(h["code_lengths"], dtype=np.int64)
        huffman.check_lengths(lengths, layout.max_code_len)
        shape, num_parts = tuple(int(s) for s in h["shape"]), int(h["num_parts"])
        if h.get("dtype") != "bfloat16" or num_parts < 1 or int(np.prod(shape)) % num_parts \
                or not 0 <= int(h["fill_exponent"]) < 256:
            raise ValueError("bad dtype, shape, num_parts or fill_exponent")
        arrays = {a: f.get_tensor(name + SUFFIX + a) for a in ARRAYS}
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{name}: malformed lossless header or missing array ({e})") from e
    ct = CompressedTensor(shape, num_parts, layout, torch.from_numpy(lengths.astype(np.uint8)),
                          int(h["fill_exponent"]), checksums=tuple(int(c) for c in h["checksums"]), **arrays)
    _expect(f"{name}.raw", ct.raw, torch.uint8, (ct.numel,))
    _expect(f"{name}.lane_bits", ct.lane_bits, layout.lane_bits_dtype, (ct.num_blocks, layout.lanes))
    _expect(f"{name}.block_bit_offsets", ct.block_bit_offsets, torch.int64, (ct.num_blocks,))
    _expect(f"{name}.part_word_offsets", ct.part_word_offsets, torch.int64, (num_parts + 1,))
    pwo = ct.part_word_offsets
    if int(pwo[0]) != 0 or bool((pwo[1:] < pwo[:-1]).any()):
        raise CorruptCheckpointError(f"{name}: part word offsets are not increasing from 0")
    _expect(f"{name}.stream", ct.stream, torch.int32, (int(pwo[-1]) + layout.pad_words,))
    verify(ct, name)
    # the checksums cover the bytes; also refuse offsets that would send a decoder out of bounds
    bbo = ct.block_bit_offsets.view(num_parts, -1) if ct.num_blocks else None
    if bbo is not None:
        lane_end = bbo + ct.lane_bits.to(torch.int64).view(num_parts, -1, layout.lanes).sum(-1)
        if bool((bbo[:, 0] != pwo[:-1] * 32).any()) or bool((lane_end > pwo[1:, None] * 32).any()) \
                or bool((ct.lane_bits < 0).any()):
            raise CorruptCheckpointError(f"{name}: block offsets disagree with the part offsets")
    return ct


def load_compressed(path: str, device: str | torch.device = "cpu", names: list[str] | None = None,
                    versions=VERSIONS) -> tuple[dict, dict[str, torch.Tensor]]:
    """Reads (compressed, plain) tensors, checking each part's crc32 on the host first.

    Raises CorruptCheckpointError naming the tensor and part when the file was altered.
    names restricts which compressed tensors are read (plain tensors are always read). versions: the
    format versions the caller takes (a reader of one version refuses the other with one line).
    """
    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own types for a broken header
        raise CorruptCheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    with f:
        meta = f.metadata() or {}
        if METADATA_KEY not in meta:
            raise CorruptCheckpointError(f"{path}: no {METADATA_KEY!r} metadata; not a pagedmoe lossless file")
        try:
            info = json.loads(meta[METADATA_KEY])
        except json.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{path}: lossless metadata is not JSON ({e})") from e
        version = check_version(path, info, versions)
        headers = info["tensors"]
        compressed = {n: read_tensor_file(f, n, h, version) for n, h in headers.items() if names is None or n in names}
        plain = {k: f.get_tensor(k) for k in f.keys() if SUFFIX not in k}
    dev = torch.device(device)
    if dev.type != "cpu":
        compressed = {n: ct.to(dev) for n, ct in compressed.items()}
        plain = {k: t.to(dev) for k, t in plain.items()}
    return compressed, plain
