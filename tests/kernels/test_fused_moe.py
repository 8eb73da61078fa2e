"""Triton fused MoE (kernels/fused_moe.py, kernels/moe_align.py) against the expert loop reference.

CPU: the Triton interpreter runs small fp32 cases and one fp16 case (its tl.dot reads bf16 as raw
integers, so bf16 is checked on the GPU only); the sort-by-expert kernel is compared exactly.
GPU (@pytest.mark.gpu): a bf16 grid, Mixtral-8x7B- and Qwen3-30B-A3B-sized layers, tile variants,
CUDA-graph capture. Weights are views into packed per-expert rows with a stride > 3IH, as
experts/layout.py makes them. Errors are ‖out − ref‖ / ‖ref‖ against experts_loop on float64 weights.
"""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.experts.layout import expert_stride, expert_views  # noqa: E402
from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels.moe_align import max_num_blocks, moe_align, moe_align_ref  # noqa: E402
from pagedmoe.models.layers.moe import MOE_BACKENDS, experts_loop, experts_triton, sync_free  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


if INTERPRET:
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()


def make_layer(T, A, E, H, I, dtype, seed, pad=24, banned=(), device=DEVICE):
    """x [T, H], packed-row expert views, routing (softmax top-A) that never picks the banned experts."""
    g = torch.Generator(device=device).manual_seed(seed)
    stride = expert_stride(H, I, torch.tensor([], dtype=dtype).element_size()) + pad  # rows longer than 3IH
    packed = (torch.randn(E, stride, generator=g, device=device) * H ** -0.5).to(dtype)
    packed[:, 3 * I * H:] = float("nan")  # the padding between rows must never be read
    x_big = torch.randn(T, H + 16, generator=g, device=device).to(dtype)
    x = x_big[:, 8:8 + H]  # a row stride other than H
    logits = torch.randn(T, E, generator=g, device=device)
    logits[:, list(banned)] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), A, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    w13, w2 = expert_views(packed, H, I)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids):
    return experts_loop(x.double(), w13.double(), w2.double(), weights.float(), ids).float()


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def check(T, A, E, H, I, dtype=torch.float32, seed=0, banned=(), pad=24, **overrides):
    x, w13, w2, weights, ids = make_layer(T, A, E, H, I, dtype, seed, pad=pad, banned=banned)
    out = torch.full_like(x, float("nan"))  # poison: every row must be written
    fm.fused_moe(x, w13, w2, weights, ids, out=out, **overrides)
    assert torch.isfinite(out).all()
    err = rel_err(out, reference(x, w13, w2, weights, ids))
    assert err < TOL[dtype], f"rel err {err:.2e} (T={T} A={A} E={E} H={H} I={I} {dtype} {overrides})"
    return out


# ---------------------------------------------------------------- sort by expert (exact)

@pytest.mark.parametrize("T,A,E,block_m", [
    (1, 2, 8, 16), (3, 1, 4, 16), (17, 4, 16, 16), (64, 2, 8, 32), (64, 2, 8, 16), (64, 8, 128, 16),
    (100, 1, 4, 64), (0, 2, 8, 16),
])
def test_align_matches_reference(T, A, E, block_m):
    g = torch.Generator().manual_seed(T * 131 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]) if T else torch.zeros(0, A)
    ids = ids.long().to(DEVICE)
    slots, blocks = moe_align(ids, E, block_m)
    ref_slots, ref_blocks = moe_align_ref(ids, E, block_m)
    assert blocks.numel() == max_num_blocks(T * A, E, block_m)
    assert torch.equal(slots, ref_slots) and torch.equal(blocks, ref_blocks)


def test_align_skips_ids_outside_experts():
    ids = torch.tensor([[0, 9], [-1, 2], [2, 2], [3, 0]], dtype=torch.int32, device=DEVICE)
    slots, blocks = moe_align(ids, 4, 16)
    ref_slots, ref_blocks = moe_align_ref(ids, 4, 16)
    assert torch.equal(slots, ref_slots) and torch.equal(blocks, ref_blocks)
    assert set(slots.tolist()) == {0, 3, 4, 5, 6, 7, 8}  # slots 1 and 2 (ids 9, -1) go nowhere; 8 = padding


