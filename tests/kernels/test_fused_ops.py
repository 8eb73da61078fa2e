"""The decode step's fused small ops (kernels/fused_norm.py, qk_norm_rope.py, router_topk.py) against
the unfused layer code itself (RMSNorm, RotaryEmbedding, the routers of layers/moe.py) and the kernels'
written-out references, over a grid of shapes with odd sizes, in float32, float16 and bfloat16.

Every output is compared with torch.equal: the kernels round where the torch ops round and the norm's
and the router's sums are taken in float64, exact or all but exact (kernels/fused_norm.py says why).
CPU: the Triton interpreter, its float32 -> bfloat16 cast fixed to round to nearest even as the GPU
does (triton_interp.fix_interpreter_bf16).
"""
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.kernels.attention_ref import write_kv_ref  # noqa: E402
from pagedmoe.kernels.fused_norm import fused_add_rmsnorm, fused_add_rmsnorm_ref  # noqa: E402
from pagedmoe.kernels.qk_norm_rope import qk_norm_rope_kv, qk_norm_rope_kv_ref  # noqa: E402
from pagedmoe.kernels.router_topk import router_topk  # noqa: E402
from pagedmoe.models.layers.moe import route_sigmoid_grouped, route_softmax_topk  # noqa: E402
from pagedmoe.models.layers.norm import RMSNorm  # noqa: E402
from pagedmoe.models.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import fix_interpreter_bf16, fix_interpreter_index  # noqa: E402

    fix_interpreter_index()
    fix_interpreter_bf16()


def rms_norm_module(weight, eps):
    norm = RMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


# ---------------------------------------------------------------- residual add + RMSNorm

