"""Triton lossless decoder against the original bits (and the PyTorch reference decoder).

CPU: the Triton interpreter runs a few small blocks, and the indexed variant (parts and rows named on the
device). GPU (@pytest.mark.gpu): the same, the indexed variant inside a CUDA graph, and a grid over
layouts, decode knobs, odd sizes, part ranges, all 65,536 bf16 patterns, an output that is a view
into a larger buffer, and the GPU encoder against the CPU encoder. All comparisons are
torch.equal on int16 views, with the output poisoned (NaN) before decoding.
"""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.codecs.lossless import LosslessLayout, decode_reference, encode  # noqa: E402
from pagedmoe.kernels.lossless_decode import lossless_decode, lossless_decode_indexed  # noqa: E402

CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bits(x):
    return x.view(torch.int16)


def decode_check(x, num_parts, layout, **kw):
    ct = encode(x, num_parts=num_parts, layout=layout)
    out = torch.full_like(x, float("nan"))
    lossless_decode(ct, out, **kw)
    assert torch.equal(bits(out), bits(x)), kw
    return ct


def all_patterns(device):
    return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)


# --- CPU (interpreter) -----------------------------------------------------------------------

cpu_only = pytest.mark.skipif(torch.cuda.is_available() or not CAN_RUN, reason="interpreter run on CPU machines")