@pytest.mark.parametrize("T,A,E,block_m", [(1, 2, 8, 16), (17, 4, 16, 16), (64, 8, 128, 64), (300, 8, 128, 16),
                                            (2048, 8, 128, 128), (5, 2, 4, 16)])
def test_align_sorted_matches_reference(T, A, E, block_m):
    """The sort path (moe_align_sorted, taken above ALIGN_SORT_MIN_SLOTS slots) gives the kernel's layout exactly,
    ids outside [0, E) included (every tenth slot here: they go nowhere)."""
    from pagedmoe.kernels.moe_align import moe_align_sorted

    g = torch.Generator().manual_seed(T + A)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]).long()
    ids.view(-1)[::10] = torch.tensor([E, -1]).repeat(ids.numel())[:ids.view(-1)[::10].numel()]
    ids = ids.to(DEVICE)
    nb = max_num_blocks(ids.numel(), E, block_m)
    slots = torch.full((nb * block_m,), -7, dtype=torch.int32, device=DEVICE)
    blocks = torch.full((nb,), -7, dtype=torch.int32, device=DEVICE)
    moe_align_sorted(ids.view(-1), E, block_m, slots, blocks)
    ref_slots, ref_blocks = moe_align_ref(ids, E, block_m)
    assert torch.equal(slots, ref_slots) and torch.equal(blocks, ref_blocks)


def test_align_takes_the_sort_path_above_its_threshold(monkeypatch):
    """moe_align hands large steps to the sort path; its result equals the kernel's (the reference's)."""
    from pagedmoe.kernels import moe_align as ma

    called = []
    sort = ma.moe_align_sorted
    monkeypatch.setattr(ma, "moe_align_sorted", lambda *a: called.append(a[0].numel()) or sort(*a))
    monkeypatch.setattr(ma, "ALIGN_SORT_MIN_SLOTS", 64)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(40)]).to(DEVICE)
    slots, blocks = ma.moe_align(ids, 16, 16)
    ref_slots, ref_blocks = moe_align_ref(ids, 16, 16)
    assert called == [160] and torch.equal(slots, ref_slots) and torch.equal(blocks, ref_blocks)


# ---------------------------------------------------------------- fused MoE, interpreter sizes

@pytest.mark.parametrize("T,A,E,H,I,overrides", [
    (1, 2, 8, 48, 80, {}),                                   # one token: two one-row blocks
    (3, 1, 4, 32, 16, {}),
    (17, 2, 8, 48, 80, dict(swap_ab=True)),
    (17, 4, 16, 80, 48, dict(split_k=3, block_k2=16)),      # uneven splits over I, K masked
    (17, 4, 4, 64, 64, dict(block_m=16, block_k=32, block_k2=32)),  # 68 slots: several blocks per expert, even tiles
    (17, 4, 4, 64, 64, dict(block_m=64, block_n=32, block_n2=32)),
    (64, 2, 4, 32, 48, {}),
    (64, 1, 16, 48, 32, dict(split_k=2, block_k2=16)),
])
def test_fused_moe_matches_loop(T, A, E, H, I, overrides):
    check(T, A, E, H, I, seed=T + E, **overrides)


def test_fused_moe_experts_without_tokens():
    # Experts 0, 3 and 7 are never routed to; with 3 tokens x top-2 at most 6 of 12 others are.
    check(3, 2, 12, 48, 80, seed=5, banned=(0, 3, 7))


def test_fused_moe_fp16():
    check(17, 2, 8, 48, 80, dtype=torch.float16, seed=1)


def test_fused_moe_ids_outside_experts_are_skipped():
    x, w13, w2, weights, ids = make_layer(5, 2, 4, 32, 16, torch.float32, seed=2)
    ids = ids.clone()
    ids[1, 0], ids[3, 1] = -1, 4  # what expert parallelism marks as "not here"
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[torch.float32]


def test_backend_registered():
    x, w13, w2, weights, ids = make_layer(3, 2, 4, 32, 16, torch.float32, seed=3)
    assert MOE_BACKENDS["triton"] is experts_triton
    assert sync_free(experts_triton, x, w13, w2)
    out = experts_triton(x, w13, w2, weights, ids)
    assert rel_err(out, reference(x, w13, w2, weights, ids)) < TOL[torch.float32]


