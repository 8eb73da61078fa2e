"""--backbone-gemm triton against torch and against transformers, whole tiny models (layers/linear.py).

On CPU kernels/small_gemm.py runs under the Triton interpreter. Steps of at most 16 tokens (decode, and
a short prefill) run the backbone linears through the kernel, longer prefills keep F.linear. The greedy
tokens equal the torch path's; every step's logits are within 1e-4 of the torch path's and of
transformers' in float32 (test_golden.py's bound; the kernel's float32 sums differ from torch's matmul
only in summation order), and in bfloat16 the tokens still agree.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from model_interp import fix_interpreter, greedy_against_transformers  # noqa: E402  (first: sets TRITON_INTERPRET without CUDA)

import pytest  # noqa: E402

pytest.importorskip("triton")

from tiny_models import greedy_logits, make_tiny_checkpoint  # noqa: E402

fix_interpreter(bf16_dot=True)

FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2"]  # qwen2: qkv bias; deepseek: MLA


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel's calls (layers/linear.py imports it at call time) and the rows they took."""
    import pagedmoe.kernels.small_gemm as sg

    calls, orig = [], sg.small_gemm

    def counted(x, weight, bias=None, config=None):
        calls.append(x.shape[0])
        return orig(x, weight, bias, config)

    monkeypatch.setattr(sg, "small_gemm", counted)
    return calls


