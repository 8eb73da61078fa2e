"""Lossless bf16, version 2 (codecs/tiled.py, CPU): round trips bit for bit (torch.equal on int16 patterns,
so NaN payloads, infinities, subnormals and -0.0 must survive), escapes, checksums, the container, and the
refusal of one version by a reader of the other."""
import json
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmoe.codecs import tiled
from pagedmoe.codecs.lossless import CorruptCheckpointError, LosslessLayout
from pagedmoe.codecs.lossless import encode as encode_v1
from pagedmoe.codecs.lossless_io import METADATA_KEY, load_compressed, save_compressed


def bits(x):
    return x.view(torch.int16)


def roundtrip(x, num_parts=1):
    tt = tiled.encode(x, num_parts=num_parts)
    tiled.check_arrays(tt)
    tiled.verify(tt)
    y = tiled.decode_reference(tt)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(bits(y), bits(x))
    return tt


def from_bits(b):
    return torch.where(b >= 32768, b - 65536, b).to(torch.int16).view(torch.bfloat16)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 200), parts=st.sampled_from([1, 2, 3]),
       scale=st.sampled_from([1e-30, 1e-6, 0.02, 1.0, 1e30]), seed=st.integers(0, 2**31))
def test_roundtrip_normal_weights(rows, cols, parts, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(parts, rows, cols, generator=g) * scale).bfloat16()
    roundtrip(x, num_parts=parts)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 150), seed=st.integers(0, 2**31))
def test_roundtrip_random_bit_patterns(rows, cols, seed):
    # uniform exponents: most elements escape, several per tile, in every tile of the tensor
    g = torch.Generator().manual_seed(seed)
    roundtrip(from_bits(torch.randint(0, 65536, (2 * rows, cols), generator=g)), num_parts=2)


def test_all_65536_bit_patterns():
    x = from_bits(torch.arange(65536))
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(0))
    tt = roundtrip(x[perm].view(4, 128, 128), num_parts=4)
    assert tiled.escape_rate(tt) > 0.85  # about 15 of 256 exponents fit a row's window


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -3.5e-3, float("inf"), float("-inf"), float("nan"), 1e-40])
def test_constant_tensor(value):
    tt = roundtrip(torch.full((20, 33), value, dtype=torch.bfloat16))
    assert tt.escapes.numel() == 0


@pytest.mark.parametrize("shape", [(), (1,), (5,), (1, 1), (17, 1), (16, 64), (17, 65), (3, 0), (0, 4), (2, 31, 127)])
def test_shapes_around_the_tile(shape):
    roundtrip((torch.randn(shape) * 0.02).bfloat16(), num_parts=shape[0] if len(shape) == 3 else 1)


def test_rare_and_special_exponents_in_normal_weights():
    x = (torch.randn(4, 50, 100) * 0.02).bfloat16()
    flat = x.view(-1)
    flat[::997] = float("nan")
    flat[5::1009] = float("inf")
    flat[7::1013] = -float("inf")
    flat[11::1019] = 1e-40  # subnormal
    flat[13::1021] = -0.0
    flat[17::1031] = 3e38
    tt = roundtrip(x, num_parts=4)
    assert tt.escapes.numel() >= 5 * 19  # NaN, +-inf, subnormals, 3e38 (and -0.0) lie outside every window


def test_gaussian_ratio_and_escapes():
    x = (torch.randn(512, 1024) * 0.02).bfloat16()
    tt = roundtrip(x)
    assert 0.75 < tt.ratio < 0.755
    assert tiled.escape_rate(tt) < 5e-4


