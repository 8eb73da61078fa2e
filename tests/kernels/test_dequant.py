"""Triton dequantisation into compute-buffer rows (kernels/dequant.py) against the PyTorch reference
(codecs/quant.py::dequantize): bit-identical, rows scattered to non-consecutive experts, odd K and a short
last int4 group, the rest of the buffer untouched. CPU: the Triton interpreter (int8, int4, into a float32
buffer: the interpreter's bf16 cast truncates instead of rounding to nearest even); GPU: every format into
bf16 and float32 buffers."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.codecs.quant import dequantize, quantize  # noqa: E402
from pagedmoe.kernels.dequant import dequantize_into  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRECISIONS = ["int8", "int4"] + (["fp8"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _stack(parts):
    from pagedmoe.experts.tiers.quantized import stack_quantized as stack

    return stack(parts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("N,K", [(6, 40), (5, 300), (4, 129)])
def test_dequantize_into_rows_matches_reference(precision, N, K, dtype):
    g = torch.Generator().manual_seed(N * K)
    weights = [torch.randn(N, K, generator=g) * 0.05 for _ in range(3)]
    parts = [quantize(w.to(DEVICE), precision) for w in weights]
    qt = _stack(parts)
    E, stride, lo = 5, N * K + 64, 32
    ids = [4, 0, 2]  # not consecutive, not sorted
    out = torch.full((E, stride), float("nan"), dtype=dtype, device=DEVICE)
    bases = torch.tensor([e * stride + lo for e in ids], dtype=torch.int64, device=DEVICE)
    dequantize_into(qt, out, bases)
    for e, p in zip(ids, parts):
        ref = dequantize(p, dtype).reshape(-1)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(out[e, lo:lo + N * K].view(bits), ref.view(bits))
        assert out[e, :lo].isnan().all() and out[e, lo + N * K:].isnan().all()
    for e in set(range(E)) - set(ids):
        assert out[e].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,block_k", [(6, 40, 128), (5, 300, 256), (4, 129, 128), (3, 520, 256)])
def test_paired_int4_matches_reference(N, K, block_k, dtype):
    """The paired int4 path (each byte loaded once, one scale per group) writes the reference's bits,
    with odd K, a short last group and K both shorter and longer than the block."""
    g = torch.Generator().manual_seed(N + K)
    parts = [quantize((torch.randn(N, K, generator=g) * 0.05).to(DEVICE), "int4") for _ in range(2)]
    qt = _stack(parts)
    stride = N * K + 8
    out = torch.full((3, stride), float("nan"), dtype=dtype, device=DEVICE)
    ids = [2, 0]
    bases = torch.tensor([e * stride + 8 for e in ids], dtype=torch.int64, device=DEVICE)
    dequantize_into(qt, out, bases, block_r=16, block_k=block_k, paired=True)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for e, p in zip(ids, parts):
        assert torch.equal(out[e, 8:8 + N * K].view(bits), dequantize(p, dtype).reshape(-1).view(bits))
        assert out[e, :8].isnan().all()
    assert out[1].isnan().all()
    with pytest.raises(ValueError, match="multiple of 128"):
        dequantize_into(qt, out, bases, block_k=64, paired=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark (run_all.sh dequant)")
def test_bench_dequant_script_runs_on_cpu(tmp_path):
    """benchmarks/bench_dequant.py's logic on tiny shapes in the interpreter: every variant it times is
    checked exact first, and it writes its JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "benchmarks/bench_dequant.py", "--out", str(tmp_path)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "bench_dequant.json").read_text())["results"]
    dequant = [r for r in res if "gemm_tokens" not in r]
    gemm = [r for r in res if "gemm_tokens" in r]
    assert {(r["precision"], r["paired"]) for r in dequant} == {("int8", False), ("int4", False), ("int4", True)}
    assert all(r["exact"] for r in dequant)
    assert {r["precision"] for r in gemm} == {"int8", "int4"} and all(r["direct_equal"] for r in gemm)
