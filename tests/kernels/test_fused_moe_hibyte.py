"""fused_moe_hibyte (kernels/fused_moe_hibyte.py): the MoE GEMMs on experts in the lossless candidate version 3
(codecs/hibyte.py), decoded per weight tile, against decode-then-fused_moe at the same tiles.

CPU: the Triton interpreter with float32 activations. The kernel joins each K step's two decoded halves into one
K = 64 dot, as the reference's kernel runs at BLOCK_K 64, so the outputs are equal there too; at BLOCK_K 128 (two
K = 64 dots against one K = 128 dot) the interpreter sums in another order, and the check is float32 closeness.
GPU (@pytest.mark.gpu): bf16. The exact kernels run the same MMA instructions in the same order as the bf16 kernel,
so their outputs must be equal (torch.equal); exact=False (the engine's fast tier) within bf16 GEMM tolerance.
"""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' import

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.codecs import hibyte  # noqa: E402
from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels import fused_moe_hibyte as fmh  # noqa: E402
from pagedmoe.kernels.device_info import sm_count  # noqa: E402
from pagedmoe.kernels.fused_moe_hibyte import fused_moe_hibyte, fused_moe_hibyte_reference, tile_major  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if torch.cuda.is_available() else torch.float32

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()


def _layer(T, A, E, H, I, seed, tiny_every=0):
    g = torch.Generator().manual_seed(seed)
    gw = g if DEVICE == "cpu" else torch.Generator(DEVICE).manual_seed(seed)  # model shapes: weights made there
    w13 = (torch.randn(E, 2 * I, H, generator=gw, device=gw.device) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gw, device=gw.device) * I ** -0.5).bfloat16()
    if tiny_every:  # exponents far below their rows' windows: their tiles go raw
        w13.view(-1)[3::tiny_every] = 1e-30
        w2.view(-1)[5::tiny_every] = -1e-30
    x = torch.randn(T, H, generator=g).to(ACT)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), A, dim=-1)
    h13 = hibyte.encode(w13, num_parts=E)  # on the weights' device
    h2 = hibyte.encode(w2, num_parts=E)
    return x.to(DEVICE), h13, h2, weights.to(DEVICE), ids.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE)


@pytest.mark.parametrize("T,A,E,H,I,tiny,overrides", [
    (1, 2, 3, 128, 64, 0, {}),                                      # no raw tile
    (5, 2, 3, 128, 64, 3001, {}),                                     # raw tiles among coded ones
    (9, 2, 2, 256, 128, 2003, dict(block_k=128, block_k2=128)),       # two 64-column slices per K step
    (17, 4, 4, 128, 64, 1601, dict(block_m=16, block_n=32, block_n2=16)),  # several blocks per expert
    (7, 2, 2, 64, 64, 1201, dict(swap_ab=True)),
])
def test_matches_decode_then_fused_moe(T, A, E, H, I, tiny, overrides):
    x, h13, h2, weights, ids, w13, w2 = _layer(T, A, E, H, I, seed=T * 7 + H, tiny_every=tiny)
    if tiny:
        assert h13.high.shape[0] > 0 and h2.high.shape[0] > 0 and (h13.tile_raw < 0).any()
    cfg = dict(dict(block_k=64, block_k2=64), **overrides)
    ref = fused_moe_hibyte_reference(x, h13, h2, weights, ids, **cfg)
    out = fused_moe_hibyte(x, h13, h2, weights, ids, **cfg)
    assert torch.equal(ref, fm.fused_moe(x, w13.to(x.dtype), w2.to(x.dtype), weights, ids,
                                         config=None, **cfg)) or DEVICE == "cuda"
    if ACT == torch.float32 and cfg["block_k"] > 64:  # the interpreter: two K = 64 dots against one K = 128 dot
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    else:  # one K = 64 dot a step, as the reference's: the same sums, in the interpreter too
        assert torch.equal(out, ref)


