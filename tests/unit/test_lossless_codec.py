"""Lossless bf16 codec (CPU): Huffman construction, encoder + reference decoder round trips,
checksums and the safetensors container. Every round trip compares int16 bit patterns with
torch.equal, so NaN payloads, infinities, subnormals and -0.0 must survive exactly."""
import heapq
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmoe.codecs import huffman
from pagedmoe.codecs.lossless import (CorruptCheckpointError, LosslessLayout, decode_reference, encode,
                                      verify)
from pagedmoe.codecs.lossless_io import METADATA_KEY, load_compressed, save_compressed

SMALL = [LosslessLayout(16, 4, 12), LosslessLayout(32, 8, 8), LosslessLayout(16, 16, 15), LosslessLayout(64, 3, 10)]


def bits(x):
    return x.view(torch.int16)


def roundtrip(x, num_parts=1, layout=LosslessLayout(32, 8, 12)):
    ct = encode(x, num_parts=num_parts, layout=layout)
    y = decode_reference(ct)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(bits(y), bits(x))
    return ct


def all_bf16_patterns():
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


# --- Huffman ---------------------------------------------------------------------------------


def huffman_cost(hist):
    heap = [(int(hist[s]), i, [s]) for i, s in enumerate(np.nonzero(hist)[0])]
    heapq.heapify(heap)
    depth, n = np.zeros(256, np.int64), len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        for s in a[2] + b[2]:
            depth[s] += 1
        heapq.heappush(heap, (a[0] + b[0], n, a[2] + b[2]))
        n += 1
    return depth


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=256, max_size=256), st.integers(8, 15))
def test_length_limited_codes_are_optimal_and_complete(counts, max_len):
    hist = np.array(counts, np.int64)
    lengths = huffman.code_lengths_from_histogram(hist, max_len).astype(np.int64)
    assert lengths.max(initial=0) <= max_len
    assert ((lengths > 0) == (hist > 0)).all() or (hist > 0).sum() <= 1
    if (hist > 0).sum() >= 2:
        huffman.check_lengths(lengths, max_len)  # complete prefix code (Kraft sum exactly 1)
        free = huffman_cost(hist)
        if free.max() <= max_len:  # the limit does not bind: same cost as plain Huffman
            assert (lengths * hist).sum() == (free * hist).sum()
        else:
            assert (lengths * hist).sum() >= (free * hist).sum()


def test_decode_table_is_prefix_lookup():
    hist = np.zeros(256, np.int64)
    hist[[0, 100, 120, 121, 255]] = [1, 50, 1000, 300, 2]
    lengths = huffman.code_lengths_from_histogram(hist, 12)
    codes = huffman.canonical_codes(lengths)
    for short in (4, 8, 12):
        table = huffman.decode_table(lengths, 12, short).numpy().astype(np.int64)
        for s in np.nonzero(lengths)[0]:
            l, c = int(lengths[s]), int(codes[s])
            full = table[(1 << short):] if short < 12 else table
            e = full[c << (12 - l)]
            assert (e >> 7, e & 15) == (s, l)
            if l <= short:
                assert table[c << (short - l)] == e
            else:
                assert table[c >> (l - short)] == huffman.LONG_MARKER


# --- round trips -----------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(size=st.integers(0, 3000), scale=st.sampled_from([1e-30, 1e-6, 0.006, 0.02, 1.0, 1e4, 1e30]),
       parts=st.sampled_from([1, 2, 3]), layout=st.sampled_from(SMALL), seed=st.integers(0, 2**31))
def test_roundtrip_normal_weights(size, scale, parts, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(parts, size, generator=g) * scale).bfloat16()
    roundtrip(x, num_parts=parts, layout=layout)


@pytest.mark.parametrize("layout", [LosslessLayout(256, 16, 12), LosslessLayout(64, 32, 8)])
def test_all_65536_bit_patterns(layout):
    x = all_bf16_patterns()
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))
    ct = roundtrip(x[perm], num_parts=4, layout=layout)
    assert ct.code_lengths.tolist() == [8] * 256  # uniform exponents: every code is 8 bits


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -3.5e-3, float("inf"), float("-inf"), float("nan"), 1e-40])
def test_constant_tensor(value):
    x = torch.full((1000,), value, dtype=torch.bfloat16)
    ct = roundtrip(x, layout=LosslessLayout(32, 8, 12))
    assert int(ct.part_word_offsets[-1]) == 0  # one exponent value: no code bits at all


