"""Lossy expert formats (codecs/quant.py): round-trip error bounds, int4 packing, odd shapes, byte accounting."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedmoe.codecs.quant import (INT4_GROUP, bytes_of, dequantize, dequantize_expert, expert_bytes, fake_quantize,
                                   pack_int4, quantize, quantize_expert, unpack_int4)

BOUNDS = {"fp8": 0.05, "int8": 0.01, "int4": 0.15}   # relative Frobenius error on N(0, 0.02) weights


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def weights(n, k, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("precision", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("shape", [(128, 384), (384, 64), (96, 200), (33, 129), (7, 1)])
def test_round_trip_error_bound(precision, shape):
    w = weights(*shape)
    qt = quantize(w, precision)
    back = dequantize(qt, torch.float32)
    assert back.shape == w.shape and back.dtype == torch.float32
    if shape[1] > 1:
        assert rel_err(back, w) < BOUNDS[precision]
    assert qt.nbytes == bytes_of(precision, shape)


def test_errors_ordered_and_not_trivial():
    w = weights(256, 512, seed=1)
    errs = {p: rel_err(fake_quantize(w, p), w) for p in ("int8", "fp8", "int4")}
    # int8 per channel (7 bits of mantissa-equivalent) < fp8 e4m3 (3 mantissa bits) < int4.
    assert 0 < errs["int8"] < errs["fp8"] < errs["int4"]
    assert errs["int4"] > 0.05  # the bound above is not vacuous


@pytest.mark.parametrize("precision", ["bf16", "lossless"])
def test_exact_rungs_are_identity(precision):
    w = weights(64, 128)
    assert torch.equal(fake_quantize(w, precision), w)


def test_int8_and_fp8_scale_per_output_channel():
    w = weights(16, 256).float()
    w[3] *= 100.0                      # one loud channel must not hurt the others
    for p in ("int8", "fp8"):
        qt = quantize(w, p)
        assert qt.scales.shape == (16, 1)
        back = dequantize(qt)
        quiet = torch.ones(16, dtype=torch.bool)
        quiet[3] = False
        assert rel_err(back[quiet], w[quiet]) < BOUNDS[p]
        assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)  # the max is exact


def test_int8_values_exact_on_grid():
    # Values already on the int8 grid of their channel round-trip exactly.
    scale = torch.tensor([[0.01], [0.5]])
    q = torch.randint(-127, 128, (2, 300), generator=torch.Generator().manual_seed(3)).float()
    q[:, 0] = 127
    w = q * scale
    qt = quantize(w, "int8")
    assert torch.equal(qt.data.float(), q)
    assert torch.allclose(dequantize(qt), w, rtol=0, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_int4_pack_unpack_exact(n, k, seed):
    q = torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (n, (k + 1) // 2)
    assert torch.equal(unpack_int4(packed, k), q)


def test_int4_nibble_order():
    q = torch.tensor([[-8, 7, 0]], dtype=torch.int8)
    # element 0 -> low nibble of byte 0 (0), element 1 -> high nibble (15); the odd tail pads with 8 (zero).
    assert pack_int4(q).tolist() == [[0 | (15 << 4), 8 | (8 << 4)]]


def test_int4_groups_and_partial_last_group():
    k = 2 * INT4_GROUP + 40          # two full groups and one of 40
    w = weights(8, k, seed=5).float()
    w[:, -40:] *= 0.001              # a quiet last group gets its own small scale
    qt = quantize(w, "int4")
    assert qt.scales.shape == (8, 3)
    torch.testing.assert_close(qt.scales[:, 2], w[:, -40:].abs().amax(1) / 7)
    back = dequantize(qt)
    assert rel_err(back[:, -40:], w[:, -40:]) < BOUNDS["int4"]
    assert rel_err(back, w) < BOUNDS["int4"]
    # each group's max magnitude is on the grid exactly
    for g0 in range(0, k, INT4_GROUP):
        seg = slice(g0, min(k, g0 + INT4_GROUP))
        torch.testing.assert_close(back[:, seg].abs().amax(1), w[:, seg].abs().amax(1))


def test_zero_weights():
    w = torch.zeros(4, 130)
    for p in ("fp8", "int8", "int4"):
        assert torch.equal(dequantize(quantize(w, p)), w)


def test_bytes_by_hand():
    assert bytes_of("bf16", (128, 384)) == 98304
    assert bytes_of("int8", (128, 384)) == 128 * 384 + 4 * 128
    assert bytes_of("fp8", (384, 64)) == 384 * 64 + 4 * 384
    assert bytes_of("int4", (128, 384)) == 128 * 192 + 4 * 128 * 3
    assert bytes_of("int4", (384, 64)) == 384 * 32 + 4 * 384 * 1     # one partial group
    assert bytes_of("int4", (2, 129)) == 2 * 65 + 4 * 2 * 2
    with pytest.raises(ValueError):
        bytes_of("lossless", (2, 2))
    # Mixtral-shaped expert: int4 with its scales is ~26.6% of bf16, int8 ~50%.
    h, i = 4096, 14336
    assert 0.25 < expert_bytes("int4", h, i) / expert_bytes("bf16", h, i) < 0.28
    assert 0.50 <= expert_bytes("int8", h, i) / expert_bytes("bf16", h, i) < 0.51


def test_expert_round_trip():
    h, i = 96, 40
    w13, w2 = weights(2 * i, h, 7), weights(h, i, 8)
    for p in ("fp8", "int8", "int4"):
        qe = quantize_expert(w13, w2, p)
        assert qe.nbytes == expert_bytes(p, h, i)
        a, b = dequantize_expert(qe, torch.bfloat16)
        assert a.dtype == torch.bfloat16 and a.shape == w13.shape and b.shape == w2.shape
        assert rel_err(a, w13) < BOUNDS[p] and rel_err(b, w2) < BOUNDS[p]


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 2, 2), "int8")
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 2), "int2")