def test_launcher_checks():
    x, w13, w2, weights, ids = make_layer(3, 2, 4, 32, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match="w2"):
        fm.fused_moe(x, w13, w2[:, :16], weights, ids)
    with pytest.raises(ValueError, match="hidden"):
        fm.fused_moe(x[:, :16], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk"):
        fm.fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="stride"):
        fm.fused_moe(x, w13.transpose(1, 2), w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="power of two"):
        fm.fused_moe(x, w13, w2, weights, ids, block_n=48)
    assert fm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_default_config_table():
    # Mixtral-8x7B (E 8, top-2) and Qwen3-30B-A3B (E 128, top-8) decode sizes: valid tiles, and
    # one block per expert on average where the mean count allows it.
    for T in (1, 16, 64, 256):
        cfg = fm.default_config(T, 2, 8, 4096, 14336, torch.bfloat16)
        assert cfg.block_m >= min(64, T * 2 / 8)
    for T in (1, 64, 256, 1024):
        cfg = fm.default_config(T, 8, 128, 2048, 768, torch.bfloat16)
        assert cfg.block_m >= min(64, T * 8 / 128)
    assert fm.default_config(1, 8, 128, 2048, 768, torch.bfloat16).block_n <= 32  # few blocks: narrow slices
    assert fm.choose_split_k(2 * 64, 14336, 128, 132) > 1   # Mixtral T=1: 128 w2 programs on 132 SMs
    assert fm.choose_split_k(128 * 32, 768, 128, 132) == 1


# ---------------------------------------------------------------- GPU

GPU_SHAPES = [(48, 80), (1024, 1408)]


