"""layers/moe.py::experts_grouped_mm runs a large forward's tokens a chunk at a time (bounded transients): the same
output as in one piece (to the GEMM's rounding: a GEMM of fewer rows may block its sums otherwise), and as the
reference loop."""
from __future__ import annotations

import pytest
import torch

import pagedmoe.planning.kv_sizing as kv
from pagedmoe.models.layers.moe import experts_grouped_mm, experts_loop


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_give_the_one_piece_result(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    T, H, I, E, A = 53, 64, 32, 8, 2
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    topk_weights = torch.rand(T, A, generator=g)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    whole = experts_grouped_mm(x, w13, w2, topk_weights, topk_ids)
    row = kv.grouped_mm_row_bytes(H, I, x.element_size())
    monkeypatch.setattr(kv, "GROUPED_MM_CHUNK_BYTES", 10 * A * row)   # 10 tokens a chunk: 6 chunks, the last short
    assert kv.grouped_mm_chunk_tokens(A, H, I, x.element_size()) == 10
    chunked = experts_grouped_mm(x, w13, w2, topk_weights, topk_ids)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    torch.testing.assert_close(chunked, whole, **tol)
    assert not torch.equal(chunked, torch.zeros_like(chunked))
    torch.testing.assert_close(chunked, experts_loop(x, w13, w2, topk_weights, topk_ids), **tol)


def test_the_activation_estimate_counts_one_chunk():
    # Mixtral-8x7B at 8192 tokens: the peak row holds gate/up (2I) and the activation (I), 3 * 14336 bf16 values,
    # so a chunk is 512 MiB // (2 * 86016 B) = 3120 tokens and the routed buffers are a chunk's, not all 8192's
    assert kv.grouped_mm_row_bytes(4096, 14336, 2) == 2 * 3 * 14336
    assert kv.grouped_mm_chunk_tokens(2, 4096, 14336, 2) == (512 << 20) // (2 * 2 * 3 * 14336) == 3120
    one = kv.estimate_activation_bytes(3120, 0, 4096, 14336, 2, 32000, 2)
    more = kv.estimate_activation_bytes(8192, 0, 4096, 14336, 2, 32000, 2)
    grows = (8192 - 3120) * 4096 * (2 * 8 + 2)     # hidden states and the output only
    assert more - one == grows
