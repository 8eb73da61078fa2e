"""fused_moe_lossless (kernels/fused_moe_lossless.py): MoE GEMMs that decode tiled-lossless experts (format
version 2) tile by tile, against decode-then-fused_moe.

With the same config both run the same programs with the same reductions, so the outputs are equal bit for
bit (torch.equal). CPU: the Triton interpreter with float32 activations (its tl.dot reads bf16 as raw
integers; the decoded bf16 weights are exact in float32), small odd shapes, escapes forced into many tiles.
GPU (@pytest.mark.gpu): bf16 activations, the Mixtral-8x7B and Qwen3-30B-A3B layer shapes.
"""
import dataclasses
import functools
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.codecs import tiled  # noqa: E402
from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels.device_info import sm_count  # noqa: E402
from pagedmoe.kernels.fused_moe_lossless import (fused_moe_lossless, fused_moe_lossless_reference,  # noqa: E402
                                                 lossless_config)
from pagedmoe.models.layers.moe import experts_loop  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if torch.cuda.is_available() else torch.float32

if INTERPRET:
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()


@functools.lru_cache(maxsize=2)  # the GPU tests reuse a model-sized layer across token counts
def _experts(E, H, I, seed, escape_every):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=DEVICE) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device=DEVICE) * I ** -0.5).bfloat16()
    if escape_every:
        w13.view(-1)[3::escape_every] = 1e-30
        w2.view(-1)[5::escape_every] = -1e-30
    return tiled.encode(w13, num_parts=E), tiled.encode(w2, num_parts=E), w13, w2


def make_layer(T, A, E, H, I, seed, escape_every=0, dtype=ACT, weight_seed=None):
    """Tiled experts (bf16 weights; every escape_every-th weight tiny, so it escapes), x, top-A routing."""
    t13, t2, w13, w2 = _experts(E, H, I, seed if weight_seed is None else weight_seed, escape_every)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), A, dim=-1)
    return x.to(DEVICE), t13, t2, weights.to(DEVICE), ids.to(DEVICE), w13, w2


def check(T, A, E, H, I, seed=0, escape_every=0, escapes=("loop",), weight_seed=None, **overrides):
    x, t13, t2, weights, ids, w13, w2 = make_layer(T, A, E, H, I, seed, escape_every, weight_seed=weight_seed)
    if escape_every:
        assert t13.escapes.numel() > 0 and t2.escapes.numel() > 0
    ref = fused_moe_lossless_reference(x, t13, t2, weights, ids, **overrides)
    for mode in escapes:
        out = torch.full_like(x, float("nan"))
        fused_moe_lossless(x, t13, t2, weights, ids, out=out, escapes=mode, **overrides)
        assert torch.equal(out, ref), f"escapes={mode}: max diff {(out.float() - ref.float()).abs().max()}"
    # and the decoded weights are the originals: the reference is fused_moe on the bf16 experts, same tiles
    cfg = lossless_config(T, A, E, H, I, x.dtype, sm_count(x.device))
    assert torch.equal(ref, fm.fused_moe(x, w13.to(x.dtype), w2.to(x.dtype), weights, ids, config=cfg, **overrides))
    return out, x, w13, w2, weights, ids


BOTH = ("loop", "unrolled")


# The interpreter runs the escape loop once per escape a program meets, so its time grows with the escape count:
# the cases that test tile shapes put an escape in (nearly) every 16 x 64 escape tile, few enough (1 in ~150-190
# weights) that escapes_cap stays <= MAX_UNROLLED_ESCAPES, so escapes="unrolled" runs the unrolled patches
# (ESC_CAP > 0); only the last case is dense (half the weights), where "unrolled" falls back to the loop (ESC_CAP -1,
# the same launch as escapes="loop").
@pytest.mark.parametrize("T,A,E,H,I,esc,modes,overrides", [
    (1, 2, 4, 48, 80, 0, ("loop",), {}),                             # one token
    (3, 1, 3, 70, 37, 151, BOTH, {}),                                # odd K and N: masked tiles, odd nibble rows
    (3, 2, 2, 130, 72, 191, BOTH, dict(block_k=128, block_k2=128)),  # two 64-column escape tiles per weight tile
    (5, 2, 3, 64, 40, 173, ("loop",), dict(block_k=32, block_k2=16, split_k=3)),  # tiles narrower than an escape tile
    (17, 4, 8, 96, 48, 173, ("loop",), dict(swap_ab=True)),
    (17, 4, 4, 64, 64, 173, ("loop",), dict(block_m=16, block_n=32, block_n2=16)),  # several blocks per expert
    (3, 2, 2, 72, 24, 2, ("unrolled",), {}),                         # half the weights escape: the loop (cap -1)
])
def test_matches_decode_then_fused_moe(T, A, E, H, I, esc, modes, overrides):
    if INTERPRET and "unrolled" in modes:  # the branch of _decode_tile that escapes="unrolled" takes at these tiles
        from pagedmoe.kernels.fused_moe_lossless import escapes_cap

        _, t13, t2, *_ = make_layer(T, A, E, H, I, T * 31 + H, esc)
        cfg = dataclasses.replace(lossless_config(T, A, E, H, I, ACT), **overrides)
        caps = (escapes_cap(t13, cfg.block_n), escapes_cap(t2, cfg.block_n2))
        assert (all(c > 0 for c in caps) if modes == BOTH else caps == (-1, -1)), caps  # unrolled; dense: the loop
    check(T, A, E, H, I, seed=T * 31 + H, escape_every=esc, escapes=modes, **overrides)