@pytest.mark.parametrize("T,A,E,H,I,tiny", [(5, 2, 3, 128, 64, 3001), (17, 4, 4, 128, 64, 0)])
def test_inexact_layout_stays_close_to_the_exact_one(T, A, E, H, I, tiny):
    # exact=False skips the layout copy (mma_operand): the same weights, the MMA's K grouping left to Triton
    x, h13, h2, weights, ids, w13, w2 = _layer(T, A, E, H, I, seed=T * 5 + 1, tiny_every=tiny)
    exact = fused_moe_hibyte(x, h13, h2, weights, ids, block_k=64, block_k2=64)
    fast = fused_moe_hibyte(x, h13, h2, weights, ids, block_k=64, block_k2=64, exact=False)
    ref = fm.fused_moe(x.float(), w13.float(), w2.float(), weights, ids, config=None, block_k=64, block_k2=64)
    tol = dict(rtol=2e-5, atol=2e-5) if ACT == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(fast.float(), ref, **tol)
    torch.testing.assert_close(fast, exact, **tol)


@pytest.mark.parametrize("exact", [True, False])
def test_tile_major_bytes_give_the_same_outputs(exact):
    # the candidate layout holds the same bytes, read in the same order: the same sums, bit for bit
    x, h13, h2, weights, ids, w13, w2 = _layer(9, 2, 3, 256, 128, seed=11, tiny_every=2003)
    tm = (tile_major(h13), tile_major(h2))
    assert tm[0].numel() == h13.lo.numel() + h13.code.numel()
    for cfg in (dict(block_k=64, block_k2=64), dict(block_k=128, block_k2=128, block_n=32, block_n2=16)):
        want = fused_moe_hibyte(x, h13, h2, weights, ids, exact=exact, **cfg)
        assert torch.equal(fused_moe_hibyte(x, h13, h2, weights, ids, exact=exact, tile_major_bytes=tm, **cfg), want)
    with pytest.raises(ValueError, match=r"tile_major_bytes\[w2\] must be tile_major\(w2\)"):
        fused_moe_hibyte(x, h13, h2, weights, ids, tile_major_bytes=(tm[0], tm[0]))


def test_a_dot_per_half_matches_one_dot_per_step():
    # join_k=False (a dot per K = 32 half, the kernel before 2026-12-05) against the default (one K = 64 dot)
    x, h13, h2, weights, ids, w13, w2 = _layer(9, 2, 3, 256, 128, seed=12, tiny_every=2003)
    one = fused_moe_hibyte(x, h13, h2, weights, ids, block_k=128, block_k2=128)
    halves = fused_moe_hibyte(x, h13, h2, weights, ids, block_k=128, block_k2=128, join_k=False)
    if ACT == torch.float32:  # the interpreter's dots sum K = 32 and K = 64 in different orders
        torch.testing.assert_close(halves, one, rtol=2e-5, atol=2e-5)
    else:  # the same MMA instructions in the same K order
        assert torch.equal(halves, one)


