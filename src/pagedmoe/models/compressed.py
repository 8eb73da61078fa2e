"""Compressed checkpoints: safetensors shards whose expert tensors are in the lossless bf16 format.

A compressed checkpoint folder looks like the original one (same shard names, same index, same
config and tokenizer files); each shard holds its compressed tensors as `NAME.lx.*` arrays
(codecs/lossless_io.py, docs/formats.md) and the rest unchanged. To give the original file back
byte for byte, its __metadata__ also records, under ORIGINAL_KEY, the original file's name, size,
sha256 and its verbatim safetensors header (tensor order, dtypes, shapes, offsets, padding and the
original __metadata__, which is also copied as is so tools that read e.g. "format" still work).

Reading: `iter_file_tensors(path)` yields (name, tensor) from a plain or a compressed shard
(checksums checked, compressed tensors decoded: the PyTorch reference decoder on the CPU, the
Triton decoder on CUDA). Writing back: `decompress_file(src, dst)`. Writing: entrypoints/compress.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from pagedmoe.codecs import hibyte, tiled
from pagedmoe.codecs.lossless import CompressedTensor, CorruptCheckpointError, decode_reference
# read_tensor_file reads one compressed tensor of an open file and checks its crc32s and offsets;
# load_compressed would read the whole file (every plain tensor too) for each tensor.
from pagedmoe.codecs.lossless_io import METADATA_KEY, SUFFIX, check_version
from pagedmoe.codecs.lossless_io import read_tensor_file as read_compressed_tensor

ORIGINAL_KEY = "pagedmoe.original"
ORIGINAL_VERSION = 1
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

PathLike = Union[str, Path]

# model.layers.{l}.{block}.experts.{e}.{proj}.weight (Mixtral w1/w2/w3, Qwen/OLMoE gate/up/down_proj)
_PER_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?experts\.(\d+)\.(\w+)\.weight$")
# HF v5 fused layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
_FUSED = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?experts\.(gate_up_proj|down_proj)$")


def expert_proj(name: str) -> Optional[str]:
    """The projection name ('w1', 'gate_proj', 'gate_up_proj', ...) of an expert tensor, else None."""
    m = _PER_EXPERT.search(name) or _FUSED.search(name)
    return m.group(m.lastindex) if m else None


def expert_num_parts(name: str, shape) -> int:
    """Checksummed, independently decodable parts of an expert tensor: one per expert."""
    return int(shape[0]) if _FUSED.search(name) and len(shape) == 3 else 1


def tensor_kind(name: str) -> str:
    """The group a tensor is reported under: experts.<proj>, attention, embeddings or other."""
    proj = expert_proj(name)
    if proj is not None:
        return f"experts.{proj}"
    if "attn" in name or ".attention." in name:
        return "attention"
    if "embed" in name or name.startswith("lm_head") or ".lm_head." in name:
        return "embeddings"
    return "other"  # norms, routers, shared experts, biases


def _corrupt(name: str, e: CorruptCheckpointError) -> CorruptCheckpointError:
    """The codec's error, reworded to name the layer and expert of a per-expert tensor."""
    msg = str(e)
    rest = msg[len(name) + 2:] if msg.startswith(name + ": ") else msg
    m = _PER_EXPERT.search(name)
    if m:  # one tensor per expert: its single part is the expert
        rest = rest.replace("part 0 (expert 0 of a stacked tensor) ", "", 1)
        return CorruptCheckpointError(f"{name}: expert {m.group(2)} of layer {m.group(1)} ({m.group(3)}) "
                                      f"is corrupted: {rest}")
    return CorruptCheckpointError(f"{name}: {rest}")


# ---------------------------------------------------------------------------------------------
# safetensors headers