@pytest.mark.gpu
@pytest.mark.parametrize("E,A", [(4, 1), (8, 2), (16, 4)])
@pytest.mark.parametrize("T", [1, 3, 17, 64, 200])
@pytest.mark.parametrize("H,I", GPU_SHAPES)
def test_gpu_bf16_grid(E, A, T, H, I):
    check(T, A, E, H, I, dtype=torch.bfloat16, seed=T * 7 + E, banned=(1,) if E >= 8 else ())


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [
    dict(swap_ab=True), dict(split_k=1), dict(split_k=3), dict(split_k=8, block_k2=64),
    dict(block_m=16), dict(block_m=32), dict(block_m=64), dict(num_stages=2, num_stages2=2),
    dict(block_n=128, block_k=128, num_warps=8, num_stages=2), dict(block_n=16, block_n2=16, block_k=256, block_k2=256),
])
def test_gpu_bf16_variants(overrides):
    check(64, 2, 8, 1024, 1408, dtype=torch.bfloat16, seed=11, **overrides)
    check(7, 8, 64, 512, 176, dtype=torch.bfloat16, seed=12, **overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    check(33, 2, 8, 256, 160, dtype=dtype, seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("T,A,E,H,I", [(64, 2, 8, 4096, 14336), (64, 8, 128, 2048, 768), (1, 8, 128, 2048, 768)])
def test_gpu_model_sizes(T, A, E, H, I):
    # Mixtral-8x7B and Qwen3-30B-A3B layers at decode sizes (the benchmark's shapes).
    check(T, A, E, H, I, dtype=torch.bfloat16, seed=T + E, pad=64)


@pytest.mark.gpu
def test_gpu_cuda_graph_and_determinism():
    # Capturable (no host sync) and bit-reproducible: a replay over new routing equals an eager call.
    x, w13, w2, weights, ids = make_layer(48, 2, 8, 512, 704, torch.bfloat16, seed=14)
    static = [t.clone() for t in (x, weights, ids)]
    out = fm.fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(static[0], w13, w2, static[1], static[2])
    x2, _, _, weights2, ids2 = make_layer(48, 2, 8, 512, 704, torch.bfloat16, seed=15)
    for t, new in zip(static, (x2, weights2, ids2)):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = fm.fused_moe(x2, w13, w2, weights2, ids2)
    assert torch.equal(out, eager)
    assert torch.equal(eager, fm.fused_moe(x2, w13, w2, weights2, ids2))
    assert rel_err(out, reference(x2, w13, w2, weights2, ids2)) < TOL[torch.bfloat16]


QUANT_PRECISIONS = ["int8", "int4"] + (["fp8"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("precision", QUANT_PRECISIONS)
@pytest.mark.parametrize("T,E,A,H,I", [(5, 4, 2, 72, 40), (3, 3, 2, 200, 136), (4, 3, 2, 71, 37)])
def test_quantized_experts_equal_the_dequantized_ones(precision, T, E, A, H, I):
    """fused_moe_quantized dequantizes each weight tile in registers to the values kernels/dequant.py
    writes: with the same tiles its output equals fused_moe on the dequantized weights bit for bit
    (fp32 activations in the interpreter, where bf16 dots are not exact; bf16 on the GPU). Sizes with a
    short last int4 group, K below one group, and odd tails."""
    from pagedmoe.codecs.quant import dequantize, quantize
    from pagedmoe.experts.tiers.quantized import stack_quantized as _stack

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    g = torch.Generator().manual_seed(T * H + I)
    w13 = [torch.randn(2 * I, H, generator=g) * H ** -0.5 for _ in range(E)]
    w2 = [torch.randn(H, I, generator=g) * I ** -0.5 for _ in range(E)]
    q13 = _stack([quantize(w.to(DEVICE), precision) for w in w13])
    q2 = _stack([quantize(w.to(DEVICE), precision) for w in w2])
    d13 = dequantize(q13, dtype).view(E, 2 * I, H)
    d2 = dequantize(q2, dtype).view(E, H, I)
    x = (torch.randn(T, H, generator=g)).to(DEVICE, dtype)
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), A, dim=-1)
    ref = fm.fused_moe(x, d13, d2, weights, ids)
    got = fm.fused_moe_quantized(x, q13, q2, E, weights, ids)
    assert torch.equal(got, ref)
    loop = reference(x, d13, d2, weights, ids)
    assert rel_err(got, loop) < TOL[dtype]


def test_quantized_experts_refuse_bad_stacks():
    from pagedmoe.codecs.quant import quantize
    from pagedmoe.experts.tiers.quantized import stack_quantized as _stack

    q13 = _stack([quantize(torch.randn(16, 32).to(DEVICE), "int8") for _ in range(2)])
    q2 = _stack([quantize(torch.randn(32, 8).to(DEVICE), "int4") for _ in range(2)])
    x = torch.randn(1, 32, device=DEVICE)
    w, ids = torch.ones(1, 1, device=DEVICE), torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="share one of"):
        fm.fused_moe_quantized(x, q13, q2, 2, w, ids)
    q2 = _stack([quantize(torch.randn(32, 8).to(DEVICE), "int8") for _ in range(2)])
    with pytest.raises(ValueError, match="do not hold 3 experts"):
        fm.fused_moe_quantized(x, q13, q2, 3, w, ids)


@pytest.mark.parametrize("T,E,A,H,I", [(6, 6, 2, 72, 40), (2, 5, 3, 200, 136)])
def test_mixed_precision_layer_equals_the_assembled_one(T, E, A, H, I):
    """fused_moe_mixed on a layer with exact, int8 and int4 experts (and fp8 on the GPU) equals fused_moe on
    the layer assembled with the quantized experts dequantized, bit for bit; an expert in no part's slots
    would be a bug, so every expert is in exactly one."""
    from pagedmoe.codecs.quant import dequantize, quantize
    from pagedmoe.experts.tiers.quantized import stack_quantized as _stack

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    g = torch.Generator().manual_seed(E * H + T)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    groups = {"exact": [0, 3], "int8": [1, 4], "int4": [2] + ([5] if E > 5 else [])}
    if torch.cuda.is_available():
        groups["fp8"], groups["int8"] = [4], [1]
    full13, full2 = w13.to(DEVICE, dtype).clone(), w2.to(DEVICE, dtype).clone()
    parts = []
    for prec, ids in groups.items():
        slots = torch.full((E,), -1, dtype=torch.int32)
        slots[ids] = torch.arange(len(ids), dtype=torch.int32)
        if prec == "exact":
            parts.append((w13[ids].to(DEVICE, dtype), w2[ids].to(DEVICE, dtype), slots.to(DEVICE)))
            continue
        q13 = _stack([quantize(w13[e].to(DEVICE), prec) for e in ids])
        q2 = _stack([quantize(w2[e].to(DEVICE), prec) for e in ids])
        full13[ids] = dequantize(q13, dtype).view(len(ids), 2 * I, H)
        full2[ids] = dequantize(q2, dtype).view(len(ids), H, I)
        parts.append((q13, q2, slots.to(DEVICE)))
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g).to(DEVICE), dim=-1), A, dim=-1)
    ref = fm.fused_moe(x, full13, full2, weights, ids)
    got = fm.fused_moe_mixed(x, parts, E, weights, ids)
    assert torch.equal(got, ref)