def _run(path, backbone_gemm, lengths, steps, dtype="float32", fused_ops="off", seed=1):
    """(engine, every step's logits, each prompt's greedy tokens) of random prompts of `lengths`."""
    from pagedmoe import LLM

    llm = LLM(str(path), device="cpu", dtype=dtype, max_model_len=128, backbone_gemm=backbone_gemm,
              fused_ops=fused_ops)
    logits, outs = greedy_logits(llm, lengths, steps, seed)
    return llm.engine, logits, [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_matches_torch_and_transformers(family, tmp_path, kernel_calls):
    hf = make_tiny_checkpoint(family, tmp_path, seed=3)
    with torch.no_grad():  # the biases (qwen2's q/k/v) start at zero: make them count
        biases = [p for n, p in hf.named_parameters() if n.endswith("proj.bias")]
        for b in biases:
            b.normal_(0.0, 0.5)
    if biases:
        hf.save_pretrained(str(tmp_path))
    steps = 4
    engine, fast, fast_tokens = _run(tmp_path, "triton", (9, 4), steps)  # 13 tokens: the prefill is the kernel's
    linears = [m for m in engine.runner.model.modules() if getattr(m, "small_gemm", False)]
    assert linears and kernel_calls and max(kernel_calls) <= 16
    assert 13 in kernel_calls  # the prefill step itself went through the kernel
    for attn in engine.runner.model.attention_layers():  # q/k/v: row slices of one buffer, one launch
        if family != "deepseek_v2":
            w = attn.qkv_weight
            assert attn.q_proj.weight.data_ptr() == w.data_ptr() and w.shape[0] == sum(
                p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            assert torch.equal(attn.v_proj.weight, w[-attn.v_proj.out_features:])
    plain_engine, plain, plain_tokens = _run(tmp_path, "torch", (9, 4), steps)
    # torch too runs q/k/v as one GEMM (F.linear on the shared buffer)
    assert all(attn.qkv_weight is not None for attn in plain_engine.runner.model.attention_layers()
               if family != "deepseek_v2")
    assert fast_tokens == plain_tokens and len(fast) == len(plain) == steps
    for i, (a, b) in enumerate(zip(fast, plain)):
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"{family} step {i}: triton vs torch max abs diff {diff}"
    prompt, generated = fast_tokens[0]
    assert greedy_against_transformers(hf, prompt, fast, f"{family} (triton)") == list(generated)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_with_fused_ops(family, tmp_path, kernel_calls):
    """With --fused-ops on the q/k norm + RoPE + KV-write kernel reads q, k, v as column slices of the fused
    qkv output (row stride Nq + 2 Nkv): the same tokens as torch with the fused ops, logits within 1e-4."""
    make_tiny_checkpoint(family, tmp_path, seed=5)
    _, fast, fast_tokens = _run(tmp_path, "triton", (6, 3), 4, fused_ops="on", seed=2)
    assert kernel_calls
    _, plain, plain_tokens = _run(tmp_path, "torch", (6, 3), 4, fused_ops="on", seed=2)
    assert fast_tokens == plain_tokens
    for a, b in zip(fast, plain):
        assert (a - b).abs().max().item() <= 1e-4


def test_long_prefill_keeps_torch(tmp_path, kernel_calls):
    """A 40-token prefill is not decode-shaped: F.linear takes it, the decode steps after it the kernel."""
    make_tiny_checkpoint("qwen3_moe", tmp_path, seed=3)
    _, _, tokens = _run(tmp_path, "triton", (40,), 3)
    assert kernel_calls and set(kernel_calls) == {1}
    _, _, plain_tokens = _run(tmp_path, "torch", (40,), 3)
    assert tokens == plain_tokens


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_tokens_match_torch(family, tmp_path, kernel_calls):
    make_tiny_checkpoint(family, tmp_path, seed=7)
    _, fast, fast_tokens = _run(tmp_path, "triton", (5, 3, 6), 4, "bfloat16", seed=3)
    assert kernel_calls
    _, plain, plain_tokens = _run(tmp_path, "torch", (5, 3, 6), 4, "bfloat16", seed=3)
    assert fast_tokens == plain_tokens
    for a, b in zip(fast, plain):  # logits of bf16 hidden states: a few bf16 ulps of the largest
        assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()


def test_backbone_gemm_flag(monkeypatch):
    from pagedmoe.config import EngineConfig
    from pagedmoe.kernels.small_gemm import MAX_M
    from pagedmoe.models.layers.linear import MAX_TOKENS, resolve_backbone_gemm

    assert MAX_TOKENS == MAX_M
    assert resolve_backbone_gemm("auto", torch.device("cpu")) == "none"
    # auto on CUDA: the routers' gates only (measured faster there, bench_small_gemm.py)
    has_triton = importlib.util.find_spec("triton") is not None
    assert resolve_backbone_gemm("auto", torch.device("cuda")) == ("routers" if has_triton else "none")
    assert resolve_backbone_gemm("torch", torch.device("cpu")) == "none"
    if torch.cuda.is_available():
        assert resolve_backbone_gemm("triton", torch.device("cuda")) == "all"
    with pytest.raises(ValueError, match="backbone_gemm must be one of"):
        EngineConfig(backbone_gemm="cublas")
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert resolve_backbone_gemm("triton", torch.device("cpu")) == "all"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--backbone-gemm triton runs Triton kernels: it needs a CUDA device"):
        resolve_backbone_gemm("triton", torch.device("cpu"))


def test_cli_and_llm_kwargs():
    import argparse

    from pagedmoe.config import add_engine_args, engine_config_from_args, engine_config_from_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--backbone-gemm", "triton"])).backbone_gemm == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--backbone-gemm", "fast"])
    cfg = engine_config_from_kwargs(None, backbone_gemm="torch")
    assert cfg.backbone_gemm == "torch" and cfg.model_config.backbone_gemm == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_gpu_cuda_graphs_triton_matches_torch(family, tmp_path):
    """On the GPU, bf16, decode in CUDA graphs with the kernel captured: the same greedy tokens as cuBLAS."""
    from pagedmoe import LLM

    make_tiny_checkpoint(family, tmp_path, seed=7)
    tokens = {}
    for mode in ("torch", "triton"):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=160, max_num_seqs=8,
                  enforce_eager=False, backbone_gemm=mode)
        assert llm.engine.runner.graphs is not None
        assert llm.engine.model.lm_head.small_gemm == (mode == "triton")
        _, outs = greedy_logits(llm, (5, 31, 17, 64), 10, seed=3)
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        del llm
        torch.cuda.empty_cache()
    assert tokens["torch"] == tokens["triton"]
