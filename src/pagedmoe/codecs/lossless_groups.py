"""A stacked tensor (one part per expert) encoded a group of parts at a time, in bounded device memory, into
arrays the caller allocates (pinned host memory for the host tier, device memory for the compressed GPU tier):
exactly the arrays `encode(whole).parts(s0, s0 + k)` gives each group, without the whole tensor ever on the
device (nor, with groups smaller than it, its exponents).

Why: the compressed host tier encoded a whole layer on the device at once. For Mixtral-8x7B a layer's host
rows are N = 1.41e9 weights (8 experts of 176M): its bf16 copy on the device (2N bytes, 2.63 GiB), then, at
encode's peak (split_bf16 forming the raw bytes), three int16 temporaries and the exponents (7N bytes, measured
with tests/peak_memory.py): 9 bytes per weight, 11.8 GiB above the routed expert cache (15.5 GiB) and the
backbone (3 GiB): a start-up peak of 32.00 GiB under --gpu-memory-gb 24 (d4a254d). Here:

- pass 1 reads the parts a chunk at a time (`read(part, a, b)`: elements [a, b) of one part, as a bf16 tensor
  on the encoding device) for their exponent histograms, one row per part: the layer's codebook is their sum
  (the same as the whole tensor's), and each part's words, so every host array's size, follow from it before
  anything is encoded (a part's bits are the sum of its exponents' code lengths);
- pass 2 reads each group's parts again, keeps their exponents on the device (1 byte per weight), copies their
  raw bytes to the host array a chunk at a time, packs the group (pack_exponents) and copies its arrays out.

Device memory beyond the caller's: one group's exponents (k * part_size bytes), its stream (~0.33 bytes per
weight; at most 1 with 8-bit codes), its lane lengths (4/30 bytes per weight while int32), and the chunk
temporaries (~100 bytes per packed element, ~10 per read element). Mixtral-8x7B at the defaults: 176 MB +
58 MB + 23 MB + ~210 MB + ~20 MB, about 0.5 GB however many experts a layer has.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from pagedmoe.codecs.lossless import (Codebook, CompressedTensor, LosslessLayout, exponent_histogram, pack_exponents,
                                      split_bf16_into)

# Elements a read brings to the device at a time (what --load-format dummy generates at a time, too:
# experts/dummy.py), and blocks packed at a time (~2.1M elements, ~210 MB of pass 2's temporaries).
READ_ELEMS = 1 << 21
PACK_ELEMS = 1 << 21

Reader = Callable[[int, int, int], torch.Tensor]


def rows_reader(rows: torch.Tensor, device: torch.device, read_elems: int = READ_ELEMS) -> Reader:
    """A Reader of the rows [parts, >= part_size] of a host tensor (a tier's loading staging: pageable). On CUDA
    through two pinned buffers of `read_elems` in turn: the next read's host copy runs while the device copies
    the last one (every part is read twice; pageable copies had run at 1.5 GB/s on the H200 host)."""
    if device.type != "cuda" or rows.device.type != "cpu":
        return lambda p, a, b: rows[p, a:b].to(device)
    bufs = [torch.empty(read_elems, dtype=rows.dtype, pin_memory=True) for _ in range(2)]
    done: list = [None, None]   # the event after each buffer's last copy to the device
    turn = [0]

    def read(p: int, a: int, b: int) -> torch.Tensor:
        if b - a > read_elems:
            return rows[p, a:b].to(device)
        i = turn[0] = 1 - turn[0]
        if done[i] is not None:
            done[i].synchronize()   # NOTE: the buffer's last copy to the device has finished reading it
        buf = bufs[i][:b - a]
        buf.copy_(rows[p, a:b])
        out = torch.empty(b - a, dtype=rows.dtype, device=device)
        out.copy_(buf, non_blocking=True)
        done[i] = torch.cuda.Event()
        done[i].record()
        return out

    return read


def _chunks(part_size: int, read_elems: int):
    for a in range(0, part_size, read_elems):
        yield a, min(part_size, a + read_elems)


@torch.no_grad()
def part_histograms(read: Reader, num_parts: int, part_size: int, device: torch.device,
                    read_elems: int = READ_ELEMS) -> np.ndarray:
    """int64 [num_parts, 256]: each part's exponent counts (one host sync at the end)."""
    hist = torch.zeros(num_parts, 256, dtype=torch.int64, device=device)
    for p in range(num_parts):
        for a, b in _chunks(part_size, read_elems):
            bits = read(p, a, b).reshape(-1).view(torch.int16)
            hist[p] += exponent_histogram(((bits >> 7) & 0xFF).to(torch.uint8))
    return hist.cpu().numpy()


@torch.no_grad()
def encode_groups(read: Reader, num_parts: int, part_size: int, groups: list[tuple[int, int]], *,
                  device: torch.device, alloc: Callable[[tuple, torch.dtype], torch.Tensor],
                  layout: LosslessLayout = LosslessLayout(), read_elems: int = READ_ELEMS,
                  pack_elems: int = PACK_ELEMS) -> list[CompressedTensor]:
    """`groups` ((first part, parts) each, in order, covering every part once) of the tensor of `num_parts`
    parts of `part_size` bf16 elements that `read` gives, encoded with one codebook: a CompressedTensor per
    group, its arrays views into one tensor per array kind, made by `alloc(shape, dtype)` (pinned host memory
    for the host tier, device memory for the compressed GPU tier). Bit-identical to `encode(x, num_parts=num_parts, checksum=False).parts(s0, s0 + k)`, pad words
    included (a group's pad words are the words that follow it)."""
    if [s0 for s0, _ in groups] != list(np.cumsum([0] + [k for _, k in groups[:-1]])) or \
            sum(k for _, k in groups) != num_parts or any(k < 1 for _, k in groups):
        raise ValueError(f"groups {groups} do not cover the {num_parts} parts in order")
    hist = part_histograms(read, num_parts, part_size, device, read_elems)
    book = Codebook.of_histogram(hist.sum(0), layout.max_code_len)
    part_words = (hist @ book.lengths.astype(np.int64) + 31) // 32
    bpp, pad = -(-part_size // layout.block_elems), layout.pad_words
    words = [int(part_words[s0:s0 + k].sum()) for s0, k in groups]
    sizes = {"stream": [w + pad for w in words], "part_word_offsets": [k + 1 for _, k in groups],
             "block_bit_offsets": [k * bpp for _, k in groups],
             "lane_bits": [k * bpp * layout.lanes for _, k in groups], "raw": [k * part_size for _, k in groups]}
    dtypes = {"stream": torch.int32, "part_word_offsets": torch.int64, "block_bit_offsets": torch.int64,
              "lane_bits": layout.lane_bits_dtype, "raw": torch.uint8}
    views = {}
    for name, n in sizes.items():   # one host tensor per array kind (a few pinned registrations per layer)
        flat = alloc((sum(n),), dtypes[name])
        views[name] = list(torch.split(flat, n))
    chunk_blocks = max(1, pack_elems // layout.block_elems)
    out = []
    for g, (s0, k) in enumerate(groups):
        exps = torch.empty(k * part_size, dtype=torch.uint8, device=device)
        raw = views["raw"][g]
        for j in range(k):
            for a, b in _chunks(part_size, read_elems):
                bits = read(s0 + j, a, b).reshape(-1).view(torch.int16)
                o = j * part_size
                if raw.device.type == device.type:   # raw bytes straight into their array
                    split_bf16_into(bits, exps[o + a:o + b], raw[o + a:o + b])
                    continue
                r = torch.empty(b - a, dtype=torch.uint8, device=device)
                split_bf16_into(bits, exps[o + a:o + b], r)
                # NOTE: into pinned memory, asynchronous (stream-ordered: r's block is reused only after the copy);
                # the host reads the arrays after the synchronize below
                raw[o + a:o + b].copy_(r, non_blocking=True)
        stream, pwo, bbo, lane_bits = pack_exponents(exps, k, book, layout, chunk_blocks)
        del exps
        if stream.numel() != words[g] + pad:   # NOTE: the host arrays were sized from the histograms
            raise RuntimeError(f"group {g}: {stream.numel() - pad} words packed, {words[g]} counted")
        views["stream"][g][:words[g]].copy_(stream[:words[g]], non_blocking=True)
        for name, t in (("part_word_offsets", pwo), ("block_bit_offsets", bbo), ("lane_bits", lane_bits)):
            views[name][g].copy_(t.reshape(-1), non_blocking=True)
        out.append(CompressedTensor((k * part_size,), k, layout, torch.from_numpy(book.lengths), book.fill,
                                    views["stream"][g], views["part_word_offsets"][g], views["block_bit_offsets"][g],
                                    views["lane_bits"][g].view(k * bpp, layout.lanes), raw))
    if device.type == "cuda":
        torch.cuda.synchronize(device)   # every asynchronous copy into the arrays has landed
    # pad words: the whole tensor's words after each group's (zeros past the last part), as parts() slices them
    tail = torch.zeros(pad, dtype=torch.int32)
    for g in reversed(range(len(groups))):
        view = views["stream"][g]
        view[words[g]:].copy_(tail.to(view.device))
        tail = torch.cat([view[:words[g]][:pad].cpu(), tail])[:pad]
    return out
