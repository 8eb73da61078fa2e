"""`pagedmoe compress MODEL OUT` and `pagedmoe decompress OUT DIR`: lossless compressed checkpoints.

compress writes a complete model folder: every shard under its own name with its expert tensors
(or, with --all-weights, every bf16 tensor that gets smaller) in the lossless bf16 format
(docs/formats.md), the other tensors unchanged, and every non-weight file (config, tokenizer,
generation config, index) copied. `LLM`, `generate` and `serve` load that folder directly.
decompress writes the original safetensors files back byte for byte (checked against the sha256
recorded at compression time) and copies the other files.

Only bf16 weights are compressed: a checkpoint whose expert tensors are another dtype is refused
(convert it to bf16 first); converting here would break the byte-for-byte round trip.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

# weight formats that are not copied into OUT when the loader would not read them (e.g. a
# consolidated.safetensors beside indexed shards, or pytorch_model.bin duplicates)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
SKIP_DIRS = {".git", ".cache"}
INDEX_NAME = "model.safetensors.index.json"
LOSSY_CHOICES = ("fp8", "int8", "int4")


def register(sub) -> None:
    p = sub.add_parser("compress", help="write a losslessly compressed copy of a checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="checkpoint folder (bf16 safetensors)")
    p.add_argument("out", help="output folder (must be empty or absent unless --force)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--experts-only", dest="all_weights", action="store_false", default=False,
                      help="compress the expert tensors only (default)")
    what.add_argument("--all-weights", dest="all_weights", action="store_true",
                      help="also compress every other bf16 tensor that gets smaller")
    p.add_argument("--format", dest="fmt", default="huffman", choices=["huffman", "tiled", "hibyte"],
                   help="huffman: format version 1, the smallest (0.683 of bf16 on Gaussian weights), decoded by "
                        "a standalone pass; tiled: version 2 (~0.753), fixed-width exponent offsets that a MoE "
                        "GEMM decodes tile by tile; hibyte: candidate version 3 (~0.771), the low byte verbatim "
                        "and the high byte in 4 bits, decoded four weights a word (docs/formats.md)")
    p.add_argument("--max-code-len", type=int, default=None,
                   help="longest Huffman code in bits, 8..15 (default 8: one 256-entry decode table); "
                        "--format huffman only")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to encode (auto: cuda when available)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip decoding each tensor back and comparing it with the original")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT (its *.safetensors files and index are removed first)")
    p.add_argument("--precisions", nargs="+", choices=LOSSY_CHOICES, default=None, metavar="P",
                   help="also write every expert's lossy forms (fp8 int8 int4) and their relative weight "
                        "errors into OUT/expert-lossy/, for --expert-precision dynamic")
    p.set_defaults(func=run_compress)

    d = sub.add_parser("decompress", help="write the original safetensors of a compressed checkpoint back",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("compressed", help="folder written by `pagedmoe compress`")
    d.add_argument("out_dir", help="output folder (must be empty or absent unless --force)")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to decode (auto: the Triton decoder on cuda when available)")
    d.add_argument("--force", action="store_true",
                   help="write into a non-empty DIR (its *.safetensors files and index are removed first)")
    d.set_defaults(func=run_decompress)


# ---------------------------------------------------------------------------------------------
# folders


def _resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def prepare_out(out: Path, src: Path, force: bool) -> Path:
    """Creates OUT; refuses the source folder itself and a non-empty OUT without --force."""
    if out.resolve() == src.resolve():
        raise ValueError(f"the output folder {out} is the input folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"{out} is not empty; pass --force to write into it")
        # stale shards would be loaded (a folder without an index loads every *.safetensors)
        for f in list(out.glob("*.safetensors")) + list(out.glob("*.partial")) + [out / INDEX_NAME]:
            if f.is_file():
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def undone_on_failure(out: Path, created: bool):
    """On an error or Ctrl-C inside the block, remove what it wrote into OUT (the files and folders that were not
    there when it began; OUT itself when `created`, i.e. this run made it), so a rerun after fixing the input
    needs no --force. Files that were there stay."""
    before = set(out.rglob("*"))
    try:
        yield
    except BaseException:
        for path in sorted(set(out.rglob("*")) - before, reverse=True):   # a folder's files before the folder
            try:
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
            except OSError:
                pass
        if created and not any(out.iterdir()):
            out.rmdir()
        raise


def copy_other_files(src: Path, dst: Path, handled: set[Path], skip_weights: bool) -> tuple[list, list]:
    """Copies every file of src except `handled` (and other weight files when skip_weights).
    Returns (copied, skipped) relative paths."""
    copied, skipped = [], []
    handled = {p.resolve() for p in handled}
    for root, dirs, files in os.walk(src):
        # dst may lie inside src (`compress m m/c`): do not copy it into itself
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and (Path(root) / d).resolve() != dst.resolve())
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(src)
            if path.resolve() in handled or name.endswith(".partial"):
                continue
            if skip_weights and name.endswith(WEIGHT_SUFFIXES):
                skipped.append(str(rel))
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)  # follows symlinks (HF cache snapshots link to blobs)
            copied.append(str(rel))
    return copied, skipped


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc,
                disable=os.environ.get("PAGEDMOE_NO_PROGRESS") is not None)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


# ---------------------------------------------------------------------------------------------
# compress


def _check_source(files: list[Path], all_weights: bool) -> int:
    """Refuses, before anything is written, what cannot be compressed and written back exactly.
    Returns the number of expert tensors."""
    from pagedmoe.codecs.lossless_io import METADATA_KEY
    from pagedmoe.models.compressed import check_reproducible, expert_proj, read_header

    num_experts = 0
    for file in files:
        raw, header = read_header(file)
        check_reproducible(file, raw, header)
        if METADATA_KEY in (header.get("__metadata__") or {}):
            raise ValueError(f"{file} is already compressed")
        for name, info in header.items():
            if name == "__metadata__" or expert_proj(name) is None:
                continue
            num_experts += 1
            if info.get("dtype") != "BF16":
                raise ValueError(
                    f"{file.name}: expert tensor {name!r} is {info.get('dtype')}; pagedmoe compress stores bf16 "
                    f"weights losslessly and does not convert (that would break the byte-exact round trip). "
                    f"Convert the checkpoint to bfloat16 first.")
    if num_experts == 0 and not all_weights:
        raise ValueError("no expert tensors found (names like model.layers.L.*.experts.E.PROJ.weight or "
                         "*.experts.gate_up_proj); pass --all-weights to compress every bf16 tensor")
    return num_experts


def _encode(name: str, t, layout, device, verify: bool, is_expert: bool = True):
    """layout: a LosslessLayout (format version 1), None for the tiled format (version 2), "hibyte" (version 3;
    a tensor whose shape it cannot hold: None, kept plain, or for an expert an error naming the shape)."""
    import torch

    from pagedmoe.codecs import hibyte, lossless, tiled
    from pagedmoe.models.compressed import decode, expert_num_parts

    x = t.to(device)
    # checksums are computed on the host by save_compressed
    parts = expert_num_parts(name, x.shape)
    if layout == "hibyte":
        try:
            ct = hibyte.encode(x, num_parts=parts, checksum=False)
        except ValueError as e:
            if not is_expert:
                return None
            raise ValueError(f"{name} {list(x.shape)}: {e}; --format tiled takes any shape") from None
    elif layout is None:
        ct = tiled.encode(x, num_parts=parts, checksum=False)
    else:
        ct = lossless.encode(x, num_parts=parts, layout=layout, checksum=False)
    if verify:
        y = decode(ct, device)  # the Triton decoder on CUDA, the reference on the CPU
        if not torch.equal(y.view(torch.int16), x.view(torch.int16)):
            raise RuntimeError(f"{name}: the encoded tensor does not decode to the original (encoder bug)")
    if device.type != "cpu":
        ct = ct.to("cpu")
        torch.cuda.synchronize(device)  # CompressedTensor.to copies non_blocking into pageable memory
    return ct


def compress_file(src: Path, dst: Path, *, all_weights: bool, layout, device, verify: bool,
                  stats: dict, progress=None) -> None:
    """One shard: expert tensors (with all_weights: every bf16 tensor that gets smaller) compressed,
    the rest kept, plus what decompress_file needs to write src back byte for byte."""
    import torch
    from safetensors import safe_open

    from pagedmoe.codecs.lossless_io import save_compressed
    from pagedmoe.models.compressed import (ORIGINAL_KEY, check_reproducible, expert_proj, original_record,
                                            read_header, sha256_file, tensor_kind)

    raw, header = read_header(src)
    spans = check_reproducible(src, raw, header)
    compressed, plain = {}, {}
    with ThreadPoolExecutor(1) as pool:
        digest = pool.submit(sha256_file, src)
        with safe_open(str(src), framework="pt", device="cpu") as f:
            for name, b, e in spans:
                t = f.get_tensor(name)
                is_expert = expert_proj(name) is not None
                ct = None
                if (is_expert or all_weights) and t.dtype == torch.bfloat16 and t.numel() > 0:
                    ct = _encode(name, t, layout, device, verify, is_expert)
                    if not is_expert and ct is not None and ct.nbytes >= e - b:
                        ct = None  # small tensors (norms): the codebook and lane lengths cost more
                if ct is None:
                    plain[name] = t
                else:
                    compressed[name] = ct
                row = stats[tensor_kind(name)]
                row[0] += 1
                row[1] += e - b
                row[2] += e - b if ct is None else ct.nbytes
                if progress is not None:
                    progress(e - b)
        meta = dict(header.get("__metadata__") or {})
        meta[ORIGINAL_KEY] = original_record(src, raw, digest.result())
    tmp = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_compressed(str(tmp), compressed, plain, metadata=meta)
    os.replace(tmp, dst)


def print_ratios(stats: dict, in_bytes: int, out_bytes: int, file=None) -> None:
    file = file or sys.stdout
    order = sorted(stats, key=lambda k: (not k.startswith("experts."), k))
    print(f"{'tensors':<24}{'count':>7}{'original':>14}{'stored':>14}{'ratio':>8}", file=file)
    total = [0, 0, 0]
    for kind in order:
        n, orig, stored = stats[kind]
        total = [total[0] + n, total[1] + orig, total[2] + stored]
        print(f"{kind:<24}{n:>7}{_size(orig):>14}{_size(stored):>14}{stored / max(orig, 1):>8.3f}", file=file)
    print(f"{'all tensors':<24}{total[0]:>7}{_size(total[1]):>14}{_size(total[2]):>14}"
          f"{total[2] / max(total[1], 1):>8.3f}", file=file)
    print(f"{'weight files on disk':<31}{_size(in_bytes):>14}{_size(out_bytes):>14}"
          f"{out_bytes / max(in_bytes, 1):>8.3f}", file=file)


def run_compress(args) -> int:
    from pagedmoe.codecs.lossless import LosslessLayout
    from pagedmoe.models.loader import checkpoint_files

    src, out = Path(args.model), Path(args.out)
    if args.fmt != "huffman" and args.max_code_len is not None:
        raise ValueError(f"--max-code-len sets the Huffman codes of --format huffman; the {args.fmt} format has none")
    layout = (None if args.fmt == "tiled" else "hibyte" if args.fmt == "hibyte"
              else LosslessLayout(max_code_len=args.max_code_len or 8))
    device = _resolve_device(args.device)
    files = checkpoint_files(str(src))
    _check_source(files, args.all_weights)
    created = not out.exists()
    prepare_out(out, src, args.force)
    with undone_on_failure(out, created):
        return _compress_into(args, src, out, files, layout, device)


def _compress_into(args, src: Path, out: Path, files: list[Path], layout, device) -> int:
    stats = defaultdict(lambda: [0, 0, 0])  # kind -> [tensors, original bytes, stored bytes]
    bar = _progress(sum(f.stat().st_size for f in files), f"Compressing on {device.type}")
    for file in files:
        bar.set_postfix_str(file.name)
        compress_file(file, out / file.relative_to(src), all_weights=args.all_weights, layout=layout,
                      device=device, verify=args.verify, stats=stats, progress=bar.update)
    bar.close()
    copied, skipped = copy_other_files(src, out, set(files), skip_weights=True)
    if skipped:
        print(f"not copied (weight files the loader does not read): {', '.join(skipped)}", file=sys.stderr)
    in_bytes = sum(f.stat().st_size for f in files)
    out_bytes = sum((out / f.relative_to(src)).stat().st_size for f in files)
    print(f"{len(files)} weight file(s) compressed into {out}; {len(copied)} other file(s) copied")
    print_ratios(stats, in_bytes, out_bytes)
    if args.precisions:
        write_lossy_forms(src, out, args.precisions, device)
    return 0


def write_lossy_forms(model: Path, out: Path, precisions, device) -> Path:
    """Every expert quantised offline (layout: experts/dynamic/offline.py OfflineForms): OUT/expert-lossy/<p>.safetensors
    and OUT/expert-lossy/quality.json (relative weight error per expert and precision). A subfolder, so
    the checkpoint loader (top-level *.safetensors) never reads them."""
    import torch

    from pagedmoe.engine.startup import load_model
    from pagedmoe.experts.dynamic.offline import offline_forms_of_store
    from pagedmoe.models.loader import load_hf_config
    from pagedmoe.planning.resolve import ExpertPlan

    hf = load_hf_config(str(model))
    # every expert in the host tier (its master rows), plain buffers: nothing is computed
    m = load_model(str(model), hf, "auto", 16, torch.device("cpu"), torch.bfloat16, 0,
                   ExpertPlan("paged", 0, buffers="plain"))
    folder = offline_forms_of_store(m.expert_store, precisions, out, device)
    print(f"lossy expert forms ({', '.join(precisions)}) written to {folder}")
    return folder


# ---------------------------------------------------------------------------------------------
# decompress


def run_decompress(args) -> int:
    from pagedmoe.models.compressed import decompress_file, written_by_compress
    from pagedmoe.models.loader import checkpoint_files

    src, out = Path(args.compressed), Path(args.out_dir)
    device = _resolve_device(args.device)
    ours = [f for f in checkpoint_files(str(src)) if written_by_compress(f)]
    if not ours:
        raise ValueError(f"{src} holds no shards written by `pagedmoe compress`")
    created = not out.exists()
    prepare_out(out, src, args.force)
    bar = _progress(sum(f.stat().st_size for f in ours), f"Decompressing on {device.type}")
    written = 0
    with undone_on_failure(out, created):   # a corrupt later shard leaves no earlier one behind
        for f in ours:
            bar.set_postfix_str(f.name)
            (out / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            written += decompress_file(f, out / f.relative_to(src), device)
            bar.update(f.stat().st_size)
        bar.close()
        copied, _ = copy_other_files(src, out, set(ours), skip_weights=False)
    print(f"{len(ours)} weight file(s) written to {out} ({_size(written)}, sha256 of each equal to the "
          f"original); {len(copied)} other file(s) copied")
    return 0
