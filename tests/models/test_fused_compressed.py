"""--compressed-gemm fused (issue 23): the lossless compressed GPU tier held in format v2 (codecs/tiled.py) and read
by the MoE GEMMs themselves (kernels/fused_moe_lossless.py through fused_moe_mixed), never decoded into the
compute buffers. Same Triton kernels on both sides (--moe-backend triton): the logits equal the decoding path's
bit for bit. CPU: a subprocess under the Triton interpreter (chosen before any kernel is imported; its bf16 dot
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
# test_quantized_gemm's prelude (the interpreter when there is no GPU), plus real bf16 products in its tl.dot
SCRIPT = PRELUDE + r"""
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import fix_interpreter_bf16_dot
    fix_interpreter_bf16_dot()

path = sys.argv[1]
out = {}
for gemm in ("decode", sys.argv[2]):
    llm = LLM(path, device="cuda" if torch.cuda.is_available() else "cpu", dtype="bfloat16", max_model_len=96,
              moe_backend="triton", num_gpu_experts=2, num_compressed_experts=4, compressed_gemm=gemm)
    cap, _ = greedy_logits(llm, (9, 21, 4), max_tokens=4, seed=7)
    torch.save([c.cpu() for c in cap], os.path.join(path, gemm + ".pt"))
    store = llm.engine.expert_store
    stats = llm.engine.get_stats()
    out[gemm] = dict(decoded=stats["expert_bytes_decoded"], compressed_bytes=store.compressed_bytes,
                     bf16_bytes=4 * len(store.compressed) * store.expert_numel * 2,
                     versions=sorted({getattr(getattr(c, "w13", c), "version", 1) for c in store.compressed}),
                     experts=stats["experts"])
print(json.dumps(out))
"""


def _check(tmp_path, gemm="fused"):
    # fused-hibyte: experts of 64 x 64 (the format's multiples of 64)
    extra = dict(intermediate_size=64) if gemm == "fused-hibyte" else {}
    make_tiny_checkpoint("mixtral", tmp_path, seed=61, dtype=torch.bfloat16, num_hidden_layers=2, **extra)
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent / "src"), PAGEDMOE_NO_PROGRESS="1", TESTS_DIR=str(TESTS),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), gemm], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    ref, got = torch.load(tmp_path / "decode.pt"), torch.load(tmp_path / f"{gemm}.pt")
    assert len(ref) == len(got) > 0
    if gemm == "fused" or torch.cuda.is_available():
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    else:  # the interpreter sums hibyte's K = 32 halves in another order than one K = 64 step (a GPU does not)
        assert all(torch.allclose(a, b, rtol=0, atol=1e-2) for a, b in zip(ref, got))
    dec, fused = res["decode"], res[gemm]
    assert dec["experts"] == fused["experts"] and fused["experts"]["compressed/bf16"] == 4 * 2
    assert dec["versions"] == [1] and fused["versions"] == [2 if gemm == "fused" else 3]
    assert dec["decoded"] > 0 and fused["decoded"] == 0          # the fused tier is never decoded to bf16
    assert 0 < fused["compressed_bytes"] < fused["bf16_bytes"]


def test_fused_compressed_tier_logits_equal_the_decoding_path(tmp_path):
    _check(tmp_path)


def test_fused_hibyte_tier_logits_match_the_decoding_path(tmp_path):
    _check(tmp_path, "fused-hibyte")


@pytest.mark.gpu
def test_fused_hibyte_tier_logits_equal_the_decoding_path_gpu(tmp_path):
    """On CUDA: the packed decode's logits equal the decoding path's bit for bit."""
    _check(tmp_path, "fused-hibyte")


@pytest.mark.gpu
def test_fused_compressed_tier_logits_equal_the_decoding_path_gpu(tmp_path):
    """On CUDA (bf16, CUDA graphs for decode steps): the same equality."""
    _check(tmp_path)


def test_fused_compressed_flag_checks():
    from pagedmoe.config import EngineConfig

    with pytest.raises(ValueError, match="needs --num-compressed-experts"):
        EngineConfig(model="m", compressed_gemm="fused")
    with pytest.raises(ValueError, match="moe-backend grouped_mm"):
        EngineConfig(model="m", compressed_gemm="fused", num_compressed_experts=2, num_gpu_experts=1,
                     moe_backend="grouped_mm")
    with pytest.raises(ValueError, match="compressed_gemm must be one of"):
        EngineConfig(model="m", compressed_gemm="maybe")


def test_fused_hibyte_refuses_shapes_it_cannot_hold(tmp_path):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=3, dtype=torch.bfloat16, num_hidden_layers=2)  # I = 32
    with pytest.raises(ValueError, match=r"fused-hibyte needs .* expert intermediate size \(32\) to be multiples of 64"):
        LLM(str(tmp_path), device="cpu", dtype="bfloat16", max_model_len=64, moe_backend="triton", num_gpu_experts=2,
            num_compressed_experts=4, compressed_gemm="fused-hibyte")