@settings(max_examples=15, deadline=None)
@given(exponent=st.integers(0, 255), size=st.integers(1, 2000), seed=st.integers(0, 2**31))
def test_single_exponent_value(exponent, size, seed):
    g = torch.Generator().manual_seed(seed)
    sm = torch.randint(0, 256, (size,), generator=g, dtype=torch.int32)
    b = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    x = torch.where(b >= 32768, b - 65536, b).to(torch.int16).view(torch.bfloat16)
    roundtrip(x, layout=LosslessLayout(16, 8, 12))


@pytest.mark.parametrize("size", [0, 1, 2, 31, 32 * 8 - 1, 32 * 8, 32 * 8 + 1, 3 * 32 * 8 + 17])
def test_sizes_around_the_block(size):
    x = (torch.randn(size) * 0.02).bfloat16()
    roundtrip(x, layout=LosslessLayout(32, 8, 12))


def test_rare_and_special_exponents_in_normal_weights():
    x = (torch.randn(20000) * 0.02).bfloat16()
    x[::997] = float("nan")
    x[5::1009] = float("inf")
    x[7::1013] = -float("inf")
    x[11::1019] = 1e-40  # subnormal
    x[13::1021] = -0.0
    x[17::1031] = 3e38
    roundtrip(x, num_parts=4, layout=LosslessLayout(64, 8, 8))


def test_stacked_experts_decode_parts_independently():
    x = (torch.randn(5, 700) * 0.02).bfloat16()
    ct = encode(x, num_parts=5, layout=LosslessLayout(32, 8, 12))
    assert ct.part_word_offsets.shape == (6,) and len(ct.checksums) == 5
    assert torch.equal(bits(decode_reference(ct)), bits(x))


def test_chunked_packing_matches_one_chunk():
    x = (torch.randn(3, 5000) * 0.02).bfloat16()
    lay = LosslessLayout(32, 8, 12)
    a = encode(x, num_parts=3, layout=lay, chunk_blocks=1)
    b = encode(x, num_parts=3, layout=lay, chunk_blocks=10**6)
    assert torch.equal(a.stream, b.stream) and a.checksums == b.checksums


@pytest.mark.parametrize("layout,dtype", [(LosslessLayout(), torch.uint8), (LosslessLayout(32, 8, 8), torch.uint8),
                                          (LosslessLayout(64, 32, 8), torch.int16), (LosslessLayout(256, 64, 12), torch.int16)])
def test_lane_lengths_take_one_byte_when_they_fit(layout, dtype):
    assert layout.lane_bits_dtype == dtype
    x = (torch.randn(3, layout.block_elems + 7) * 0.02).bfloat16()  # a full and a short block per part
    assert roundtrip(x, num_parts=3, layout=layout).lane_bits.dtype == dtype


def test_default_layout_sizes_and_ratio():
    b = LosslessLayout().block_elems
    for size in (0, 1, b - 1, b, b + 1):
        roundtrip((torch.randn(size) * 0.02).bfloat16(), layout=LosslessLayout())
    ct = roundtrip((torch.randn(8 * b) * 0.02).bfloat16(), layout=LosslessLayout())
    assert 0.67 < ct.ratio < 0.695


def test_compression_ratio_on_gaussian_weights():
    x = (torch.randn(1 << 18) * 0.02).bfloat16()
    ct = roundtrip(x, layout=LosslessLayout(256, 64, 12))
    assert 0.66 < ct.ratio < 0.70


def test_rejects_wrong_inputs():
    with pytest.raises(TypeError):
        encode(torch.randn(10))
    with pytest.raises(ValueError):
        encode(torch.randn(10).bfloat16(), num_parts=3)
    with pytest.raises(ValueError):
        LosslessLayout(lanes=48)
    with pytest.raises(ValueError):
        LosslessLayout(max_code_len=7)


# --- checksums and files ---------------------------------------------------------------------


@pytest.mark.parametrize("field", ["stream", "raw", "lane_bits", "block_bit_offsets"])
def test_corruption_in_memory_names_the_part(field):
    x = (torch.randn(4, 2000) * 0.02).bfloat16()
    ct = encode(x, num_parts=4, layout=LosslessLayout(32, 8, 12))
    verify(ct, "w1")
    t = getattr(ct, field)
    idx = {"stream": int(ct.part_word_offsets[2]) + 1, "raw": 2 * 2000 + 5,
           "lane_bits": (2 * ct.blocks_per_part, 3), "block_bit_offsets": 2 * ct.blocks_per_part}[field]
    t[idx] += 1
    with pytest.raises(CorruptCheckpointError, match=r"w1: part 2"):
        verify(ct, "w1")


