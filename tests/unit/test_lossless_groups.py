"""codecs/lossless_groups.py: a stacked tensor encoded a group of parts at a time is bit-identical to the
whole-tensor encode's parts, and the device never holds more than a group's worth."""
from __future__ import annotations

import pytest
import torch

from peak_memory import PeakMemory
from pagedmoe.codecs.lossless import ARRAYS, LosslessLayout, decode_reference, encode
from pagedmoe.codecs.lossless_groups import encode_groups

SMALL = LosslessLayout(lanes=32, elems_per_lane=4)   # 128-element blocks: several blocks and chunks per part


def _weights(num_parts: int, part_size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_parts, part_size, generator=g) * 0.02).to(torch.bfloat16)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 3e38, 1e-39], dtype=torch.bfloat16)
    x.view(-1)[::53] = specials.repeat(x.numel() // 53 // 6 + 1)[:x.view(-1)[::53].numel()]
    x[1] *= 1000   # parts with different exponent statistics: the codebook is the whole tensor's
    return x


def _reader(x: torch.Tensor):
    return lambda p, a, b: x[p, a:b]


def _assert_parts_equal(got, want) -> None:
    for name in ARRAYS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.code_lengths, want.code_lengths) and got.fill_exponent == want.fill_exponent
    assert got.shape == want.shape and got.num_parts == want.num_parts and got.layout == want.layout


@pytest.mark.parametrize("part_size, groups, layout, read_elems, pack_elems", [
    (1000, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)], SMALL, 300, 256),      # short last blocks, one per group
    (1280, [(0, 2), (2, 3)], SMALL, 128, 128),                               # full blocks only
    (777, [(0, 5)], SMALL, 10_000, 10_000),                                  # one group, one read per part
    (3 * 16 * 8 * 30, [(0, 3), (3, 1), (4, 1)], LosslessLayout(), 2000, 1 << 20),  # the default layout
])
def test_groups_equal_the_whole_tensor_encode(part_size, groups, layout, read_elems, pack_elems):
    x = _weights(5, part_size)
    whole = encode(x, num_parts=5, layout=layout, checksum=False)
    got = encode_groups(_reader(x), 5, part_size, groups, device=x.device, layout=layout, read_elems=read_elems,
                        pack_elems=pack_elems, alloc=lambda shape, dtype: torch.full(shape, 7, dtype=dtype))
    assert len(got) == len(groups)
    for ct, (s0, k) in zip(got, groups):
        _assert_parts_equal(ct, whole.parts(s0, s0 + k))   # pad words included (the next group's first words)
        assert torch.equal(decode_reference(ct).view(k, part_size).view(torch.int16), x[s0:s0 + k].view(torch.int16))


def test_groups_of_parts_with_fewer_words_than_the_pad():
    """One exponent value in most parts: zero-length codes, parts of no words; a group's pad words then come
    from groups further on (or are the zeros after the last part)."""
    x = torch.full((6, 500), 0.5, dtype=torch.bfloat16)
    x[2, ::7] = 3.0
    x[4, :3] = 100.0
    groups = [(0, 1), (1, 1), (2, 1), (3, 2), (5, 1)]
    whole = encode(x, num_parts=6, layout=SMALL, checksum=False)
    got = encode_groups(_reader(x), 6, 500, groups, device=x.device, layout=SMALL, read_elems=64, pack_elems=128,
                        alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    for ct, (s0, k) in zip(got, groups):
        _assert_parts_equal(ct, whole.parts(s0, s0 + k))


def test_groups_are_views_of_one_host_tensor_per_array():
    x = _weights(4, 640)
    made = []

    def alloc(shape, dtype):
        made.append(torch.empty(shape, dtype=dtype))
        return made[-1]

    got = encode_groups(_reader(x), 4, 640, [(0, 1), (1, 3)], device=x.device, layout=SMALL, alloc=alloc)
    assert len(made) == len(ARRAYS)
    for name in ARRAYS:
        base = next(t for t in made if t.untyped_storage().data_ptr() ==
                    getattr(got[0], name).untyped_storage().data_ptr())
        assert sum(getattr(ct, name).numel() for ct in got) == base.numel()


def test_groups_must_cover_the_parts_in_order():
    x = _weights(3, 256)
    for groups in ([(0, 1), (2, 1)], [(0, 2), (1, 2)], [(0, 4)], [(0, 0), (0, 3)]):
        with pytest.raises(ValueError, match="do not cover"):
            encode_groups(_reader(x), 3, 256, groups, device=x.device, layout=SMALL,
                          alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype))


def test_device_memory_is_one_groups_worth():
    """What encode_groups allocates beside the host arrays stays within one group's exponents and stream plus
    the chunk temporaries, however many parts: the whole-tensor encode needs several times the tensor."""
    E, P, read_elems, pack_elems = 16, 3 * 1024, 512, 512
    x = _weights(E, P)
    with PeakMemory() as whole:
        encode(x, num_parts=E, layout=SMALL, checksum=False)
    probe = PeakMemory()

    def alloc(shape, dtype):
        with probe.excluded():
            return torch.empty(shape, dtype=dtype)

    with probe:
        encode_groups(_reader(x), E, P, [(p, 1) for p in range(E)], device=x.device, layout=SMALL,
                      read_elems=read_elems, pack_elems=pack_elems, alloc=alloc)
    # a group's exponents (1 B/weight), stream (< 1 B/weight), lane lengths (1.25 B/weight with 4 weights a
    # lane), ~100 B per packed and ~10 B per read element of a chunk, and 2 KiB of histogram per part
    bound = 4 * P + 160 * pack_elems + 16 * read_elems + 2048 * E
    assert probe.peak <= bound, (probe.peak, bound)
    assert whole.peak > 3 * bound and whole.peak > 2 * x.numel() * x.element_size()


@pytest.mark.gpu
def test_cuda_encode_is_bounded_and_bit_identical():
    """On the GPU, from pageable host rows (read through pinned buffers) into pinned arrays (the host tier's path):
    torch's peak allocation stays within one expert's exponents and stream plus the chunk temporaries (~0.35 GB
    here), where the whole-layer encode of the same 8 experts of GLM-4.5-Air's size (17.3M weights each) takes
    several GB."""
    from pagedmoe.codecs.lossless_groups import PACK_ELEMS, READ_ELEMS, rows_reader

    dev = torch.device("cuda")
    E, P = 8, 3 * 4096 * 1408
    x = _weights(E, P)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = encode_groups(rows_reader(x, dev), E, P, [(p, 1) for p in range(E)], device=dev,   # via pinned buffers
                        alloc=lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 2 * P + 160 * PACK_ELEMS + 16 * READ_ELEMS
    assert peak <= bound, (peak, bound)
    assert all(ct.raw.is_pinned() and ct.stream.is_pinned() for ct in got)
    x_dev = x.to(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    whole = encode(x_dev, num_parts=E, checksum=False)
    assert torch.cuda.max_memory_allocated() - base > 3 * bound
    for p, ct in enumerate(got):
        want = whole.parts(p, p + 1).to("cpu")
        torch.cuda.synchronize()   # CompressedTensor.to copies without blocking
        _assert_parts_equal(ct, want)