def read_header(path: PathLike) -> tuple[bytes, dict]:
    """The raw header bytes of a safetensors file (after its 8-byte length) and the parsed JSON."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise CorruptCheckpointError(f"{path}: too short for a safetensors file ({size} bytes)")
        n = struct.unpack("<Q", prefix)[0]
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CorruptCheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        raw = fh.read(n)
    try:
        return raw, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: safetensors header is not JSON ({e})") from e


def tensor_order(header: dict) -> list[tuple[str, int, int]]:
    """(name, begin, end) of every tensor in the order of their bytes in the file."""
    try:
        spans = [(k, int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in header.items()
                 if k != "__metadata__"]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptCheckpointError(f"safetensors header without data_offsets ({e})") from e
    return sorted(spans, key=lambda s: (s[1], s[2]))


def check_reproducible(path: PathLike, raw_header: bytes, header: dict) -> list[tuple[str, int, int]]:
    """Refuses a file whose bytes the header does not account for exactly (gaps, overlaps, trailing
    bytes): such a file could not be written back byte for byte."""
    spans = tensor_order(header)
    pos = 0
    for name, b, e in spans:
        if b != pos or e < b:
            raise ValueError(f"{path}: tensor {name!r} at bytes [{b}, {e}) leaves a gap or overlaps; "
                             f"this file cannot be reproduced byte for byte")
        pos = e
    size = os.path.getsize(path)
    if 8 + len(raw_header) + pos > size:
        raise ValueError(f"{path}: truncated, {8 + len(raw_header) + pos - size} bytes shorter than its header "
                         f"says")
    if 8 + len(raw_header) + pos != size:
        raise ValueError(f"{path}: {size - 8 - len(raw_header) - pos} bytes after the last tensor; "
                         f"this file cannot be reproduced byte for byte")
    return spans


def sha256_file(path: PathLike, chunk_bytes: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            h.update(chunk)  # releases the GIL: callers hash in a thread while they encode
    return h.hexdigest()


def original_record(path: PathLike, raw_header: bytes, sha256: str) -> str:
    """The ORIGINAL_KEY metadata value: everything decompress_file needs besides the tensors."""
    return json.dumps({"version": ORIGINAL_VERSION, "file": Path(path).name, "size": os.path.getsize(path),
                       "sha256": sha256, "header": raw_header.decode("utf-8")})


# ---------------------------------------------------------------------------------------------
# reading


def _open(path: PathLike):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own types for a broken header
        raise CorruptCheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def written_by_compress(path: PathLike) -> bool:
    """Whether a safetensors file is a shard written by `pagedmoe compress` (decompress_file can
    rebuild its original)."""
    with _open(path) as f:
        return ORIGINAL_KEY in (f.metadata() or {})


def decode(ct: CompressedTensor, device: Union[str, torch.device] = "cpu", decoder: str = "auto") -> torch.Tensor:
    """A compressed tensor (on the CPU, checksums already checked) -> bf16 on `device`.

    decoder: 'reference' (PyTorch), 'triton', or 'auto' (Triton on CUDA, the reference elsewhere).
    A version 2 (tiled) or 3 (hibyte) tensor is decoded by its vectorised PyTorch reference on `device` (their
    Triton readers are the fused MoE GEMMs, kernels/fused_moe_lossless.py and fused_moe_hibyte.py).
    """
    device = torch.device(device)
    if ct.version == tiled.FORMAT_VERSION:
        return tiled.decode_reference(ct.to(device))
    if ct.version == hibyte.FORMAT_VERSION:  # candidate version 3: its reader is kernels/fused_moe_hibyte.py
        return hibyte.decode_reference(ct.to(device))
    if decoder == "auto":
        decoder = "triton" if device.type == "cuda" else "reference"
    if decoder == "reference":
        return decode_reference(ct).to(device)
    if decoder != "triton":
        raise ValueError(f"decoder must be auto, reference or triton, got {decoder!r}")
    from pagedmoe.kernels.lossless_decode import lossless_decode

    ct = ct.to(device)
    return lossless_decode(ct, torch.empty(ct.shape, dtype=torch.bfloat16, device=device))


def _lossless_headers(path: PathLike, meta: dict) -> tuple[int, dict]:
    """(format version, per-tensor headers) of the lossless metadata, after checking its format and version."""
    try:
        info = json.loads(meta[METADATA_KEY])
        headers = info["tensors"]
        info.get("version")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{path}: malformed {METADATA_KEY!r} metadata ({e})") from e
    return check_version(path, info), headers


def _original(path: PathLike, meta: dict) -> Optional[dict]:
    if ORIGINAL_KEY not in meta:
        return None
    try:
        rec = json.loads(meta[ORIGINAL_KEY])
        if rec["version"] != ORIGINAL_VERSION:
            raise ValueError(f"version {rec['version']}, this build reads {ORIGINAL_VERSION}")
        rec["raw_header"] = rec["header"].encode("utf-8")
        rec["spans"] = tensor_order(json.loads(rec["raw_header"]))
        return rec
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: malformed {ORIGINAL_KEY!r} metadata ({e})") from e


def iter_file_tensors(path: PathLike, device: Union[str, torch.device] = "cpu",
                      decoder: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a plain or compressed safetensors file.

    Plain files: f.keys() order, tensors on the CPU (as safetensors reads them). Compressed files:
    the original file's order; compressed tensors are checked (crc32 per part) and decoded to bf16
    on `device`; a corrupted one raises CorruptCheckpointError naming the tensor and the expert.
    """
    from safetensors import safe_open

    # NOTE: errors opening the file propagate as safetensors raises them (the loader reports those)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if METADATA_KEY not in meta:
            for name in f.keys():
                yield name, f.get_tensor(name)
            return
        version, headers = _lossless_headers(path, meta)
        original = _original(path, meta)
        if original is not None:
            names = [name for name, _, _ in original["spans"]]
        else:  # a file written by save_compressed alone
            names = [k for k in f.keys() if SUFFIX not in k] + list(headers)
        for name in names:
            if name in headers:
                try:
                    ct = read_compressed_tensor(f, name, headers[name], version)
                except CorruptCheckpointError as e:
                    raise _corrupt(name, e) from e
                yield name, decode(ct, device, decoder)
            else:
                yield name, f.get_tensor(name)


