"""--quantized-gemm direct (static lossy experts): decode-sized forwards skip the pager's dequantisation and
the Triton MoE GEMMs read the quantized weights (kernels/fused_moe.py::fused_moe_quantized). With the same
Triton kernels on both sides (--moe-backend triton) the logits equal the dequantising path's bit for bit.
CPU: a subprocess under the Triton interpreter (it must be chosen before any kernel is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_checkpoint

TESTS = Path(__file__).resolve().parents[1]
# Both scripts get the tests folder in TESTS_DIR (tiny_models, and the interpreter fix the kernel tests use).
PRELUDE = r"""
import json, os, sys
sys.path[:0] = [os.environ["TESTS_DIR"], os.path.join(os.environ["TESTS_DIR"], "kernels")]
import torch
if not torch.cuda.is_available():  # the interpreter, chosen before any kernel is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interp import fix_interpreter_index
    fix_interpreter_index()
from tiny_models import greedy_logits
from pagedmoe import LLM
"""
SCRIPT = PRELUDE + r"""
path, precision = sys.argv[1], sys.argv[2]
out = {}
for gemm in ("dequant", "direct"):
    llm = LLM(path, device="cuda" if torch.cuda.is_available() else "cpu", max_model_len=96,
              expert_precision="static-" + precision, moe_backend="triton", quantized_gemm=gemm)
    cap, _ = greedy_logits(llm, (9, 21, 4), max_tokens=4, seed=7)
    torch.save([c.cpu() for c in cap], os.path.join(path, gemm + ".pt"))
    out[gemm] = llm.engine.get_stats()["expert_bytes_dequantized"]
print(json.dumps(out))
"""


def _check_equal(tmp_path, precision):
    make_tiny_checkpoint("mixtral", tmp_path, seed=51, num_hidden_layers=2)
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent / "src"), PAGEDMOE_NO_PROGRESS="1", TESTS_DIR=str(TESTS))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), precision], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dequantized = json.loads(proc.stdout.strip().splitlines()[-1])
    ref, got = torch.load(tmp_path / "dequant.pt"), torch.load(tmp_path / "direct.pt")
    assert len(ref) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(ref, got))
    assert dequantized["dequant"] > 0 and dequantized["direct"] == 0   # no forward here exceeds 512 tokens


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_direct_quantized_gemm_equals_dequantising(tmp_path, precision):
    _check_equal(tmp_path, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp8", "int8", "int4"])
def test_direct_quantized_gemm_equals_dequantising_gpu(tmp_path, precision):
    """On CUDA (bf16, CUDA graphs for decode): the same equality, fp8 included."""
    _check_equal(tmp_path, precision)


DYNAMIC_SCRIPT = PRELUDE + r"""
path = sys.argv[1]
L, E = 2, 8
pmap = [["bf16", "int8", "int4", "bf16", "int8", "int4", "bf16", "int8"], ["int8"] * 7 + ["bf16"]]
stats = os.path.join(path, "stats.json")
with open(stats, "w") as f:
    json.dump({"total": [[0.0] * E] * L, "ema": [[0.0] * E] * L, "decay": 0.99, "precision_map": pmap}, f)
out = {}
for gemm in ("dequant", "direct"):
    llm = LLM(path, device="cuda" if torch.cuda.is_available() else "cpu", max_model_len=96,
              expert_precision="dynamic", expert_stats=stats, kv_low_watermark=0.0, kv_high_watermark=1.0,
              moe_backend="triton", quantized_gemm=gemm)
    cap, _ = greedy_logits(llm, (9, 21, 4), max_tokens=4, seed=7)
    torch.save([c.cpu() for c in cap], os.path.join(path, gemm + ".pt"))
    s = llm.engine.get_stats()
    out[gemm] = {"dequantized": s["expert_bytes_dequantized"], "counts": s["precision_counts"]}
print(json.dumps(out))
"""


def _check_dynamic_equal(tmp_path):
    make_tiny_checkpoint("mixtral", tmp_path, seed=52, num_hidden_layers=2)
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent / "src"), PAGEDMOE_NO_PROGRESS="1", TESTS_DIR=str(TESTS))
    proc = subprocess.run([sys.executable, "-c", DYNAMIC_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    ref, got = torch.load(tmp_path / "dequant.pt"), torch.load(tmp_path / "direct.pt")
    assert len(ref) == len(got) > 0 and all(torch.equal(a, b) for a, b in zip(ref, got))
    for gemm in ("dequant", "direct"):   # the held map: mixed layers, nothing moved
        assert {k: v for k, v in res[gemm]["counts"].items() if v} == {"bf16": 4, "int8": 10, "int4": 2}
    assert res["dequant"]["dequantized"] > 0 and res["direct"]["dequantized"] == 0


def test_direct_gemm_on_mixed_dynamic_layers_equals_filling_the_buffer(tmp_path):
    """--expert-precision dynamic with layers mixing exact, int8 and int4 experts (a held map): the direct
    path (fused_moe_mixed on the published version, no buffer fill) gives the filling path's logits."""
    _check_dynamic_equal(tmp_path)


@pytest.mark.gpu
def test_direct_gemm_on_mixed_dynamic_layers_gpu(tmp_path):
    _check_dynamic_equal(tmp_path)


def test_direct_quantized_gemm_refuses_what_it_cannot_do():
    from pagedmoe.config import EngineConfig

    with pytest.raises(ValueError, match="needs --expert-precision static"):
        EngineConfig(quantized_gemm="direct")
    with pytest.raises(ValueError, match="--moe-backend grouped_mm cannot use it"):
        EngineConfig(quantized_gemm="direct", expert_precision="static-int8", moe_backend="grouped_mm")
    with pytest.raises(ValueError, match="quantized_gemm must be one of"):
        EngineConfig(quantized_gemm="fast")


def test_quantized_gemm_auto_resolves_where_direct_measured_faster():
    from pagedmoe.config import EngineConfig

    def resolved(device, **kw):
        return EngineConfig(model="m", **kw).resolved_quantized_gemm(device)

    assert EngineConfig(model="m").quantized_gemm == "auto"
    assert resolved("cuda", expert_precision="static-fp8") == "direct"
    assert resolved("cuda", expert_precision="static-int8") == "direct"
    assert resolved("cuda", expert_precision="static-int4") == "direct"    # paired loads: 1.1-1.45x at 58408ed
    assert resolved("cuda", expert_precision="dynamic") == "dequant"
    assert resolved("cuda", expert_precision="static-int8", moe_backend="grouped_mm") == "dequant"
    assert resolved("cpu", expert_precision="static-int8") == "dequant"
    assert resolved("cuda", expert_precision="exact") == "dequant"         # nothing lossy: no effect
    assert resolved("cpu", expert_precision="static-int4", quantized_gemm="direct", moe_backend="triton") == "direct"
    with pytest.raises(ValueError, match="needs --expert-precision"):
        EngineConfig(model="m", quantized_gemm="direct")
