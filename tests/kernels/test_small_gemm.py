"""kernels/small_gemm.py (the decode step's backbone GEMM, M <= 16) against a float64 torch reference.

Tolerance, per element: the output's own rounding (half an ulp of the output dtype, u * |ref|) plus the
float32 accumulation's worst case over K terms (K * 2^-24 * sum_k |x_k w_k|; products of bf16 / fp16 values
are exact in float32). The shapes are the Qwen3-30B-A3B and Mixtral-8x7B backbone linears (the lm_head's N
cut to an odd 3001 on the interpreter, which runs the programs one by one) and odd sizes: M = 1, 3, 16;
N, K not multiples of the tiles. CPU: the Triton interpreter, its bf16 dot and float32 -> bf16 cast fixed
to compute as the GPU does (triton_interp.py).
"""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.kernels.small_gemm import (MAX_M, SmallGemmConfig, small_gemm, small_gemm_config,  # noqa: E402
                                         small_gemm_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}

if INTERPRET:
    from triton_interp import fix_interpreter_bf16, fix_interpreter_bf16_dot, fix_interpreter_index  # noqa: E402

    fix_interpreter_index()
    fix_interpreter_bf16()
    fix_interpreter_bf16_dot()

# (N, K) of the backbone linears: Qwen3-30B-A3B qkv / o / router / lm_head, Mixtral-8x7B q / kv / router
REAL = [(5120, 2048), (2048, 4096), (128, 2048), (3001 if INTERPRET else 151936, 2048),
        (4096, 4096), (1024, 4096), (8, 4096)]
ODD = [(1, 1), (17, 7), (100, 129), (300, 1000), (65, 640), (1030, 520)]


def _inputs(M, N, K, dtype, seed, bias=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, generator=g, device=DEVICE) * max(K, 1) ** -0.5).to(dtype)
    b = torch.randn(N, generator=g, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def assert_close(y, x, w, b):
    ref = small_gemm_ref(x, w, b)
    K = x.shape[1]
    scale = x.double().abs() @ w.double().abs().t()
    tol = UNIT_ROUNDOFF[y.dtype] * ref.abs() + K * 2.0 ** -24 * scale + 1e-30
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, worst err/tol {(err / tol).max().item():.3g}"


# M only masks rows (no tile choice or branch depends on it): on the interpreter, which runs the programs one by one,
# each real shape runs at one M, each M at two or three real shapes, and test_odd_sizes runs every M at every dtype;
# the GPU runs every M at every real shape
REAL_CASES = ([(m, n, k) for m, (n, k) in zip((1, 16, 3, 1, 3, 16, 1), REAL)] if INTERPRET else
              [(m, n, k) for m in (1, 3, 16) for n, k in REAL])


@pytest.mark.parametrize("M,N,K", REAL_CASES)
def test_real_shapes_bf16(M, N, K):
    x, w, _ = _inputs(M, N, K, torch.bfloat16, M * 131 + N + K)
    assert_close(small_gemm(x, w), x, w, None)


@pytest.mark.parametrize("N,K", ODD)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_odd_sizes(M, N, K, dtype, bias):
    x, w, b = _inputs(M, N, K, dtype, M + 7 * N + 13 * K, bias)
    assert_close(small_gemm(x, w, b), x, w, b)


@pytest.mark.parametrize("cfg", [SmallGemmConfig(16, 16, 1), SmallGemmConfig(32, 64, 3), SmallGemmConfig(64, 128, 16),
                                 SmallGemmConfig(16, 32, 7, num_warps=2, num_stages=2)])
def test_config_overrides(cfg):
    """Any tiles give the same answer within tolerance: splits that do not divide K (the masked path), more
    splits than K fills (empty ones are not launched), splits that are not powers of two."""
    x, w, b = _inputs(5, 210, 333, torch.bfloat16, 5, bias=True)
    assert_close(small_gemm(x, w, b, config=cfg), x, w, b)


def test_strided_inputs():
    """x with a row stride (a slice of a wider activation) and a weight that is a row slice of a larger one
    (q of a fused qkv weight)."""
    x_big, w_big, _ = _inputs(4, 300, 200, torch.bfloat16, 3)
    x, w = x_big[:, 8:136], w_big[40:250, 8:136]
    assert x.stride(0) == 200 and w.stride(0) == 200
    assert_close(small_gemm(x, w), x, w, None)


def test_deterministic():
    """Split-K sums in a fixed order (no atomics): two runs give the same bits."""
    N, K = (128, 2048) if INTERPRET else (2048, 4096)  # 4 splits of 8 column tiles on the interpreter, 8 of 32 on a GPU
    x, w, b = _inputs(7, N, K, torch.bfloat16, 11, bias=True)
    assert small_gemm_config(N, K).split_k > 1
    assert torch.equal(small_gemm(x, w, b), small_gemm(x, w, b))


def test_config_rule():
    """The tile rule over the real shapes: enough programs for ~2 per SM, splits >= 4 BLOCK_K steps deep."""
    assert small_gemm_config(5120, 2048) == SmallGemmConfig(64, 128, 4)      # qkv: 80 tiles x 4
    assert small_gemm_config(2048, 4096) == SmallGemmConfig(64, 128, 8)      # o_proj: 32 tiles x 8
    assert small_gemm_config(128, 2048) == SmallGemmConfig(16, 128, 4)       # router
    assert small_gemm_config(151936, 2048) == SmallGemmConfig(64, 128, 1)    # lm_head: 2374 tiles
    assert small_gemm_config(8, 4096) == SmallGemmConfig(16, 128, 8)         # Mixtral router
    assert small_gemm_config(7, 5) == SmallGemmConfig(16, 16, 1)
    for N, K in REAL + ODD:
        cfg = small_gemm_config(N, K)
        assert cfg.split_k & (cfg.split_k - 1) == 0
        assert cfg.split_k == 1 or 4 * cfg.split_k <= -(-K // cfg.block_k)


def test_degenerate_and_errors():
    x, w, b = _inputs(2, 5, 0, torch.float32, 1, bias=True)
    assert torch.equal(small_gemm(x, w, b), b.expand(2, 5))  # K = 0: the bias alone
    x, w, _ = _inputs(MAX_M + 1, 8, 8, torch.float32, 1)
    with pytest.raises(ValueError, match="1..16 rows"):
        small_gemm(x, w)
    with pytest.raises(ValueError, match="share a dtype"):
        small_gemm(x[:2], w.half())
    with pytest.raises(ValueError, match=r"weight must be \[N, 8\]"):
        small_gemm(x[:2], w[:, :4])
    with pytest.raises(ValueError, match="bias must be"):
        small_gemm(x[:2], w, torch.zeros(3, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (4096, 4096),
                                 (1024, 4096), (8, 4096), (32000, 4096)])
def test_gpu_full_shapes_in_cuda_graph(N, K):
    """Full shapes on the GPU, captured in a CUDA graph: the replay equals the eager call bit for bit (the
    split-K workspace comes from the graph's pool, no host sync), and both are within tolerance."""
    for M in (1, 4, 16):
        x, w, _ = _inputs(M, N, K, torch.bfloat16, M + N)
        eager = small_gemm(x, w)
        assert_close(eager, x, w, None)
        x_static = x.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            small_gemm(x_static, w)  # compile outside the capture
            with torch.cuda.graph(graph, stream=stream):
                y = small_gemm(x_static, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
        x_static.copy_(x.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, small_gemm(x.flip(0), w))