@pytest.mark.parametrize("stage_bytes", [1 << 27, 1000, 7])
def test_checksums_follow_the_format_whatever_the_staging_chunk(monkeypatch, stage_bytes):
    """crc32 per part as docs/formats.md defines it, written out here; compute_checksums reads the arrays
    in chunks (staged through pinned buffers on a GPU) that cut across parts and arrays."""
    import zlib

    from pagedmoe.codecs import lossless

    monkeypatch.setattr(lossless, "_STAGE_BYTES", stage_bytes)
    x = (torch.randn(3, 7001) * 0.02).bfloat16()
    ct = encode(x, num_parts=3, layout=LosslessLayout(64, 8, 12), checksum=False)
    assert ct.lane_bits.dtype == torch.uint8
    bpp, pwo = ct.blocks_per_part, ct.part_word_offsets.tolist()
    want = []
    for p in range(3):
        data = (bytes(ct.code_lengths.numpy().astype(np.uint8)) + bytes([ct.fill_exponent])
                + ct.block_bit_offsets[p * bpp:(p + 1) * bpp].numpy().astype("<i8").tobytes()
                + ct.lane_bits[p * bpp:(p + 1) * bpp].numpy().tobytes()  # uint8 here (K * L <= 255)
                + ct.stream[pwo[p]:pwo[p + 1]].numpy().astype("<i4").tobytes()
                + ct.raw[p * 7001:(p + 1) * 7001].numpy().tobytes())
        want.append(zlib.crc32(data))
    assert lossless.compute_checksums(ct) == tuple(want)


def test_file_roundtrip_and_corruption(tmp_path):
    x = (torch.randn(4, 3000) * 0.02).bfloat16()
    c = {"model.layers.0.mlp.experts.w1": encode(x, num_parts=4, layout=LosslessLayout(32, 8, 12)),
         "tiny": encode(torch.tensor([1.5], dtype=torch.bfloat16))}
    path = tmp_path / "c.safetensors"
    save_compressed(str(path), c, plain={"norm.weight": torch.ones(7)}, metadata={"model": "test"})
    got, plain = load_compressed(str(path))
    assert set(got) == set(c) and torch.equal(plain["norm.weight"], torch.ones(7))
    assert torch.equal(bits(decode_reference(got["model.layers.0.mlp.experts.w1"])), bits(x))
    assert got["tiny"].checksums == c["tiny"].checksums

    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + header_len])
    begin, _ = meta["model.layers.0.mlp.experts.w1.lx.raw"]["data_offsets"]
    data[8 + header_len + begin + 3 * 3000 + 17] ^= 0x01  # one bit of expert 3's raw bytes
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"mlp\.experts\.w1: part 3"):
        load_compressed(str(bad))


def test_file_with_edited_codebook_is_refused(tmp_path):
    x = (torch.randn(3000) * 0.02).bfloat16()
    path = tmp_path / "c.safetensors"
    save_compressed(str(path), {"w": encode(x, layout=LosslessLayout(32, 8, 12))})
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    info = json.loads(meta[METADATA_KEY])
    lengths = info["tensors"]["w"]["code_lengths"]
    a = next(i for i, l in enumerate(lengths) if l)
    b = next(i for i, l in enumerate(lengths) if l and l != lengths[a])
    lengths[a], lengths[b] = lengths[b], lengths[a]  # still a valid code, a different mapping
    meta[METADATA_KEY] = json.dumps(info)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CorruptCheckpointError, match="w: part 0"):
        load_compressed(str(path))


def test_not_a_lossless_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "plain.safetensors"
    save_file({"a": torch.ones(2)}, str(path))
    with pytest.raises(CorruptCheckpointError, match="not a pagedmoe lossless file"):
        load_compressed(str(path))
    path.write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError):
        load_compressed(str(path))


def test_part_decodes_alone_to_the_same_bits():
    """CompressedTensor.part(p): one part as its own tensor (rebased bit offsets, its words plus the pad)
    decodes to exactly that part's bf16 bits, for every part, including a constant one."""
    from pagedmoe.codecs.lossless import decode_reference, encode

    x = (torch.randn(4, 5000) * 0.02).to(torch.bfloat16)
    x[2] = 0.5  # a part of one exponent value
    ct = encode(x, num_parts=4, checksum=False)
    for p in range(4):
        part = ct.part(p)
        assert part.num_parts == 1 and part.shape == (5000,)
        assert torch.equal(decode_reference(part).view(torch.int16), x[p].view(torch.int16))
    with pytest.raises(IndexError):
        ct.part(4)
    # parts(p0, p1): a run of parts as one tensor (a group of the compressed host tier)
    for p0, p1 in ((0, 4), (1, 3), (2, 4)):
        run = ct.parts(p0, p1)
        assert run.num_parts == p1 - p0 and run.part_size == 5000
        assert torch.equal(decode_reference(run).view(torch.int16).view(p1 - p0, -1), x[p0:p1].view(torch.int16))
    with pytest.raises(IndexError):
        ct.parts(2, 2)