@pytest.mark.parametrize("every,caps", [(0, (0, 0)), (997, None), (301, None), (2, (-1, -1))])
def test_escape_caps(every, caps):
    """escapes_cap by escape density: none (0), a few per weight-tile column (unrolled, a power of two), more
    than MAX_UNROLLED_ESCAPES (-1: the loop); the count bound checked against a brute-force window count."""
    from pagedmoe.kernels.fused_moe_lossless import MAX_UNROLLED_ESCAPES, escapes_cap

    g = torch.Generator().manual_seed(every)
    w13, w2 = (torch.randn(3, 144, 200, generator=g) * 0.02).bfloat16(), (torch.randn(3, 200, 72, generator=g) * 0.02).bfloat16()
    for w, start in ((w13, 3), (w2, 5)):
        if every:
            w.view(-1)[start::every] = 1e-30
        else:
            w.abs_().add_(0.01)  # |w| in [0.01, 0.1): every exponent in each row's window
    t13, t2 = tiled.encode(w13, num_parts=3), tiled.encode(w2, num_parts=3)
    got = (escapes_cap(t13, 32), escapes_cap(t2, 16))
    if caps is not None:
        assert got == caps
        return
    for tt, bn, cap in ((t13, 32, got[0]), (t2, 16, got[1])):
        counts = torch.diff(tt.escape_offsets.long()).view(tt.num_parts, tt.tile_cols, tt.tile_rows_per_part)
        w = bn // 16 + 1
        worst = max(int(counts[p, c, r:r + w].sum()) for p in range(tt.num_parts) for c in range(tt.tile_cols)
                    for r in range(tt.tile_rows_per_part))
        assert worst <= MAX_UNROLLED_ESCAPES and cap == 1 << (worst - 1).bit_length()


def test_matches_the_expert_loop():
    out, x, w13, w2, weights, ids = check(7, 2, 4, 48, 40, seed=3, escape_every=37)
    ref = experts_loop(x.double(), w13.double(), w2.double(), weights.float(), ids).float()
    assert ((out.float() - ref).norm() / ref.norm()).item() < (1e-5 if ACT == torch.float32 else 1e-2)


def test_up_rows_off_the_escape_tile_grid():
    # I = 24: the up rows of a gated tile start at row 24 of the part, mid escape tile; escapes in both halves
    # (every 23rd weight: ~45 in gate rows 16-23 and ~44 in up rows 24-31, the escape tile they share)
    check(4, 2, 2, 64, 24, seed=8, escape_every=23, block_n=16)


@pytest.mark.parametrize("T,E,A,H,I", [(6, 5, 2, 72, 40), (3, 4, 3, 130, 24)])
def test_mixed_layer_with_a_lossless_part(T, E, A, H, I):
    """fused_moe_mixed with exact, lossless-v2 and int8 experts (one part each) equals fused_moe on the layer
    assembled from the exact, decoded (= original) and dequantized weights, bit for bit: the v2 part runs
    fused_moe_lossless_kernel over the same blocks and splits, skipping the other parts' experts."""
    from pagedmoe.codecs.quant import dequantize, quantize
    from pagedmoe.experts.tiers.quantized import stack_quantized

    g = torch.Generator().manual_seed(E * H + T)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    w13.view(-1)[7::23] = 1e-30  # escapes in the lossless part's tiles
    groups = {"exact": [0, 3], "lossless": [1] + ([4] if E > 4 else []), "int8": [2]}
    full13, full2 = w13.to(DEVICE, ACT).clone(), w2.to(DEVICE, ACT).clone()
    parts = []
    for kind, ids in groups.items():
        slots = torch.full((E,), -1, dtype=torch.int32)
        slots[ids] = torch.arange(len(ids), dtype=torch.int32)
        if kind == "exact":
            parts.append((w13[ids].to(DEVICE, ACT), w2[ids].to(DEVICE, ACT), slots.to(DEVICE)))
        elif kind == "lossless":
            t13 = tiled.encode(w13[ids].contiguous().to(DEVICE), num_parts=len(ids))
            t2 = tiled.encode(w2[ids].contiguous().to(DEVICE), num_parts=len(ids))
            assert t13.escapes.numel() > 0
            parts.append((t13, t2, slots.to(DEVICE)))
        else:
            q13 = stack_quantized([quantize(w13[e].float().to(DEVICE), kind) for e in ids])
            q2 = stack_quantized([quantize(w2[e].float().to(DEVICE), kind) for e in ids])
            full13[ids] = dequantize(q13, ACT).view(len(ids), 2 * I, H)
            full2[ids] = dequantize(q2, ACT).view(len(ids), H, I)
            parts.append((q13, q2, slots.to(DEVICE)))
    x = torch.randn(T, H, generator=g).to(DEVICE, ACT)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g).to(DEVICE), -1), A, dim=-1)
    got = fm.fused_moe_mixed(x, parts, E, weights, ids)
    assert torch.equal(got, fm.fused_moe(x, full13, full2, weights, ids))
    with pytest.raises(ValueError, match="bf16 activations"):
        fm.fused_moe_mixed(x.half(), [parts[1]], E, weights, ids)  # the lossless part alone