def test_escapes_are_grouped_by_tile():
    """escape_offsets[t] .. [t + 1] hold exactly the escapes of tile t (tiles column-major in a part), so a
    GEMM's weight tile finds its escapes without looking at any other tile's."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 40, 150, generator=g) * 0.02).bfloat16()
    x.view(-1)[::37] = 1e-30  # far below every row's window
    tt = tiled.encode(x, num_parts=3)
    e = tt.escapes.to(torch.int64)
    exps = (bits(x).to(torch.int64) >> 7 & 0xFF).view(120, 150)
    for t in range(tt.num_tiles):
        p, rest = divmod(t, tt.tiles_per_part)
        tc, tr = divmod(rest, tt.tile_rows_per_part)
        rows = range(tr * 16, min(tr * 16 + 16, 40))
        cols = range(tc * 64, min(tc * 64 + 64, 150))
        want = [(r, c) for r in rows for c in cols
                if not 0 <= int(exps[p * 40 + r, c]) - int(tt.base[p * 40 + r]) < 15]
        got = e[int(tt.escape_offsets[t]):int(tt.escape_offsets[t + 1])]
        assert [(int(v >> 14), tc * 64 + int(v >> 8 & 63)) for v in got] == want
        assert all(int(v & 255) == int(exps[p * 40 + r, c]) for v, (r, c) in zip(got, want))


def test_rejects_wrong_inputs():
    with pytest.raises(TypeError):
        tiled.encode(torch.randn(10))
    with pytest.raises(ValueError, match="num_parts"):
        tiled.encode(torch.randn(10, 4).bfloat16(), num_parts=3)


# --- checksums and files ---------------------------------------------------------------------


@pytest.mark.parametrize("field", tiled.ARRAYS)
def test_corruption_in_memory_names_the_part(field):
    x = (torch.randn(4, 40, 100) * 0.02).bfloat16()
    x.view(-1)[::53] = 1e-30  # escapes in every part
    tt = tiled.encode(x, num_parts=4)
    tiled.verify(tt, "w1")
    t = getattr(tt, field)
    idx = {"base": 2 * 40 + 1, "nibbles": (2 * 40 + 3, 7), "raw": 2 * 4000 + 5,
           "escape_offsets": 2 * tt.tiles_per_part + 1,
           "escapes": int(tt.escape_offsets[2 * tt.tiles_per_part]) + 1}[field]
    t[idx] += 1
    with pytest.raises(CorruptCheckpointError, match=r"w1: part 2"):
        tiled.verify(tt, "w1")


@pytest.mark.parametrize("stage_bytes", [1 << 27, 1000, 7])
def test_checksums_follow_the_format(monkeypatch, stage_bytes):
    """crc32 per part as docs/formats.md (version 2) defines it, written out here."""
    from pagedmoe.codecs import lossless

    monkeypatch.setattr(lossless, "_STAGE_BYTES", stage_bytes)
    x = (torch.randn(3, 37, 130) * 0.02).bfloat16()
    x.view(-1)[::41] = 1e-30
    tt = tiled.encode(x, num_parts=3, checksum=False)
    tpp, off = tt.tiles_per_part, tt.escape_offsets.tolist()
    want = []
    for p in range(3):
        data = (tt.base[p * 37:(p + 1) * 37].numpy().tobytes() + tt.nibbles[p * 37:(p + 1) * 37].numpy().tobytes()
                + tt.escape_offsets[p * tpp:(p + 1) * tpp + 1].numpy().astype("<i4").tobytes()
                + tt.escapes[off[p * tpp]:off[(p + 1) * tpp]].numpy().astype("<i4").tobytes()
                + tt.raw[p * 37 * 130:(p + 1) * 37 * 130].numpy().tobytes())
        want.append(zlib.crc32(data))
    assert tiled.compute_checksums(tt) == tuple(want)


def test_file_roundtrip_and_corruption(tmp_path):
    x = (torch.randn(4, 30, 100) * 0.02).bfloat16()
    c = {"model.layers.0.mlp.experts.w1": tiled.encode(x, num_parts=4),
         "tiny": tiled.encode(torch.tensor([1.5], dtype=torch.bfloat16))}
    path = tmp_path / "c.safetensors"
    save_compressed(str(path), c, plain={"norm.weight": torch.ones(7)}, metadata={"model": "test"})
    got, plain = load_compressed(str(path))
    assert set(got) == set(c) and torch.equal(plain["norm.weight"], torch.ones(7))
    assert isinstance(got["tiny"], tiled.TiledTensor)
    assert torch.equal(bits(tiled.decode_reference(got["model.layers.0.mlp.experts.w1"])), bits(x))
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    assert json.loads(meta[METADATA_KEY])["version"] == 2
    tensors["model.layers.0.mlp.experts.w1.lx.raw"][3 * 3000 + 17] ^= 0x01  # one bit of expert 3's raw bytes
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    with pytest.raises(CorruptCheckpointError, match=r"mlp\.experts\.w1: part 3"):
        load_compressed(str(bad))


def test_bad_escape_metadata_is_refused(tmp_path):
    """Offsets that do not index the escapes are refused before any checksum or decode."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    x = (torch.randn(32, 64) * 0.02).bfloat16()
    x[0, 0] = 1e-30
    path = tmp_path / "c.safetensors"
    save_compressed(str(path), {"w": tiled.encode(x)})
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors["w.lx.escape_offsets"][-1] += 5
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CorruptCheckpointError, match="escape offsets"):
        load_compressed(str(path))


