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