@pytest.mark.parametrize("T", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("E,A,H,I", [(8, 2, 4096, 14336), (128, 8, 2048, 768)])
def test_lossless_config_keeps_fused_moes_sums(T, E, A, H, I):
    """lossless_config changes only warps and w2's K step from fused_moe's own tiles: the blocks, the column tiles,
    the MMA kind (block_m) and the w2 split boundaries (split_step) are fused_moe's, so on the GPU its output equals
    decode-then-fused_moe at fused_moe's tiles (test_gpu_equals_fused_moe_at_its_own_tiles)."""
    from pagedmoe.kernels.fused_moe_config import default_config

    base = default_config(T, A, E, H, I, torch.bfloat16, 132)
    cfg = lossless_config(T, A, E, H, I, torch.bfloat16, 132)
    same = ("block_m", "block_n", "block_k", "block_n2", "split_k", "swap_ab")
    assert all(getattr(cfg, f) == getattr(base, f) for f in same)
    assert cfg.block_k2 == 64 and cfg.split_step == base.block_k2
    for blocks in (1, E, 4 * E):
        assert fm.w2_splits(cfg, blocks, T, A, E, H, I, 132) == fm.w2_splits(base, blocks, T, A, E, H, I, 132)
    with pytest.raises(ValueError, match="split_step"):
        dataclasses.replace(cfg, split_step=96)


def test_launcher_checks():
    x, t13, t2, weights, ids, w13, w2 = make_layer(3, 2, 4, 32, 16, seed=4)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe_lossless(x, t13, t13, weights, ids)
    with pytest.raises(ValueError, match="hidden size"):
        fused_moe_lossless(x[:, :16], t13, t2, weights, ids)
    with pytest.raises(ValueError, match="version 2"):
        from pagedmoe.codecs.lossless import encode

        fused_moe_lossless(x, encode(w13, num_parts=4), t2, weights, ids)
    with pytest.raises(ValueError, match="one part per expert"):
        fused_moe_lossless(x, tiled.encode(w13.reshape(4, 32, 32)), t2, weights, ids)
    with pytest.raises(ValueError, match="bf16"):
        fused_moe_lossless(x.half(), t13, t2, weights, ids)
    assert fused_moe_lossless(x[:0], t13, t2, weights[:0], ids[:0]).shape == (0, 32)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("E,A,H,I", [(8, 2, 4096, 14336), (128, 8, 2048, 768)])
def test_gpu_model_shapes(T, E, A, H, I):
    # Mixtral-8x7B and Qwen3-30B-A3B layers at decode sizes, bf16, default tiles: bit-equal to decode-then-GEMM
    check(T, A, E, H, I, seed=T + E, escapes=BOTH, weight_seed=E)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 64, 256])
@pytest.mark.parametrize("E,A,H,I", [(8, 2, 4096, 14336), (128, 8, 2048, 768)])
def test_gpu_equals_fused_moe_at_its_own_tiles(T, E, A, H, I):
    """The default call, lossless_config's tiles, against what the unfused engine runs: the decoded bf16 experts
    through fused_moe with its own tiles (default_config; tuned tables off). Same blocks, MMA kind and split
    boundaries, other warps and w2 K steps (test_lossless_config_keeps_fused_moes_sums): equal bit for bit."""
    x, t13, t2, weights, ids, w13, w2 = make_layer(T, A, E, H, I, seed=T + E + 1, weight_seed=E)
    got = fused_moe_lossless(x, t13, t2, weights, ids)
    ref = fm.fused_moe(x, w13, w2, weights, ids, config=fm.default_config(T, A, E, H, I, x.dtype, sm_count(x.device)))
    assert torch.equal(got, ref), f"max diff {(got.float() - ref.float()).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [dict(swap_ab=True), dict(split_k=3), dict(block_m=64), dict(block_n=16, block_n2=16),
                                       dict(block_k=128, block_k2=256, split_step=256, num_stages=2, num_stages2=2)])