class _Launches:
    """Stands in for fused_moe_hibyte_kernel: records each launch's keyword arguments, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(kw)
            return self.kernel[grid](*args, **kw)
        return run


def _tier_layer(kernel, comp, seed, tiny):
    """A layer as the engine's fused-hibyte tier hands it to fused_moe_mixed (experts/pager.py::_fused_parts): the
    other experts dense, those in `comp` encoded and held in the tile_major order (experts/tiers/compressed.py),
    launched as the tier's `kernel`; and the layer's bf16 weights."""
    from pagedmoe.experts.table import ExpertTable
    from pagedmoe.experts.tiers.compressed import CompressedTier

    T, A, E, H, I = 9, 2, 4, 256, 128
    x, _, _, weights, ids, w13, w2 = _layer(T, A, E, H, I, seed=seed, tiny_every=tiny)
    tier = CompressedTier(ExpertTable(1, E), 3 * I * H, torch.bfloat16, torch.device(DEVICE), False, H, I, fused=True,
                          fused_format="hibyte", fused_kernel=kernel)
    tier.encode(0, torch.cat([w13[comp].reshape(len(comp), -1), w2[comp].reshape(len(comp), -1)], 1))  # the rows
    held = tier.layers[0]
    assert held.w13.order == held.w2.order == "tile_major" and held.w13.code.numel() == 0
    dense = [e for e in range(E) if e not in comp]
    slot = lambda ids_: torch.tensor([ids_.index(e) if e in ids_ else -1 for e in range(E)], dtype=torch.int32,  # noqa
                                     device=DEVICE)
    parts = [(w13[dense].to(x.dtype), w2[dense].to(x.dtype), slot(dense)), (*held.gemm_operands(), slot(comp))]
    return x, weights, ids, parts, w13, w2, held


@pytest.mark.parametrize("kernel", ["fast", "exact"])
def test_tier_kernels_on_tile_major_experts_match_decode_then_gemm(kernel, monkeypatch):
    # the engine's fused-hibyte(-exact) tier: fused_moe_mixed over dense experts and tile_major hibyte ones against
    # fused_moe on the whole layer decoded (decode-then-GEMM); fast within bf16 GEMM tolerance, exact equal on a GPU
    x, weights, ids, parts, w13, w2, _ = _tier_layer(kernel, [1, 3], seed=21, tiny=2003)
    T, A = ids.shape
    E, two_i, H = w13.shape
    spy = _Launches(fmh.fused_moe_hibyte_kernel)
    monkeypatch.setattr(fmh, "fused_moe_hibyte_kernel", spy)
    got = fm.fused_moe_mixed(x, parts, E, weights, ids)
    ref = fm.fused_moe(x, w13.to(x.dtype), w2.to(x.dtype), weights, ids)
    if kernel == "exact" and ACT == torch.bfloat16:
        assert torch.equal(got, ref)
    else:  # fp32 in the interpreter (its dots sum in their own order); bf16 GEMM tolerance for fast on a GPU
        tol = dict(rtol=2e-5, atol=2e-5) if ACT == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(got, ref, **tol)
    # launched as TIER_KERNELS says, at the layer's tiles (fast: the bench's tm-k4-warps4 row, 4 warps both GEMMs),
    # by default and under a config whose warps are not 4 (the defaults may be)
    cfg = fm.tuned_config(T, A, E, H, two_i // 2, x.dtype, x.device) or \
        fm.default_config(T, A, E, H, two_i // 2, x.dtype, sm_count(x.device))
    _launched_as(spy.calls, kernel, cfg)
    spy.calls.clear()
    cfg = dataclasses.replace(cfg, num_warps=8, num_warps2=8)
    fm.fused_moe_mixed(x, parts, E, weights, ids, config=cfg)
    _launched_as(spy.calls, kernel, cfg)


def _launched_as(calls, kernel, cfg):
    assert [c["GATED"] for c in calls] == [True, False]
    for c, warps, bn, stages in zip(calls, (cfg.num_warps, cfg.num_warps2), (cfg.block_n, cfg.block_n2),
                                    (cfg.num_stages, cfg.num_stages2)):
        assert c["TILE_MAJOR"] and c["EXACT"] == (kernel == "exact") and c["JOIN_K"] == (kernel == "fast")
        assert (c["num_warps"], c["BLOCK_M"], c["BLOCK_N"], c["num_stages"]) == \
            (4 if kernel == "fast" else warps, cfg.block_m, bn, stages)


def test_fast_tier_is_the_benchmarked_row():
    # every expert compressed: the tier's fast launch equals bench_fused_lossless.py's tm-k4-warps4 call (the layer's
    # tiles at 4 warps, exact=False, tile_major_bytes of the row-order tensors) bit for bit
    x, weights, ids, parts, w13, w2, held = _tier_layer("fast", [0, 1, 2, 3], seed=22, tiny=1601)
    T, A = ids.shape
    E, two_i, H = w13.shape
    layer = fm.tuned_config(T, A, E, H, two_i // 2, x.dtype, x.device) or \
        fm.default_config(T, A, E, H, two_i // 2, x.dtype, sm_count(x.device))
    layer4 = dataclasses.replace(layer, num_warps=4, num_warps2=4)
    h13, h2 = hibyte.encode(w13, num_parts=E), hibyte.encode(w2, num_parts=E)
    bench = fused_moe_hibyte(x, h13, h2, weights, ids, config=layer4, exact=False,
                             tile_major_bytes=(tile_major(h13), tile_major(h2)))
    assert torch.equal(fm.fused_moe_mixed(x, parts[1:], E, weights, ids), bench)
    assert torch.equal(held.w13.lo.flatten(), tile_major(h13).flatten()) and held.nbytes == h13.nbytes + h2.nbytes


def test_refuses_other_formats():
    x, h13, h2, weights, ids, w13, w2 = _layer(1, 2, 2, 64, 64, seed=1)
    with pytest.raises(ValueError, match="must be a hibyte tensor"):
        fused_moe_hibyte(x, w13, h2, weights, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["joined", "halves", "tier-exact", "tier-fast"])
@pytest.mark.parametrize("T", [1, 16, 64, 256])
@pytest.mark.parametrize("shape", [(8, 4096, 14336, 2), (128, 2048, 768, 8)], ids=["mixtral", "qwen3"])
def test_gpu_model_shapes_against_decode_then_gemm(T, shape, variant):
    """halves (a dot per K = 32 half) and the engine's exact tier (the same on tile_major bytes at the layer's tiles,
    TIER_KERNELS["exact"]): equal to decode-then-GEMM. joined (one K = 64 dot, the kernel's default) was meant to be
    equal too, but bench_fused_lossless.py on the H200 (2026-12-05) found it 1-2 ulp off at 5 of 8 sizes: it and the
    engine's fast tier (TIER_KERNELS["fast"]: the bench's tm-k4-warps4) are checked as the bench checks k4, against
    a float32 reference: an error at most twice the bf16 kernel's own. Failures report the ulp difference."""
    from pagedmoe.models.layers.moe import experts_loop

    E, H, I, A = shape
    x, h13, h2, weights, ids, w13, w2 = _layer(T, A, E, H, I, seed=T, tiny_every=0)
    if variant.startswith("tier"):  # as fused_moe_mixed runs the tier: the layer's tiles, tile_major bytes
        layer = fm.tuned_config(T, A, E, H, I, x.dtype, x.device) or \
            fm.default_config(T, A, E, H, I, x.dtype, sm_count(x.device))
        t13, t2 = hibyte.to_tile_major(h13), hibyte.to_tile_major(h2)
        kernel = fmh.TIER_KERNELS[variant[len("tier-"):]]
        out = fm.fused_moe_groups(x, [(fmh.HiByteExperts(t13, **kernel), fmh.HiByteExperts(t2, **kernel), None)],
                                  weights, ids, T, A, E, H, I, None, layer, {})
        ref = fused_moe_hibyte_reference(x, h13, h2, weights, ids, config=layer)
    else:
        out = fused_moe_hibyte(x, h13, h2, weights, ids, join_k=variant == "halves")
        ref = fused_moe_hibyte_reference(x, h13, h2, weights, ids)
    ulp = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    report = (f"{int((ulp > 0).sum())} of {ulp.numel()} outputs differ, by up to {int(ulp.max())} bf16 ulp; max abs "
              f"{float((out - ref).abs().max()):.3g}")
    if variant in ("halves", "tier-exact"):
        assert torch.equal(out, ref), report
        return
    ref32 = experts_loop(x.float(), w13.float(), w2.float(), weights, ids)
    err, err_bf16 = float((out.float() - ref32).abs().max()), float((ref.float() - ref32).abs().max())
    assert err <= 2 * err_bf16 + 1e-6, f"error {err:.3g} against float32, bf16 kernel's {err_bf16:.3g}; {report}"