# ---------------------------------------------------------------------------------------------
# writing the original file back


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # NOTE: safetensors stores little-endian, C-contiguous bytes, as torch holds them on x86/ARM.
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def decompress_file(src: PathLike, dst: PathLike, device: Union[str, torch.device] = "cpu",
                    decoder: str = "auto", progress=None) -> int:
    """Writes the original safetensors file of compressed shard `src` to `dst`, byte for byte.

    The output's sha256 must equal the one recorded at compression time, else nothing is left at
    dst and CorruptCheckpointError is raised. Returns the bytes written. progress(n) is called
    with the bytes of each tensor.
    """
    with _open(src) as f:
        meta = f.metadata() or {}
    original = _original(src, meta)
    if original is None:
        raise ValueError(f"{src}: not a compressed shard written by `pagedmoe compress` "
                         f"(no {ORIGINAL_KEY!r} metadata)")
    raw_header, spans = original["raw_header"], original["spans"]
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")  # NOTE: renamed to dst only once its sha256 matches
    h = hashlib.sha256()
    pos = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in (struct.pack("<Q", len(raw_header)), raw_header):
                out.write(chunk)
                h.update(chunk)
            for (want, b, e), (name, t) in zip(spans, iter_file_tensors(src, device, decoder), strict=True):
                buf = _tensor_bytes(t)
                if name != want or b != pos or buf.nbytes != e - b:
                    raise CorruptCheckpointError(f"tensor {name!r} has {buf.nbytes} bytes at {pos}, "
                                                 f"the original header says {want!r} [{b}, {e})")
                out.write(buf)
                h.update(buf)
                pos = e
                if progress is not None:
                    progress(buf.nbytes)
        if h.hexdigest() != original["sha256"]:
            raise CorruptCheckpointError(f"the rebuilt {original['file']} has sha256 {h.hexdigest()}, "
                                         f"the original had {original['sha256']}")
        os.replace(tmp, dst)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{src}: {e}") from e
    finally:
        if tmp.exists():
            tmp.unlink()
    return 8 + len(raw_header) + pos