def test_each_version_reader_refuses_the_other(tmp_path):
    x = (torch.randn(2, 16, 64) * 0.02).bfloat16()
    v1, v2 = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    save_compressed(str(v1), {"w": encode_v1(x, num_parts=2, layout=LosslessLayout(32, 8, 12))})
    save_compressed(str(v2), {"w": tiled.encode(x, num_parts=2)})
    with pytest.raises(CorruptCheckpointError, match=r"v2.safetensors: format pagedmoe-lossless-bf16 v2, "
                                                     r"this reader takes pagedmoe-lossless-bf16 v1$"):
        load_compressed(str(v2), versions=(1,))
    with pytest.raises(CorruptCheckpointError, match=r"v1, this reader takes pagedmoe-lossless-bf16 v2$"):
        load_compressed(str(v1), versions=(2,))
    both = {n: load_compressed(str(p))[0]["w"] for n, p in (("v1", v1), ("v2", v2))}
    assert both["v1"].version == 1 and both["v2"].version == 2
    with pytest.raises(ValueError, match="one format version"):
        save_compressed(str(tmp_path / "mixed.safetensors"), {"a": both["v1"], "b": both["v2"]})


def test_v1_decoder_refuses_a_tiled_tensor():
    pytest.importorskip("triton")
    from pagedmoe.kernels.lossless_decode import lossless_decode

    tt = tiled.encode((torch.randn(16, 64) * 0.02).bfloat16())
    with pytest.raises(ValueError, match="version 2"):
        lossless_decode(tt, torch.empty(16, 64, dtype=torch.bfloat16))


def test_encoder_chunks_do_not_change_the_bytes(monkeypatch):
    x = (torch.randn(2, 100, 70) * 0.02).bfloat16()
    x.view(-1)[::29] = 1e-30
    a = tiled.encode(x, num_parts=2)
    monkeypatch.setattr(tiled, "_CHUNK_ELEMS", 1)  # 16 rows at a time
    b = tiled.encode(x, num_parts=2)
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in tiled.ARRAYS) and a.checksums == b.checksums
    assert np.array_equal(a.escape_offsets.numpy(), b.escape_offsets.numpy())


def test_parts_with_more_rows_than_an_entry_holds():
    """Escape entries keep a row mod 2**17; a part of 140,000 rows (an embedding, --all-weights) decodes its
    escapes past row 131,072 to their own rows, not to the rows 2**17 earlier."""
    x = (torch.randn(140_000, 3) * 0.02).bfloat16()
    for r in (5, 131_072 + 5, 131_072 + 16 * 3 + 2, 139_999):
        x[r, 1] = 1e-30
    tt = roundtrip(x)
    _, col, grow = tiled._escape_positions(tt)
    assert {131_077, 131_122, 139_999, 5} <= set(grow.tolist())
