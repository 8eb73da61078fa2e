"""experts_grouped_mm's Triton epilogues (kernels/fused_moe.py::silu_mul, moe_sum over permuted rows) against
torch: the activation rounded once from float32, the combine a fixed-order float32 sum (deterministic, unlike the
atomics of index_add_ on CUDA), and the whole grouped path against the expert loop.

CPU: the Triton interpreter runs the kernels on float32 (the engine takes them on CUDA only; here the test forces
them). GPU (@pytest.mark.gpu): bf16 at a Qwen3-30B-A3B-like width, bit-identical from run to run.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels' import

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.models.layers import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()


def test_silu_mul_is_the_float32_product_rounded_once():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    big = torch.randn(37, 2 * 96 + 8, generator=g, device=DEVICE)
    gate_up = big[:, :2 * 96]                       # a row stride other than 2I
    out = fm.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-7)
    assert out.shape == (37, 96) and out.abs().sum() > 0


def test_silu_mul_refuses_a_strided_column():
    with pytest.raises(ValueError, match="unit column stride"):
        fm.silu_mul(torch.randn(8, 4, device=DEVICE).t())


def test_moe_sum_reads_rows_through_the_permutation():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    T, A, H, E = 19, 3, 600, 5                       # H over one 512-column tile, T over one 8-token tile
    ids = torch.randint(0, E, (T, A), generator=g, device=DEVICE)
    w = torch.rand(T, A, generator=g, device=DEVICE)
    y_slots = torch.randn(T * A, H, generator=g, device=DEVICE)   # the row of slot t * A + k
    order = torch.randperm(T * A, generator=g, device=DEVICE)
    y_sorted = y_slots[order]                        # rows in another order
    rows = torch.empty_like(order)
    rows[order] = torch.arange(T * A, device=DEVICE)
    out = torch.empty(T, H, device=DEVICE)
    fm.moe_sum(y_sorted.unsqueeze(0), w, ids, out, 1, E, rows=rows)
    ref = (y_slots.view(T, A, H).double() * w.double()[..., None]).sum(1).float()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    again = torch.empty_like(out)
    fm.moe_sum(y_sorted.unsqueeze(0), w, ids, again, 1, E, rows=rows)
    assert torch.equal(out, again)


@pytest.mark.parametrize("tile", [dict(), dict(block_t=4, block_h=256, num_warps=4, unroll=True),
                                  dict(block_t=16, block_h=128, num_warps=4), moe.GROUPED_TILES["sum"]])
def test_moe_sum_tiles_and_unroll_give_the_same_sums(tile):
    g = torch.Generator(device=DEVICE).manual_seed(3)
    T, A, H, E = 21, 4, 300, 6
    ids = torch.randint(0, E, (T, A), generator=g, device=DEVICE)
    ids[2, 1] = E                                     # a slot routed outside [0, E): masked, never read
    w = torch.rand(T, A, generator=g, device=DEVICE)
    y = torch.randn(2, T * A, H, generator=g, device=DEVICE)   # two splits: the loop over S as well
    rows = torch.randperm(T * A, generator=g, device=DEVICE)
    ref = (y.sum(0)[rows].view(T, A, H).double() * (w * (ids < E)).double()[..., None]).sum(1).float()
    for splits in (1, 2):
        default = fm.moe_sum(y[:splits], w, ids, torch.empty(T, H, device=DEVICE), splits, E, rows=rows)
        out = fm.moe_sum(y[:splits], w, ids, torch.full((T, H), float("nan"), device=DEVICE), splits, E,
                         rows=rows, **tile)
        assert torch.equal(out, default)              # same k order, same float32 sums: the same bits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [dict(), dict(block_r=4, block_h=128, num_warps=2), dict(block_r=1, block_h=1024),
                                  moe.GROUPED_TILES["gather"]])
def test_gather_rows_is_x_at_order_div_a(tile):
    g = torch.Generator(device=DEVICE).manual_seed(4)
    T, A, H = 13, 3, 200                              # H over a 128-column tile, rows over a 4-row tile
    x = torch.randn(T, H + 8, generator=g, device=DEVICE)[:, :H]   # a row stride other than H
    order = torch.randperm(T * A, generator=g, device=DEVICE)
    out = fm.gather_rows(x, order, A, **tile)
    assert torch.equal(out, x[order // A]) and out.is_contiguous()
    assert fm.gather_rows(x, order[:0], A).shape == (0, H)


def test_gather_rows_refuses_bad_operands():
    with pytest.raises(ValueError, match="unit column stride"):
        fm.gather_rows(torch.randn(8, 4, device=DEVICE).t(), torch.arange(4, device=DEVICE), 1)
    with pytest.raises(ValueError, match="1-D"):
        fm.gather_rows(torch.randn(8, 4, device=DEVICE), torch.zeros(2, 2, dtype=torch.long, device=DEVICE), 1)


def test_silu_mul_tiles_give_the_same_bits():
    g = torch.Generator(device=DEVICE).manual_seed(5)
    gate_up = torch.randn(23, 2 * 160, generator=g, device=DEVICE)
    assert torch.equal(fm.silu_mul(gate_up, block_m=2, block_i=256, num_warps=2), fm.silu_mul(gate_up))
    assert torch.equal(fm.silu_mul(gate_up, **moe.GROUPED_TILES["silu"]), fm.silu_mul(gate_up))


def _layer(T, A, E, H, I, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=DEVICE).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=DEVICE) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g, device=DEVICE) * I ** -0.5).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g, device=DEVICE), -1), A, dim=-1)
    return x, w13, w2, weights, ids


@needs_grouped_mm
def test_grouped_path_with_the_triton_epilogues_matches_the_loop(monkeypatch):
    monkeypatch.setattr(moe, "_triton_epilogues", lambda x: True)
    x, w13, w2, weights, ids = _layer(29, 2, 6, 64, 48, torch.float32, 2)
    out = moe.experts_grouped_mm(x, w13, w2, weights, ids)
    ref = moe.experts_loop(x.double(), w13.double(), w2.double(), weights.float(), ids).float()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(moe, "_triton_epilogues", lambda x: False)
    torch.testing.assert_close(out, moe.experts_grouped_mm(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)


@needs_grouped_mm
def test_chunks_with_the_triton_epilogues_write_their_rows_of_the_output(monkeypatch):
    # each chunk's combine writes its own slice of the one output (no copy): chunked equals one piece
    import pagedmoe.planning.kv_sizing as kv

    monkeypatch.setattr(moe, "_triton_epilogues", lambda x: True)
    x, w13, w2, weights, ids = _layer(23, 2, 5, 64, 32, torch.float32, 4)
    whole = moe.experts_grouped_mm(x, w13, w2, weights, ids)
    monkeypatch.setattr(kv, "GROUPED_MM_CHUNK_BYTES", 7 * 2 * kv.grouped_mm_row_bytes(64, 32, 4))  # 7 tokens a chunk
    chunked = moe.experts_grouped_mm(x, w13, w2, weights, ids)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    assert chunked.abs().sum(-1).min() > 0   # every token's row written, the short last chunk's too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_path_on_cuda_is_deterministic_and_close_to_eager(monkeypatch):
    x, w13, w2, weights, ids = _layer(3000, 8, 128, 2048, 768, torch.bfloat16, 3)
    assert moe._triton_epilogues(x)
    out = moe.experts_grouped_mm(x, w13, w2, weights, ids)
    for _ in range(3):
        assert torch.equal(out, moe.experts_grouped_mm(x, w13, w2, weights, ids))
    ref = moe.experts_loop(x.float(), w13.float(), w2.float(), weights.float(), ids)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    monkeypatch.setattr(moe, "_triton_epilogues", lambda x: False)
    eager = moe.experts_grouped_mm(x, w13, w2, weights, ids)
    assert ((eager.float() - out.float()).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("num_experts,key_bytes", [(8, 1), (256, 1), (257, 2), (2 ** 15, 2), (40000, 8)])
def test_the_narrow_sort_key_gives_the_same_stable_order(num_experts, key_bytes):
    g = torch.Generator(device=DEVICE).manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (3000,), generator=g, device=DEVICE)
    ids[:50] = num_experts - 1          # the largest id must survive the narrowing
    key = moe._narrow_sort_key(ids, num_experts)
    assert key.element_size() == key_bytes
    assert torch.equal(torch.argsort(key, stable=True), torch.argsort(ids, stable=True))
    # the grouped path's per-expert end rows come from the sorted narrow keys: they equal the counts' running sum
    keys = torch.sort(key, stable=True).values
    offs = torch.searchsorted(keys, torch.arange(num_experts, device=DEVICE, dtype=keys.dtype), right=True,
                              out_int32=True)
    assert torch.equal(offs, torch.bincount(ids, minlength=num_experts).cumsum(0).int())
