"""--compressed-gemm fused (issue 23): the lossless compressed GPU tier held in format v2 (codecs/tiled.py) and read
by the MoE GEMMs themselves (kernels/fused_moe_lossless.py through fused_moe_mixed), never decoded into the
compute buffers. Same Triton kernels on both sides (--moe-backend triton): the logits equal the decoding path's
bit for bit. fused-hibyte-exact (version 3, kernels/fused_moe_hibyte.py's exact kernel) too, on the GPU; fused-hibyte
(the fast kernel: decoded in the MMA operand registers, which group K their own way) within FAST_ATOL of them, the
same tokens. CPU: a subprocess under the Triton interpreter (chosen before any kernel is imported; its bf16 dot
widened to float32 by tests/kernels/triton_interp.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_quantized_gemm import PRELUDE
from tiny_models import make_tiny_checkpoint

TESTS = Path(__file__).resolve().parents[1]
# fused-hibyte against the decoding path: the logits' largest difference. Its MoE outputs are within bf16 GEMM
# tolerance of decode-then-GEMM (1-2 bf16 ulps at the H200's model shapes, 2026-12-05); this model's logits are
# below 4 (a bf16 ulp there is at most 2^-6), so this allows about three ulps. In the interpreter they measured equal.
FAST_ATOL = 5e-2
# test_quantized_gemm's prelude (the interpreter when there is no GPU), plus real bf16 products in its tl.dot
SCRIPT = PRELUDE + r"""
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import fix_interpreter_bf16_dot
    fix_interpreter_bf16_dot()

path = sys.argv[1]
out = {}
for gemm in ("decode", *sys.argv[2:]):
    llm = LLM(path, device="cuda" if torch.cuda.is_available() else "cpu", dtype="bfloat16", max_model_len=96,
              moe_backend="triton", num_gpu_experts=2, num_compressed_experts=4, compressed_gemm=gemm)
    cap, outs = greedy_logits(llm, (9, 21, 4), max_tokens=4, seed=7)
    torch.save([c.cpu() for c in cap], os.path.join(path, gemm + ".pt"))
    store = llm.engine.expert_store
    stats = llm.engine.get_stats()
    out[gemm] = dict(decoded=stats["expert_bytes_decoded"], compressed_bytes=store.compressed_bytes,
                     bf16_bytes=4 * len(store.compressed) * store.expert_numel * 2,
                     versions=sorted({getattr(getattr(c, "w13", c), "version", 1) for c in store.compressed}),
                     orders=sorted({str(getattr(getattr(c, "w13", c), "order", None)) for c in store.compressed}),
                     experts=stats["experts"], tokens=[list(o.outputs[0].token_ids) for o in outs])
print(json.dumps(out))
"""


def _run(path, *gemms) -> dict:
    """The decoding path and each of `gemms` on one tiny checkpoint, in one subprocess (one interpreter start, the
    decoding path's reference once); fused-hibyte's experts are 64 x 64 (the format's multiples of 64)."""
    extra = dict(intermediate_size=64) if gemms[0].startswith("fused-hibyte") else {}
    make_tiny_checkpoint("mixtral", path, seed=61, dtype=torch.bfloat16, num_hidden_layers=2, **extra)
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent / "src"), PAGEDMOE_NO_PROGRESS="1", TESTS_DIR=str(TESTS),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), *gemms], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(tmp_path, gemm="fused", runs=None):
    hib = gemm.startswith("fused-hibyte")
    res = runs if runs is not None else _run(tmp_path, gemm)
    ref, got = torch.load(tmp_path / "decode.pt"), torch.load(tmp_path / f"{gemm}.pt")
    assert len(ref) == len(got) > 0
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, got))
    if gemm == "fused" or gemm == "fused-hibyte-exact" and torch.cuda.is_available():
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), f"logits differ by up to {diff:.3g}"
    elif gemm == "fused-hibyte":  # not bit-equal by design (GPU and interpreter): bf16 GEMM tolerance, stated above
        assert diff <= FAST_ATOL, f"logits differ by up to {diff:.3g} (tolerance {FAST_ATOL})"
    else:  # exact, in the interpreter: numpy sums the K = 32 halves in another order than one K = 64 step
        assert diff <= 1e-2, f"logits differ by up to {diff:.3g}"
    dec, fused = res["decode"], res[gemm]
    assert dec["tokens"] == fused["tokens"]
    assert dec["experts"] == fused["experts"] and fused["experts"]["compressed/bf16"] == 4 * 2
    assert dec["versions"] == [1] and fused["versions"] == [3 if hib else 2]
    assert fused["orders"] == (["tile_major"] if hib else ["None"])  # one copy, the order the kernels read
    assert dec["decoded"] > 0 and fused["decoded"] == 0          # the fused tier is never decoded to bf16
    assert 0 < fused["compressed_bytes"] < fused["bf16_bytes"]


def test_fused_compressed_tier_logits_equal_the_decoding_path(tmp_path):
    _check(tmp_path)


def test_fused_hibyte_tier_logits_match_the_decoding_path(tmp_path):
    # both kernels in one test: one subprocess and one decoding-path reference (a fixture could run once per xdist
    # worker)
    runs = _run(tmp_path, "fused-hibyte", "fused-hibyte-exact")
    for gemm in ("fused-hibyte", "fused-hibyte-exact"):
        _check(tmp_path, gemm, runs)


@pytest.mark.gpu
def test_fused_hibyte_exact_tier_logits_equal_the_decoding_path_gpu(tmp_path):
    """On CUDA: the exact kernel's logits equal the decoding path's bit for bit."""
    _check(tmp_path, "fused-hibyte-exact")


@pytest.mark.gpu
def test_fused_hibyte_tier_logits_within_tolerance_of_the_decoding_path_gpu(tmp_path):
    """On CUDA: the fast kernel (tile-major bytes, decoded in the MMA operands, 4 warps) within FAST_ATOL."""
    _check(tmp_path, "fused-hibyte")


@pytest.mark.gpu
def test_fused_compressed_tier_logits_equal_the_decoding_path_gpu(tmp_path):
    """On CUDA (bf16, CUDA graphs for decode steps): the same equality."""
    _check(tmp_path)


def test_fused_compressed_flag_checks():
    from pagedmoe.config import EngineConfig

    for gemm in ("fused", "fused-hibyte", "fused-hibyte-exact"):  # nothing for it to read: refused, not ignored
        with pytest.raises(ValueError, match=f"--compressed-gemm {gemm} reads the lossless .* needs --num-compressed"):
            EngineConfig(model="m", compressed_gemm=gemm)
    with pytest.raises(ValueError, match="moe-backend grouped_mm"):
        EngineConfig(model="m", compressed_gemm="fused", num_compressed_experts=2, num_gpu_experts=1,
                     moe_backend="grouped_mm")
    with pytest.raises(ValueError, match="compressed_gemm must be one of"):
        EngineConfig(model="m", compressed_gemm="maybe")


@pytest.mark.parametrize("gemm", ["fused-hibyte", "fused-hibyte-exact"])
def test_fused_hibyte_refuses_shapes_it_cannot_hold(tmp_path, gemm):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=3, dtype=torch.bfloat16, num_hidden_layers=2)  # I = 32
    with pytest.raises(ValueError, match=rf"{gemm} needs .* expert intermediate size \(32\) to be multiples of 64"):
        LLM(str(tmp_path), device="cpu", dtype="bfloat16", max_model_len=64, moe_backend="triton", num_gpu_experts=2,
            num_compressed_experts=4, compressed_gemm=gemm)