def test_gpu_variants_with_escapes(overrides):
    check(64, 2, 8, 1024, 1408, seed=11, escape_every=997, escapes=BOTH, **overrides)
    check(7, 8, 64, 512, 176, seed=12, escape_every=101, escapes=BOTH, **overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 256])
def test_gpu_mixed_layer_qwen3_shape(T):
    """A Qwen3-30B-A3B layer with 96 of its 128 experts in lossless format v2 and 32 resident bf16 (the
    compressed tier of a paged layer): fused_moe_mixed equals fused_moe on the bf16 layer bit for bit."""
    E, A, H, I = 128, 8, 2048, 768
    x, t13, t2, weights, ids, w13, w2 = make_layer(T, A, E, H, I, seed=T, weight_seed=E)
    comp = torch.arange(32, E)
    slots_c = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
    slots_c[comp] = torch.arange(E - 32, dtype=torch.int32, device=DEVICE)
    slots_r = torch.full((E,), -1, dtype=torch.int32, device=DEVICE)
    slots_r[:32] = torch.arange(32, dtype=torch.int32, device=DEVICE)
    c13 = tiled.encode(w13[32:].contiguous(), num_parts=E - 32)
    c2 = tiled.encode(w2[32:].contiguous(), num_parts=E - 32)
    got = fm.fused_moe_mixed(x, [(w13[:32], w2[:32], slots_r), (c13, c2, slots_c)], E, weights, ids)
    assert torch.equal(got, fm.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.gpu
def test_gpu_cuda_graph():
    x, t13, t2, weights, ids, _, _ = make_layer(48, 2, 8, 512, 704, seed=14, escape_every=301)
    out = fused_moe_lossless(x, t13, t2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_lossless(x, t13, t2, weights, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


# ---------------------------------------------------------------- the benchmark scripts' CPU smoke modes


def _run_script(tmp_path, *argv):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, *argv, "--quick", "--out", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout, json.loads(next(tmp_path.glob("*.json")).read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark")
def test_bench_fused_lossless_quick(tmp_path):
    out, res = _run_script(tmp_path, "benchmarks/bench_fused_lossless.py")
    assert len(res["rows"]) == 4 and all(r["variants"]["default"]["equal_to_bf16_gemm"] for r in res["rows"])
    assert all(r["touched_lossless_bytes"] < r["touched_bf16_bytes"] for r in res["rows"])
    assert "every output equal" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark")
def test_bench_fused_prefill_quick(tmp_path):
    # every row of the prefill-size bench runs and passes its check (the decode bit for bit, decode+grouped equal to
    # grouped, the Triton rows and the tier's within tolerance) on a tiny layer in the interpreter
    out, res = _run_script(tmp_path, "benchmarks/bench_fused_prefill.py")
    (row,) = res["rows"]
    assert not row["errors"] and {"grouped", "tier", "tier-decoded", "decode+grouped"} <= set(row["checked"])
    assert len(row["checked"]) == 6 + 2 and max(row["rel_err"].values()) < 1e-5  # one tiling of each kernel
    assert "tier-decoded           checked" in out


def test_lossless_formats_quick(tmp_path):
    out, res = _run_script(tmp_path, "benchmarks/lossless_formats.py")
    for r in res["inputs"].values():
        assert set(r["rows"]) == {"huffman", "tiled", "nib4-global", "nib3-row", "cb3-tile"}
        assert r["rows"]["huffman"]["ratio"] < r["rows"]["tiled"]["ratio"] < 0.8
        assert r["rows"]["tiled"]["escape_rate"] < 1e-3 < r["rows"]["nib3-row"]["escape_rate"]
    assert "default model" in out


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """benchmarks/lossless_ptxas.py --quick: both GEMMs at lossless_config's tiles (Mixtral and Qwen3 at 64 tokens),
    compiled for sm_90 by Triton's ptxas on any machine: no stack (spills) in the decode loop."""
    import shutil
    from pathlib import Path

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "cuobjdump").exists() and not shutil.which("cuobjdump"):
        pytest.skip("Triton's NVIDIA tools are not installed")
    _, res = _run_script(tmp_path, "benchmarks/lossless_ptxas.py")
    assert len(res["rows"]) >= 4 and {r["gemm"] for r in res["rows"]} == {"w13", "w2"}
    assert all(r["stack_bytes"] == 0 for r in res["rows"]), res["rows"]
