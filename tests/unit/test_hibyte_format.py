"""Lossless bf16 candidate version 3 ("hibyte", codecs/hibyte.py): bit-exact round trips, raw tiles, sizes."""
import pytest
import torch

from pagedmoe.codecs import hibyte


def _same(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_every_bf16_pattern_round_trips_coded_and_raw():
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(1024, 64)
    h = hibyte.encode(every)
    assert _same(hibyte.decode_reference(h), every) and h.raw_tile_share == 0.0  # one high byte a row
    shuffled = every.reshape(-1)[torch.randperm(65536, generator=torch.Generator().manual_seed(0))].reshape(1024, 64)
    h = hibyte.encode(shuffled, num_parts=4)   # NaNs, infinities, zeros, subnormals in every tile
    assert _same(hibyte.decode_reference(h), shuffled) and h.raw_tile_share == 1.0


@pytest.mark.parametrize("parts,shape", [(1, (32, 128)), (3, (3, 48, 192)), (2, (2, 16, 64))])
def test_gaussian_weights_round_trip_with_a_few_raw_tiles(parts, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    x.view(-1)[5] = 0.0            # an exponent far outside the row's window: its tile goes raw
    x.view(-1)[7] = -3.0e-30
    h = hibyte.encode(x, num_parts=parts)
    assert _same(hibyte.decode_reference(h), x)
    assert hibyte.decode_reference(h).shape == x.shape
    assert h.tile_raw[0].item() == 0 and 0 < h.raw_tile_share < 1
    # bytes: 1 + 1/2 per weight, a byte a row, 4 per tile, 16 x 32 per raw tile
    R, C = x.numel() // shape[-1], shape[-1]
    tiles = R // 16 * (C // 64)
    assert h.nbytes == R * C + R * C // 2 + R + 4 * tiles + 512 * h.high.shape[0]


def test_ratio_on_gaussian_weights():
    x = (torch.randn(4, 256, 4096, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    h = hibyte.encode(x, num_parts=4)
    assert _same(hibyte.decode_reference(h), x)
    assert 0.76 < h.ratio < 0.78 and 0.05 < h.raw_tile_share < 0.10   # measured 0.771, 7.5% raw tiles


def test_shapes_it_refuses():
    with pytest.raises(ValueError, match="multiple of 64 columns"):
        hibyte.encode(torch.zeros(16, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="parts of a multiple of 16 rows"):
        hibyte.encode(torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        hibyte.encode(torch.zeros(16, 64))


@pytest.mark.parametrize("parts,shape", [(1, (32, 128)), (3, (3, 48, 192))])
def test_tile_major_order_holds_the_same_bytes_and_decodes_bit_for_bit(parts, shape):
    # the engine's fused-hibyte tier holds this order alone: it must decode, size, check and checksum as the rows do
    from pagedmoe.codecs.lossless import CorruptCheckpointError

    g = torch.Generator().manual_seed(7 + parts)
    x = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    x.view(-1)[[9, 3000]] = 1e-30     # raw tiles among coded ones
    h = hibyte.encode(x, num_parts=parts)
    t = hibyte.to_tile_major(h)
    assert t.order == "tile_major" and t.code.numel() == 0 and h.order == "rows" and 0 < t.raw_tile_share < 1
    assert _same(hibyte.decode_reference(t), x) and hibyte.decode_reference(t).shape == x.shape
    assert (t.nbytes, t.ratio, t.part_rows, t.tiles_per_part) == (h.nbytes, h.ratio, h.part_rows, h.tiles_per_part)
    # tile (row block b, slice s), row r: 64 low bytes then 32 code bytes, 1536 bytes a tile
    b, s, r = 1, 1, 5
    row = 16 * b + r
    assert torch.equal(t.lo[b, s, r], torch.cat([h.lo[row, 64 * s:64 * s + 64], h.code[row, 32 * s:32 * s + 32]]))
    back = hibyte.to_rows(t)
    assert all(torch.equal(getattr(back, a), getattr(h, a)) for a in hibyte.ARRAYS) and back.order == "rows"
    # the checksums are the row order's, whichever order is held; the array checks and verify take either
    assert hibyte.compute_checksums(t) == h.checksums == t.checksums
    hibyte.check_arrays(t)
    hibyte.verify(t)
    assert t.to("cpu").order == "tile_major"
    t.lo[1, 1, 3, 70] ^= 1        # a code byte of the first part's rows 16-31
    with pytest.raises(CorruptCheckpointError, match="crc32"):
        hibyte.verify(t)


@pytest.mark.parametrize("order", hibyte.ORDERS)
def test_encoding_a_few_parts_at_a_time_gives_the_same_bytes(order, monkeypatch):
    # the engine encodes a layer's experts a chunk at a time (the whole layer's temporaries overran the budget): raw
    # tiles in the first, a middle and the last part, so the joined raw-tile indices must be shifted right
    x = (torch.randn(5, 32, 128, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    x[0, 0, 1] = x[2, 17, 70] = x[4, 31, 127] = 1e-30
    whole = hibyte.encode(x, num_parts=5)
    sizes = []
    encode_rows = hibyte._encode_rows
    monkeypatch.setattr(hibyte, "_encode_rows", lambda rows, k: sizes.append(rows.numel()) or encode_rows(rows, k))
    chunked = hibyte.encode(x, num_parts=5, order=order, chunk_weights=2 * 32 * 128 + 1)
    assert sizes == [2 * 32 * 128, 2 * 32 * 128, 32 * 128]   # parts 2 + 2 + 1: no chunk above the bound
    want = hibyte.to_tile_major(whole) if order == "tile_major" else whole
    assert chunked.order == order and chunked.shape == x.shape and chunked.num_parts == 5
    assert all(torch.equal(getattr(chunked, a), getattr(want, a)) for a in hibyte.ARRAYS)
    assert chunked.checksums == whole.checksums and whole.high.shape[0] >= 3
    assert _same(hibyte.decode_reference(chunked), x)
    sizes.clear()    # a part larger than the bound is encoded alone
    hibyte.encode(x, num_parts=5, chunk_weights=10)
    assert sizes == [32 * 128] * 5
    with pytest.raises(ValueError, match="order"):
        hibyte.encode(x, num_parts=5, order="columns")


def test_tile_major_tensor_is_written_in_the_row_order(tmp_path):
    from pagedmoe.codecs.lossless_io import load_compressed, save_compressed

    x = (torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    h = hibyte.encode(x, num_parts=2, checksum=False)
    save_compressed(str(tmp_path / "a.safetensors"), {"w": hibyte.to_tile_major(h)})
    loaded, _ = load_compressed(str(tmp_path / "a.safetensors"))
    assert loaded["w"].order == "rows" and torch.equal(loaded["w"].lo, h.lo) and torch.equal(loaded["w"].code, h.code)
    assert _same(hibyte.decode_reference(loaded["w"]), x)
