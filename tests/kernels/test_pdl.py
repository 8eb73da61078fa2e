"""kernels/pdl.py: programmatic dependent launch for the decode step's Triton kernels.

CPU: the switch (off on CPU, under the interpreter and with PAGEDMOE_PDL=0) and a PDL-capable kernel run under
the interpreter with PDL off. GPU (Hopper): a whole engine with every decode kernel on Triton (fused ops, the
Triton MoE and backbone GEMMs, CUDA graphs) gives the same logits bit for bit with PDL on and off: the kernels
wait for their predecessor before they touch memory, so PDL changes when they start, never what they compute."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel import (see test_fused_moe.py)

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagedmoe.kernels import pdl  # noqa: E402
from tiny_models import greedy_logits, make_tiny_checkpoint  # noqa: E402


def test_switch_is_off_where_pdl_cannot_run(monkeypatch):
    assert pdl.launch_args(torch.device("cpu")) == dict(PDL=False, launch_pdl=False)
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        monkeypatch.setenv(pdl.ENV, "0")
        assert not pdl.enabled(dev)
        monkeypatch.setenv(pdl.ENV, "1")
        assert pdl.enabled(dev) == (torch.cuda.get_device_capability()[0] >= 9)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl.enabled(dev)


def _logits(path, monkeypatch, on: bool):
    from pagedmoe import LLM

    monkeypatch.setenv(pdl.ENV, "1" if on else "0")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=96, moe_backend="triton", fused_ops="on",
              backbone_gemm="triton", max_num_seqs=4)
    assert llm.engine.runner.graphs is not None
    logits, outs = greedy_logits(llm, (7, 19, 3), max_tokens=6, seed=5)
    del llm
    torch.cuda.empty_cache()
    return logits, [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a Hopper-class GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_logits_equal_with_and_without_pdl(tmp_path, monkeypatch, family):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter never launches with PDL")
    make_tiny_checkpoint(family, tmp_path, seed=41, dtype=torch.bfloat16, num_hidden_layers=2)
    on, outs_on = _logits(tmp_path, monkeypatch, True)
    off, outs_off = _logits(tmp_path, monkeypatch, False)
    assert len(on) == len(off) > 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    assert outs_on == outs_off