@cpu_only
@pytest.mark.parametrize("size,parts,layout,short_bits", [
    (1, 1, LosslessLayout(16, 4, 12), 12),
    (3 * 16 * 4 + 5, 1, LosslessLayout(16, 4, 12), 6),  # full blocks and a short one, two-level table
    (2 * 301, 2, LosslessLayout(32, 8, 8), 8),  # short block at the end of each part
    (16 * 16 * 2, 1, LosslessLayout(16, 16, 10), 7),
    (2 * 700, 2, LosslessLayout(16, 32, 12), 8),  # int16 lane lengths
    (3 * 30720 // 2, 1, LosslessLayout(), 8),  # the default layout, a full and a short block
])
def test_interpreter_matches_original(size, parts, layout, short_bits):
    g = torch.Generator().manual_seed(size)
    x = (torch.randn(parts, size // parts, generator=g) * 0.02).bfloat16()
    x.view(-1)[::37] = float("nan")
    x.view(-1)[5::41] = -0.0
    decode_check(x, parts, layout, short_bits=short_bits)


@cpu_only
def test_interpreter_all_patterns_and_part_range():
    x = all_patterns("cpu")[torch.randperm(65536, generator=torch.Generator().manual_seed(0))].view(4, -1)
    ct = decode_check(x, 4, LosslessLayout(256, 16, 12), short_bits=8)
    out = torch.full((2, x.shape[1]), float("nan"), dtype=torch.bfloat16)
    lossless_decode(ct, out, parts=(1, 3))
    assert torch.equal(bits(out), bits(x[1:3]))


def check_rows_with_stride(device):
    """Parts land in the rows of a buffer padded past the part size (an expert compute buffer whose rows
    are rounded up to the VMM granularity): one launch, the padding and the rows outside untouched."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 1000, generator=g) * 0.02).bfloat16().to(device)  # 1000: no multiple of the block
    ct = encode(x, num_parts=5, layout=LosslessLayout(16, 8, 12))
    buf = torch.full((6, 1024 + 40), float("nan"), dtype=torch.bfloat16, device=device)
    lossless_decode(ct, buf[2:5, 3:1003], parts=(1, 4))
    assert torch.equal(bits(buf[2:5, 3:1003]), bits(x[1:4]))
    rest = buf.clone()
    rest[2:5, 3:1003] = float("nan")
    assert rest.isnan().all()  # nothing written outside the three rows' parts
    with pytest.raises(ValueError, match="one row per part"):
        lossless_decode(ct, buf[2:5, 3:1002], parts=(1, 4))  # rows shorter than a part


@cpu_only
def test_interpreter_rows_with_stride():
    check_rows_with_stride("cpu")


@pytest.mark.gpu
def test_gpu_rows_with_stride():
    check_rows_with_stride("cuda")


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or the Triton interpreter")
def test_launcher_checks_arguments():
    x = (torch.randn(2, 100) * 0.02).bfloat16().to(DEVICE)
    ct = encode(x, num_parts=2, layout=LosslessLayout(16, 4, 12))
    with pytest.raises(TypeError):
        lossless_decode(ct, torch.empty(2, 100, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        lossless_decode(ct, torch.empty(100, 2, dtype=torch.bfloat16, device=DEVICE).t())
    with pytest.raises(ValueError, match="elements"):
        lossless_decode(ct, torch.empty(2, 99, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="out of range"):
        lossless_decode(ct, torch.empty(100, dtype=torch.bfloat16, device=DEVICE), parts=(1, 3))
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="device"):
            lossless_decode(ct, torch.empty(2, 100, dtype=torch.bfloat16))


def check_indexed(device):
    """The indexed variant (routed fetching's path (b)): the parts and destination rows named by device tensors,
    -1 skipping an entry, decode the bits lossless_decode decodes into exactly those rows (the rest of every row,
    and the rows not named, untouched); parts of several blocks with a short last one, int32 and int64 indices."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 301, generator=g) * 0.02).bfloat16()
    x.view(-1)[::29] = float("nan")
    x = x.to(device)
    ct = encode(x, num_parts=6, layout=LosslessLayout(16, 8, 12))   # 128-element blocks: 3 per part, the last short
    ref = torch.full_like(x, float("nan"))
    lossless_decode(ct, ref)
    assert torch.equal(bits(ref), bits(x))
    for dtype in (torch.int32, torch.int64):
        pool = torch.full((10, 320), float("nan"), dtype=torch.bfloat16, device=device)
        parts = torch.tensor([5, 0, 3, 1, 4, 2], dtype=dtype, device=device)
        rows = torch.tensor([8, -1, 0, 4, -1, 9], dtype=dtype, device=device)
        lossless_decode_indexed(ct, pool, parts, rows)
        for p, r in zip(parts.tolist(), rows.tolist()):
            if r >= 0:
                assert torch.equal(bits(pool[r, :301]), bits(ref[p])), (p, r)
        named = [r for r in rows.tolist() if r >= 0]
        rest = pool.clone()
        rest[named, :301] = float("nan")
        assert rest.isnan().all()   # the padding past each part and the rows not named are untouched
    # nothing named: nothing written
    pool = torch.full((4, 301), float("nan"), dtype=torch.bfloat16, device=device)
    lossless_decode_indexed(ct, pool, torch.arange(6, device=device), torch.full((6,), -1, device=device))
    assert pool.isnan().all()
    with pytest.raises(ValueError, match="unit last stride"):
        lossless_decode_indexed(ct, pool[:, :300], torch.arange(2, device=device), torch.arange(2, device=device))
    with pytest.raises(ValueError, match="must be \\[n\\] alike"):
        lossless_decode_indexed(ct, pool, torch.arange(2, device=device), torch.arange(3, device=device))
    with pytest.raises(TypeError, match="int32 or int64"):
        lossless_decode_indexed(ct, pool, torch.arange(2, device=device).float(), torch.arange(2, device=device))
    with pytest.raises(TypeError, match="bf16"):
        lossless_decode_indexed(ct, pool.float(), torch.arange(2, device=device), torch.arange(2, device=device))


@cpu_only
def test_interpreter_indexed_decode():
    check_indexed("cpu")


@pytest.mark.gpu
def test_gpu_indexed_decode():
    check_indexed("cuda")


@pytest.mark.gpu
def test_gpu_indexed_decode_in_a_cuda_graph():
    """Captured once, the launch decodes whichever parts the index tensors name at replay (no host sync)."""
    x = (torch.randn(8, 70_001, device="cuda") * 0.02).bfloat16()
    ct = encode(x, num_parts=8)
    pool = torch.zeros(12, 70_016, dtype=torch.bfloat16, device="cuda")
    parts = torch.arange(8, device="cuda")
    rows = torch.full((8,), -1, dtype=torch.int64, device="cuda")
    lossless_decode_indexed(ct, pool, parts, rows)   # warm-up (compile)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lossless_decode_indexed(ct, pool, parts, rows)
    rows.copy_(torch.tensor([-1, 11, -1, 0, 5, -1, -1, 2]))
    pool.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for p, r in ((1, 11), (3, 0), (4, 5), (7, 2)):
        assert torch.equal(bits(pool[r, :70_001]), bits(x[p]))
    assert pool[[1, 3, 4, 6, 7, 8, 9, 10]].isnan().all() and pool[:, 70_001:].isnan().all()


# --- GPU -------------------------------------------------------------------------------------

LAYOUTS = [LosslessLayout(), LosslessLayout(512, 64, 12), LosslessLayout(32, 8, 15)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("size", [1, 4097, 3 * 32768, 3 * 1_500_001])
def test_gpu_matches_original(layout, size):
    g = torch.Generator(device="cuda").manual_seed(size)
    parts = 3 if size % 3 == 0 else 1
    x = (torch.randn(size, device="cuda", generator=g) * 0.02).bfloat16().view(parts, -1)
    x.view(-1)[::1001] = float("inf")
    x.view(-1)[3::1003] = 1e-40
    ct = encode(x, num_parts=parts, layout=layout)
    for sb in sorted({layout.max_code_len, 7}):
        for nw, un, td in [(4, 1, torch.int16), (8, 2, torch.int32)]:  # 8 warps: lanes < threads too
            out = torch.full_like(x, float("nan"))
            lossless_decode(ct, out, short_bits=sb, num_warps=nw, unroll=un, table_dtype=td)
            assert torch.equal(bits(out), bits(x)), (sb, nw, un, td)


@pytest.mark.gpu
@pytest.mark.parametrize("max_code_len", [8, 12])
def test_gpu_all_patterns_parts_and_views(max_code_len):
    x = all_patterns("cuda")[torch.randperm(65536, device="cuda")].view(8, -1)
    ct = decode_check(x, 8, LosslessLayout(128, 16, max_code_len))
    buf = torch.full((3 * x.shape[1] + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
    lossless_decode(ct, buf[1:], parts=(5, 8))  # a view at an odd offset (unaligned)
    assert torch.equal(bits(buf[1:]), bits(x[5:].reshape(-1))) and buf[0].isnan()
    assert torch.equal(bits(decode_reference(ct)), bits(x))


@pytest.mark.gpu
def test_gpu_encoder_equals_cpu_encoder():
    x = (torch.randn(4, 100_003) * 0.02).bfloat16()
    lay = LosslessLayout(512, 64, 12)
    a, b = encode(x, num_parts=4, layout=lay), encode(x.cuda(), num_parts=4, layout=lay)
    assert torch.equal(a.stream, b.stream.cpu()) and torch.equal(a.lane_bits, b.lane_bits.cpu())
    assert a.checksums == b.checksums


@pytest.mark.gpu
def test_gpu_constant_and_single_exponent():
    x = torch.full((5, 77_777), -2.0, dtype=torch.bfloat16, device="cuda")
    decode_check(x, 5, LosslessLayout())
    r = torch.randint(0, 256, (300_001,), device="cuda", dtype=torch.int32)
    b = ((r & 0x80) << 8) | (0x70 << 7) | (r & 0x7F)
    x = torch.where(b >= 32768, b - 65536, b).to(torch.int16).view(torch.bfloat16)
    decode_check(x, 1, LosslessLayout(512, 64, 12))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark (run_all.sh codec)")
def test_bench_codec_script_runs_on_cpu(tmp_path):
    """benchmarks/bench_codec.py's logic in the interpreter on 100k weights: the awkward-input checks, every
    variant it times checked bit-exact first, the size sweep and the encoder line, and its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/bench_codec.py", "--device", "cpu", "--quick", "--numel",
                           "100000", "--encode-shape", "2,64,128", "--out", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "bench_codec.json").read_text())
    assert res["failures"] == []
    assert len(res["variants"]) >= 2 and all(v["bit_exact"] for v in res["variants"])
    assert res["encode"]["bit_exact"] and len(res["size_sweep"]) == 1
    assert proc.stdout.count("check ") == 4
