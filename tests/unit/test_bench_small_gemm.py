"""benchmarks/bench_small_gemm.py's bookkeeping on CPU (the timings themselves need the GPU): bytes per GEMM,
the sweep's variants, the per-step sums and the printed table, over a synthetic result."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
bs = pytest.importorskip("bench_small_gemm")


def test_gemm_bytes_and_shapes():
    assert bs.gemm_bytes(1, 151936, 2048) == (151936 * 2048 + 2048 + 151936) * 2  # lm_head: 622 MB
    layers, linears = bs.MODELS["qwen3-30b-a3b"]
    q, k, v, qkv = (next(lin for lin in linears if lin[0] == n) for n in ("q", "k", "v", "qkv"))
    assert layers == 48 and q[1] + k[1] + v[1] == qkv[1] == 5120


def test_variants_around_the_rule():
    pytest.importorskip("triton")
    from pagedmoe.kernels.small_gemm import small_gemm_config

    base = small_gemm_config(2048, 4096)
    vs = bs.variants(base)
    assert base not in vs and len(vs) == len(set(vs)) >= 8
    assert any(v.split_k == base.split_k * 2 for v in vs) and any(v.block_k == 256 for v in vs)


def test_sweep_order():
    shapes = [[dict(model=m, linear=lin, bytes=bs.gemm_bytes(1, N, K))] for m, (_, linears) in bs.MODELS.items()
              for lin, N, K, _ in linears]
    order = [(s[0]["model"][:5], s[0]["linear"]) for s in bs.sweep_order(shapes)]
    # Qwen3: lm_head 622 MB once < q / o 16.8 MB x 48; k, v 2 MB x 48; the fused qkv row last
    assert order[:7] == [("qwen3", "q"), ("qwen3", "o"), ("qwen3", "lm_head"), ("qwen3", "k"), ("qwen3", "v"),
                         ("qwen3", "router"), ("qwen3", "qkv")]
    assert order[7][0] == "mixtr" and order[-1] == ("mixtr", "qkv")


def _row(model, linear, M, torch_us, triton_us, floor_us=1.0):
    return dict(model=model, linear=linear, N=8, K=8, M=M, copies=1, bytes=1000, floor_us=floor_us,
                torch=dict(us=torch_us, gbps=1000 / torch_us / 1e3),
                triton=dict(us=triton_us, gbps=1000 / triton_us / 1e3))


def test_per_step_and_table():
    rows = [_row("m", "q", 1, 4.0, 2.0), _row("m", "o", 1, 3.0, 1.5), _row("m", "qkv", 1, 100.0, 100.0),
            _row("m", "lm_head", 1, 50.0, 40.0), _row("m", "q", 2, 9.0, 9.0)]
    rows.append(dict(model="m", linear="k", N=8, K=8, M=1, error="Traceback: boom"))
    # 2 layers: (4 + 3) x 2 + 50 torch; the fused qkv row, the other M and the failed row are left out
    assert bs.per_step(rows, 2, 1, lambda r: r["torch"]["us"]) == 64.0
    assert bs.per_step(rows, 2, 1, lambda r: r["triton"]["us"]) == 47.0
    res = dict(gpu="NVIDIA H200", torch="2.x", triton="3.x", copy_bytes_per_s=4.2e12, rows=rows,
               step_ms={"m": {1: dict(torch=0.064, triton=0.047, floor=0.005)}})
    table = bs.format_table(res)
    assert "4.20 TB/s" in table and "error: Traceback: boom" in table
    assert "m: backbone GEMMs per decode step (ms), torch / triton / floor at M = 1: 0.064 / 0.047 / 0.005" in table
    q_line = next(line for line in table.splitlines() if line.startswith("m ") and " q " in line)
    assert "2.00x" in q_line