def _run_ptx(asm: str, inputs: list) -> list:
    """The straight-line PTX of the packed decode (shr / shl / and / or / xor / add on b32, prmt) on numpy uint32
    words, $0.. the outputs then the inputs: checks the kernel's own assembly text where the interpreter cannot
    run it."""
    import re

    import numpy as np

    regs = {f"${i + 2}": v.astype(np.uint64) for i, v in enumerate(inputs)}
    val = lambda s: np.uint64(int(s, 0)) if s[0].isdigit() else regs[s]  # noqa: E731
    for line in asm.splitlines():
        m = re.match(r"\s*(\w+)\.(\w+)\s+([^;]+);", line)
        if not m or m.group(1) == "reg":
            continue
        op, args = m.group(1), [a.strip() for a in m.group(3).split(",")]
        d, s = args[0], [val(a) for a in args[1:]]
        if op == "prmt":
            a, b, sel = s
            both = [(a >> np.uint64(8 * i)) & np.uint64(255) for i in range(4)] + \
                   [(b >> np.uint64(8 * i)) & np.uint64(255) for i in range(4)]
            out = np.zeros_like(a)
            for i in range(4):
                out |= both[(int(sel) >> (4 * i)) & 7] << np.uint64(8 * i)
            regs[d] = out
        else:
            f = {"shr": lambda x, y: x >> y, "shl": lambda x, y: x << y, "and": lambda x, y: x & y,
                 "or": lambda x, y: x | y, "xor": lambda x, y: x ^ y, "add": lambda x, y: x + y}[op]
            regs[d] = f(*s) & np.uint64(0xFFFFFFFF)
    return [regs["$0"], regs["$1"]]