def _sorted_blocks(monkeypatch, fn):
    """fn() with the one-token steps on moe_align's sorted blocks instead of one block per slot."""
    monkeypatch.setattr(fm, "SLOT_BLOCKS_MAX_TOKENS", 0)
    try:
        return fn()
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("A,E,H,I,overrides", [
    (2, 4, 72, 40, {}), (4, 16, 64, 48, {}), (3, 5, 71, 37, dict(split_k=2)), (2, 4, 72, 40, dict(swap_ab=True)),
])
def test_one_token_slot_blocks_equal_sorted_blocks(monkeypatch, A, E, H, I, overrides):
    """One token: fused_moe gives each slot its own block and launches no moe_align (SLOT_BLOCKS); its output
    equals the sorted blocks' bit for bit (a token's experts are distinct, so each block holds the same one row),
    with ids outside [0, E) skipped as moe_align skips them (expert parallelism's -1, a stray E + 2)."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    x, w13, w2, weights, ids = make_layer(1, A, E, H, I, dtype, seed=A * E + H)
    calls = []
    orig = fm.moe_align
    monkeypatch.setattr(fm, "moe_align", lambda *a, **k: calls.append(a) or orig(*a, **k))
    got = fm.fused_moe(x, w13, w2, weights, ids, **overrides)
    assert calls == []                                           # no moe_align launch for one token
    ref = _sorted_blocks(monkeypatch, lambda: fm.fused_moe(x, w13, w2, weights, ids, **overrides))
    assert torch.equal(got, ref)
    assert rel_err(got, reference(x, w13, w2, weights, ids)) < TOL[dtype]
    bad = ids.clone()
    bad[0, 0] = -1
    bad[0, -1] = E + 2
    monkeypatch.setattr(fm, "moe_align", orig)
    got = fm.fused_moe(x, w13, w2, weights, bad)
    ref = _sorted_blocks(monkeypatch, lambda: fm.fused_moe(x, w13, w2, weights, bad))
    assert torch.equal(got, ref)


def test_one_token_slot_blocks_with_a_slot_map(monkeypatch):
    """The routed-fetching pool (fused_moe_mixed with slots) and a quantized part take one block per slot too."""
    from pagedmoe.codecs.quant import quantize
    from pagedmoe.experts.tiers.quantized import stack_quantized as _stack

    E, A, H, I = 6, 2, 72, 40
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    exact, quant = [0, 2, 4], [1, 3, 5]
    parts = []
    for ids_, kind in ((exact, "exact"), (quant, "int8")):
        slots = torch.full((E,), -1, dtype=torch.int32)
        slots[ids_] = torch.arange(len(ids_), dtype=torch.int32)
        if kind == "exact":
            parts.append((w13[ids_].to(DEVICE, dtype), w2[ids_].to(DEVICE, dtype), slots.to(DEVICE)))
        else:
            parts.append((_stack([quantize(w13[e].to(DEVICE), kind) for e in ids_]),
                          _stack([quantize(w2[e].to(DEVICE), kind) for e in ids_]), slots.to(DEVICE)))
    x = torch.randn(1, H, generator=g).to(DEVICE, dtype)
    for pick in ([0, 3], [2, 4], [5, 1]):
        ids = torch.tensor([pick], device=DEVICE)
        weights = torch.tensor([[0.7, 0.3]], device=DEVICE)
        got = fm.fused_moe_mixed(x, parts, E, weights, ids)
        ref = _sorted_blocks(monkeypatch, lambda: fm.fused_moe_mixed(x, parts, E, weights, ids))
        assert torch.equal(got, ref)