@pytest.mark.parametrize("T,H", [(1, 8), (3, 7), (5, 96), (17, 130), (2, 1000), (4, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_reference(T, H, dtype, with_residual):
    g = torch.Generator(device=DEVICE).manual_seed(T * 7 + H)
    x_big = torch.randn(T, H + 5, generator=g, device=DEVICE).to(dtype)
    x = x_big[:, 2:2 + H]  # a row stride other than H
    res = torch.randn(T, H, generator=g, device=DEVICE).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(H, generator=g, device=DEVICE)).to(dtype)
    x = x * (1 + 30 * (torch.rand(T, H, generator=g, device=DEVICE) < 0.05))  # a few outliers, as real rows
    ref_out, ref_res = fused_add_rmsnorm_ref(x, res, w, 1e-6)
    summed = x if res is None else x + res  # the decoder layer's residual add, then the norm module
    with torch.no_grad():
        module_out = rms_norm_module(w, 1e-6)(summed)
    assert torch.equal(ref_out, module_out)
    out, new_res = fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(out, module_out), (out.float() - module_out.float()).abs().max()
    if with_residual:
        assert torch.equal(new_res, ref_res) and torch.equal(new_res, summed)
    else:
        assert new_res is None


def test_add_rmsnorm_in_place():
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(9, 33, generator=g, device=DEVICE)
    res = torch.randn(9, 33, generator=g, device=DEVICE)
    w = torch.randn(33, generator=g, device=DEVICE)
    ref_out, ref_res = fused_add_rmsnorm_ref(x.clone(), res.clone(), w, 1e-5)
    out, new_res = fused_add_rmsnorm(x, res, w, 1e-5, out=x, residual_out=res)
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)


def test_add_rmsnorm_rejects_bad_shapes():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rmsnorm(x, None, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(x, torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        fused_add_rmsnorm(x, x.half(), torch.ones(8, device=DEVICE), 1e-6)


# ---------------------------------------------------------------- q/k RMSNorm + RoPE + KV write

def _qkv_case(T, Hq, Hkv, D, rotary_dim, dtype, seed, num_blocks=6, block_size=4):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g, device=DEVICE).to(dtype)  # one fused projection
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    rot = RotaryEmbedding(D, 64, 10000.0, rotary_dim)
    rot.build(torch.device(DEVICE))
    positions = torch.randint(0, 64, (T,), generator=g, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g, device=DEVICE)[:T]
    slots[::3] = -1  # padding tokens: q still rotated, nothing written
    caches = [torch.full((num_blocks, block_size, Hkv, D), float("nan"), device=DEVICE, dtype=dtype) for _ in "kv"]
    return q, k, v, rot, positions, slots, caches


@pytest.mark.parametrize("T,Hq,Hkv,D,rotary_dim", [
    (1, 4, 2, 16, 16), (5, 6, 3, 10, 10), (7, 8, 1, 24, 12), (3, 4, 4, 20, 6), (11, 32, 4, 128, 128),
    (4, 12, 2, 128, 64),  # GLM-4.5: partial rotary 0.5
])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_kv_matches_reference(T, Hq, Hkv, D, rotary_dim, dtype, with_norm):
    q, k, v, rot, positions, slots, (kc, vc) = _qkv_case(T, Hq, Hkv, D, rotary_dim, dtype, seed=T + D)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    qw, kw = ((1 + 0.1 * torch.randn(D, generator=g, device=DEVICE)).to(dtype) for _ in "qk") if with_norm \
        else (None, None)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = qk_norm_rope_kv_ref(q, k, v, rot.cos_sin, positions, qw, kw, 1e-6, kc_ref, vc_ref, slots)
    # the unfused layer code itself: the per-head RMSNorm modules, then RotaryEmbedding.forward
    with torch.no_grad():
        q_mod, k_mod = (rms_norm_module(qw, 1e-6)(q), rms_norm_module(kw, 1e-6)(k)) if with_norm else (q, k)
        q_mod, k_mod = rot(positions, q_mod, k_mod)
    kc_mod, vc_mod = kc.clone(), vc.clone()
    write_kv_ref(k_mod, v, kc_mod, vc_mod, slots)
    assert torch.equal(q_ref, q_mod)
    q_in = q.clone()
    q_out = qk_norm_rope_kv(q, k, v, rot.cos_sin, positions, qw, kw, 1e-6, kc, vc, slots)
    assert torch.equal(q, q_in)  # not in place unless asked
    written = slots >= 0
    blocks, offs = slots[written] // kc.shape[1], slots[written] % kc.shape[1]
    assert torch.equal(q_out, q_mod), (q_out.float() - q_mod.float()).abs().max()
    assert torch.equal(kc[blocks, offs], kc_mod[blocks, offs]) and torch.equal(kc_ref[blocks, offs], kc_mod[blocks, offs])
    assert torch.equal(vc[blocks, offs], vc_ref[blocks, offs])
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())  # no stray writes


def test_qk_norm_rope_kv_matches_the_rotary_module_in_place():
    """The kernel against the model's own RotaryEmbedding.forward (not only the reference copy)."""
    q, k, v, rot, positions, slots, (kc, vc) = _qkv_case(6, 4, 2, 16, 8, torch.float32, seed=5)
    q_ref, k_ref = rot(positions, q.clone(), k.clone())
    out = qk_norm_rope_kv(q, k, v, rot.cos_sin, positions, None, None, 1e-6, kc, vc, slots, q_out=q)
    assert out.data_ptr() == q.data_ptr() and torch.equal(q, q_ref)
    written = slots >= 0
    assert torch.equal(kc[slots[written] // 4, slots[written] % 4], k_ref[written])


def test_qk_norm_rope_kv_rejects_bad_input():
    q, k, v, rot, positions, slots, (kc, vc) = _qkv_case(3, 4, 2, 16, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_kv(q, k, v, rot.cos_sin, positions, torch.ones(16, device=DEVICE), None, 1e-6, kc, vc, slots)
    with pytest.raises(ValueError, match="one entry per token"):
        qk_norm_rope_kv(q, k, v, rot.cos_sin, positions[:2], None, None, 1e-6, kc, vc, slots)
    with pytest.raises(ValueError, match="k and v"):
        qk_norm_rope_kv(q, k[:, :1], v[:, :1], rot.cos_sin, positions, None, None, 1e-6, kc, vc, slots)


# ---------------------------------------------------------------- router top-k

@pytest.mark.parametrize("T,E,A", [(1, 8, 2), (5, 7, 3), (17, 60, 4), (9, 128, 8), (3, 256, 8), (4, 3, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_softmax_matches_reference(T, E, A, renormalize, dtype):
    g = torch.Generator().manual_seed(T * E + A)
    # distinct logits, exact in every dtype (multiples of 1/32): torch.topk orders ties its own way
    perm = torch.stack([torch.randperm(E + 3, generator=g) for _ in range(T)]).to(DEVICE)
    logits = ((perm.float() - E / 2) / 32).to(dtype)[:, 1:1 + E]  # strided rows
    ref_w, ref_ids = route_softmax_topk(logits, A, renormalize)
    w, ids = router_topk(logits, A, renormalize)
    assert ids.dtype == ref_ids.dtype and torch.equal(ids, ref_ids)
    assert torch.equal(w, ref_w), (w - ref_w).abs().max()


@pytest.mark.parametrize("T,E,A", [(64, 8, 2), (64, 128, 8), (32, 60, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_softmax_random_logits_bit_exact(T, E, A, dtype):
    """Real-looking logits (a model's router output): weights equal bit for bit, not only close."""
    g = torch.Generator(device=DEVICE).manual_seed(E + A)
    logits = (2 * torch.randn(T, E, generator=g, device=DEVICE)).to(dtype)
    ref_w, ref_ids = route_softmax_topk(logits, A, True)
    w, ids = router_topk(logits, A, True)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w), (w - ref_w).abs().max()


@pytest.mark.parametrize("T,E,A", [(1, 8, 2), (6, 160, 8), (13, 33, 5)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_sigmoid_matches_reference(T, E, A, renormalize):
    g = torch.Generator(device=DEVICE).manual_seed(E)
    logits = torch.randn(T, E, generator=g, device=DEVICE)
    bias = torch.randn(E, generator=g, device=DEVICE) * 0.1
    ref_w, ref_ids = route_sigmoid_grouped(logits, bias, A, 1, 1, renormalize, 2.5)
    w, ids = router_topk(logits, A, renormalize, "sigmoid", bias, 2.5)
    # the torch path's topk is unsorted: compare per token in id order
    ref_ids, order = ref_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(w.gather(1, mine), ref_w.gather(1, order))


def test_router_ties_pick_the_lower_id():
    logits = torch.zeros(2, 6, device=DEVICE)
    logits[1, 4] = 1.0
    w, ids = router_topk(logits, 3, False)
    assert ids.tolist() == [[0, 1, 2], [4, 0, 1]]
    ref_w, ref_ids = route_softmax_topk(logits, 3, False)  # the unfused router breaks ties the same way
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 6, device=DEVICE))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_counts_the_routed_ids(scoring):
    """With `counts` the kernel adds 1 per routed (token, expert) to it, as the activity table's index_add
    would (experts/activity.py), on top of what it holds; the routing itself is unchanged."""
    T, E, A = 37, 60, 4
    g = torch.Generator(device=DEVICE).manual_seed(5)
    logits = torch.randn(T, E, generator=g, device=DEVICE)
    extra = () if scoring == "softmax" else ("sigmoid", torch.randn(E, generator=g, device=DEVICE) * 0.1, 2.5)
    counts = torch.full((E,), 2.0, device=DEVICE)
    w, ids = router_topk(logits, A, True, *extra, counts=counts)
    ref_w, ref_ids = router_topk(logits, A, True, *extra)
    assert torch.equal(w, ref_w) and torch.equal(ids, ref_ids)
    want = torch.full((E,), 2.0, device=DEVICE).index_add_(0, ids.reshape(-1), torch.ones(T * A, device=DEVICE))
    assert torch.equal(counts, want) and counts.sum() == 2 * E + T * A
    with pytest.raises(ValueError, match="counts"):
        router_topk(logits, A, True, *extra, counts=torch.zeros(E, dtype=torch.float64, device=DEVICE))


def test_router_counts_only_the_rows_below_count_rows():
    """count_rows (a CUDA graph's real tokens, experts/activity.py): the padding rows are routed, not counted."""
    T, E, A, real = 19, 16, 2, 7
    g = torch.Generator(device=DEVICE).manual_seed(8)
    logits = torch.randn(T, E, generator=g, device=DEVICE)
    counts = torch.zeros(E, device=DEVICE)
    w, ids = router_topk(logits, A, True, counts=counts,
                         count_rows=torch.tensor([real], dtype=torch.int64, device=DEVICE))
    ref_w, ref_ids = router_topk(logits, A, True)
    assert torch.equal(w, ref_w) and torch.equal(ids, ref_ids)
    want = torch.zeros(E, device=DEVICE).index_add_(0, ids[:real].reshape(-1), torch.ones(real * A, device=DEVICE))
    assert torch.equal(counts, want) and counts.sum() == real * A
    with pytest.raises(ValueError, match="count_rows"):
        router_topk(logits, A, True, counts=counts, count_rows=torch.tensor([real], dtype=torch.int32, device=DEVICE))


def test_router_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="experts"):
        router_topk(torch.zeros(2, 300, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(torch.zeros(2, 16, device=DEVICE), 9, True)
    with pytest.raises(ValueError, match="correction_bias"):
        router_topk(torch.zeros(2, 16, device=DEVICE), 2, True, "sigmoid")