@pytest.mark.parametrize("raw", [False, True])
def test_packed_decode_assembly_gives_the_reference_bits(raw):
    """The inline PTX the compiled kernel decodes with (_ASM_LO/_HI, _ASM_RAW_LO/_HI), run on the encoded bytes of
    N(0, 0.02) rows four weights a word, equals decode_reference bit for bit, coded and raw rows alike."""
    import numpy as np

    from pagedmoe.kernels import fused_moe_hibyte as k

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 32, 128, generator=g) * 0.02).bfloat16()
    if raw:
        x.view(-1)[::997] = 1e-30
    else:  # |x| in [0.01, 0.09]: every weight in its row's window, no raw tile (the plain assembly)
        x = (torch.sign(x.float()) * (x.float().abs() % 0.08 + 0.01)).bfloat16()
    h = hibyte.encode(x, num_parts=2)
    assert (h.high.shape[0] > 0) == raw
    want = hibyte.decode_reference(h).view(torch.int16).reshape(64, 128).numpy().astype(np.uint16)
    R, C = 64, 128
    words = lambda a: a.reshape(-1, 4).astype(np.uint64) @ (np.uint64(1) << np.arange(0, 32, 8, dtype=np.uint64))  # noqa: E731
    lo = h.lo.numpy()
    code = h.code.numpy()                       # [R, C/2]: slice s bytes j = columns 64s + j and 64s + j + 32
    base = np.repeat(h.base.numpy()[:, None], 32, 1)
    high = np.zeros((R, C // 2), np.uint8)      # the raw tiles' high nibbles in place, as the kernel loads them
    rmask = np.zeros((R, C // 2), np.uint8)
    Rp = R // 2
    for t, idx in enumerate(h.tile_raw.tolist()):
        if idx >= 0:
            p, rest = divmod(t, (C // 64) * (Rp // 16))
            tc, tr = divmod(rest, Rp // 16)
            rows = slice(p * Rp + tr * 16, p * Rp + tr * 16 + 16)
            high[rows, tc * 32:(tc + 1) * 32] = h.high[idx].numpy()
            rmask[rows, tc * 32:(tc + 1) * 32] = 255
    for s in range(C // 64):
        c = code[:, 32 * s:32 * s + 32]
        for half, (plain, rawasm) in enumerate(((k._ASM_LO, k._ASM_RAW_LO), (k._ASM_HI, k._ASM_RAW_HI))):
            l = lo[:, 64 * s + 32 * half:64 * s + 32 * half + 32]
            ins = [words(l), words(c), words(base)]
            asm = plain.value
            if h.high.shape[0]:
                ins += [words(high[:, 32 * s:32 * s + 32]), words(rmask[:, 32 * s:32 * s + 32])]
                asm = rawasm.value
            o0, o1 = _run_ptx(asm, ins)
            got = np.stack([o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16], 1).reshape(R, 32).astype(np.uint16)
            assert np.array_equal(got, want[:, 64 * s + 32 * half:64 * s + 32 * half + 32]), (s, half)


@pytest.mark.parametrize("order", hibyte.ORDERS)
@pytest.mark.parametrize("tiny", [0, 1601])
def test_decode_kernel_gives_the_reference_bits(order, tiny):
    # the standalone decode (the fused tier's prefill path): every part, and a subset in any order, bit for bit
    E, R, C = 4, 48, 128
    g = torch.Generator().manual_seed(tiny + len(order))
    w = (torch.randn(E, R, C, generator=g) * 0.02).bfloat16()
    if tiny:
        w.view(-1)[7::tiny] = 3e-30
    h = hibyte.encode(w.to(DEVICE), num_parts=E, order=order)
    if tiny:
        assert h.high.shape[0] > 0 and (h.tile_raw < 0).any()
    ref = hibyte.decode_reference(h).view(torch.int16)
    assert torch.equal(ref.cpu(), w.view(torch.int16))
    assert torch.equal(fmh.hibyte_decode(h).view(torch.int16), ref)
    parts = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(5, R, C, dtype=torch.bfloat16, device=DEVICE)
    fmh.hibyte_decode(h, parts, out=out, block_n=32)
    assert torch.equal(out[:3].view(torch.int16), ref[parts.long()])
    assert not out[3:].any()  # rows past the parts asked are not written


def test_decode_kernel_refuses_bad_arguments():
    h = hibyte.encode((torch.randn(2, 16, 64) * 0.02).bfloat16().to(DEVICE), num_parts=2)
    with pytest.raises(ValueError, match="parts must be int32"):
        fmh.hibyte_decode(h, torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="out must be bf16 or float32"):
        fmh.hibyte_decode(h, out=torch.empty(2, 16, 32, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="out must be bf16 or float32"):
        fmh.hibyte_decode(h, out=torch.empty(2, 16, 64, dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("kernel", ["fast", "exact"])
@pytest.mark.parametrize("chunk_experts", [1, 2, 8])
def test_large_blocks_decode_then_run_the_bf16_kernel(kernel, chunk_experts, monkeypatch):
    # from DECODE_MIN_ROWS routed rows an expert (0 here: always), the tier's launches decode their experts a chunk
    # at a time (DECODE_CHUNK_BYTES: 1, 2 or all of a GEMM's experts) and run the bf16 kernel on them: fused_moe_mixed
    # then equals fused_moe on the whole layer decoded, bit for bit, whichever kernel the tier runs
    x, weights, ids, parts, w13, w2, held = _tier_layer(kernel, [0, 1, 3], seed=23, tiny=1601)
    E, two_i, H = w13.shape
    monkeypatch.setenv("PAGEDMOE_HIBYTE_DECODE_ROWS", "0")
    monkeypatch.setattr(fmh, "DECODE_CHUNK_BYTES", chunk_experts * 2 * two_i * H)
    spy = _Launches(fmh.fused_moe_hibyte_kernel)
    monkeypatch.setattr(fmh, "fused_moe_hibyte_kernel", spy)
    decodes = _Launches(fmh.hibyte_decode_kernel)
    monkeypatch.setattr(fmh, "hibyte_decode_kernel", decodes)
    got = fm.fused_moe_mixed(x, parts, E, weights, ids)
    assert torch.equal(got, fm.fused_moe(x, w13.to(x.dtype), w2.to(x.dtype), weights, ids))
    assert not spy.calls  # no decode in the tile loads
    # three experts, a chunk of `chunk_experts` of w13's and twice as many of w2's (half the bytes an expert)
    assert len(decodes.calls) == -(-3 // min(3, chunk_experts)) + -(-3 // min(3, 2 * chunk_experts))
    # below the threshold the tier decodes in the GEMM as before
    monkeypatch.setenv("PAGEDMOE_HIBYTE_DECODE_ROWS", str(10 ** 6))
    decodes.calls.clear()
    fm.fused_moe_mixed(x, parts, E, weights, ids)
    assert len(spy.calls) == 2 and not decodes.calls


def test_layer_tiles_where_the_launches_decode(monkeypatch):
    # half precision from decode_min_rows() routed rows an expert: DECODED_TILES (block_m too: moe_align's blocks
    # follow them); below it, or in float32 (the interpreter), the layer's own tiles
    cfg = fm.default_config(8192, 8, 128, 2048, 768, torch.bfloat16, 132)
    rows = fmh.DECODE_MIN_ROWS
    big = fmh.layer_tiles(cfg, rows * 128, 128, torch.bfloat16)
    assert big == dataclasses.replace(cfg, **fmh.DECODED_TILES) and big.block_m == 128 and big != cfg
    assert fmh.layer_tiles(cfg, rows * 128 - 1, 128, torch.bfloat16) is cfg
    assert fmh.layer_tiles(cfg, rows * 128, 128, torch.float32) is cfg
    # the fast kernel (tile loads) from FAST_LARGE_ROWS up to the decode; not the exact one, nor below
    fast = fmh.FAST_LARGE_ROWS * 128
    fast_tiles = dataclasses.replace(cfg, **fmh.FAST_LARGE_TILES)
    assert fmh.layer_tiles(cfg, fast, 128, torch.bfloat16, fast=True) == fast_tiles != cfg
    assert fmh.layer_tiles(cfg, fast, 128, torch.bfloat16) is cfg
    assert fmh.layer_tiles(cfg, fast - 1, 128, torch.bfloat16, fast=True) is cfg
    assert fmh.layer_tiles(cfg, rows * 128, 128, torch.bfloat16, fast=True) == big
    monkeypatch.setenv("PAGEDMOE_HIBYTE_DECODE_ROWS", "1")
    assert fmh.layer_tiles(cfg, 128, 128, torch.float16).block_n2 == 128
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv("PAGEDMOE_HIBYTE_DECODE_ROWS", bad)
        with pytest.raises(ValueError, match="PAGEDMOE_HIBYTE_DECODE_ROWS must be a whole number"):
            fmh.layer_tiles(cfg, 128, 128, torch.bfloat16)
    monkeypatch.setenv("PAGEDMOE_HIBYTE_DECODE_ROWS", "1")
    # fused_moe_mixed takes them for a layer holding hibyte parts, unless given a config; fast when every hibyte
    # part runs the fast kernel
    seen = []
    monkeypatch.setattr(fmh, "layer_tiles", lambda c, n, e, d, fast: seen.append((n, e, d, fast)) or c)
    for kernel in ("fast", "exact"):
        x, weights, ids, parts, w13, w2, _ = _tier_layer(kernel, [1, 3], seed=24, tiny=0)
        fm.fused_moe_mixed(x, parts, w13.shape[0], weights, ids)
        assert seen[-1] == (ids.numel(), w13.shape[0], x.dtype, kernel == "fast")
        fm.fused_moe_mixed(x, parts[:1], w13.shape[0], weights, ids)
        fm.fused_moe_mixed(x, parts, w13.shape[0], weights, ids, config=cfg)
    assert len(seen) == 2
