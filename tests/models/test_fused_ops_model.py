"""--fused-ops on against off and against transformers, whole tiny models (layers/fused_ops.py).

On CPU the fused Triton kernels run under the interpreter (float32, and bfloat16 with the interpreter's
cast fixed to round as the GPU does). Every step's logits of the fused engine equal the unfused engine's
bit for bit (the kernels round where the torch ops round, their sums are float64: kernels/fused_norm.py),
and are within 1e-4 of transformers' in float32, as test_golden.py requires of the unfused path.
"""
from __future__ import annotations

import os

import torch

from model_interp import fix_interpreter, greedy_against_transformers  # noqa: E402  (first: sets TRITON_INTERPRET without CUDA)

import pytest  # noqa: E402

pytest.importorskip("triton")

from tiny_models import make_tiny_checkpoint, spy_logits  # noqa: E402

fix_interpreter()

# family, checkpoint overrides, the fused ops expected to take effect
CASES = {
    "mixtral": ("mixtral", {}, ["residual_norm", "qk_rope_kv", "router"]),      # rope alone, softmax renorm
    "qwen3_moe": ("qwen3_moe", {}, ["residual_norm", "qk_rope_kv", "router"]),  # per-head q/k norm
    "qwen2_moe": ("qwen2_moe", {}, ["residual_norm", "qk_rope_kv", "router"]),  # no renorm, qkv bias, shared
    # GLM-4.5's real configs have n_group 1: the sigmoid router fuses; partial rotary, q/k norm
    "glm4_moe": ("glm4_moe", {"n_group": 1, "topk_group": 1}, ["residual_norm", "qk_rope_kv", "router"]),
    "glm4_grouped": ("glm4_moe", {}, ["residual_norm", "qk_rope_kv"]),           # grouped router stays torch
    "olmoe": ("olmoe", {}, ["residual_norm", "router"]),                         # whole-projection q/k norm
    "deepseek_v2": ("deepseek_v2", {}, ["residual_norm"]),                      # MLA, grouped softmax
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    family, overrides, fused = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_checkpoint(family, path, seed=3, **overrides)
    return request.param, path, hf, fused


def _run(path, fused_ops, prompt, steps, dtype="float32"):
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype=dtype, max_model_len=128,
                                    fused_ops=fused_ops))
    captured = spy_logits(engine)
    for i, p in enumerate(prompt):
        engine.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                           prompt_token_ids=p)
    while engine.has_unfinished_requests():
        engine.step()
    return engine, captured


def test_fused_matches_unfused_and_transformers(checkpoint):
    name, path, hf, expected = checkpoint
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (13, 5)]
    steps = 4
    engine, fused = _run(path, "on", prompts, steps)
    model = engine.runner.model
    got = ["residual_norm"] if model.fused_residual_norm else []
    got += ["qk_rope_kv"] if any(getattr(a, "fused_qk_rope", False) for a in model.attention_layers()) else []
    got += ["router"] if any(m.fused_router for m in model.moe_layers()) else []
    assert got == expected
    plain_engine, plain = _run(path, "off", prompts, steps)
    # the fused router counts the routed ids into the activity table itself: the same counts
    assert engine.activity.total.sum() > 0 and torch.equal(engine.activity.total, plain_engine.activity.total)
    assert len(fused) == len(plain) == steps
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"{name} step {i}: fused vs unfused max abs diff {(a - b).abs().max().item()}"
    # the first prompt against transformers' full forward, greedy
    greedy_against_transformers(hf, prompts[0], fused, f"{name} (fused)")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_bf16_fused_equals_unfused_bit_for_bit(name, tmp_path):
    """bf16, where a rounding the other way shows: every step's logits equal (the GPU test's failure at
    13799e8: the float32 sums of squares and softmax in another order, torch.rsqrt vs the kernels')."""
    family, overrides, _ = CASES[name]
    make_tiny_checkpoint(family, tmp_path, seed=7, **overrides)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (5, 31, 17)]
    _, fused = _run(tmp_path, "on", prompts, 4, "bfloat16")
    _, plain = _run(tmp_path, "off", prompts, 4, "bfloat16")
    assert len(fused) == len(plain) == 4
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert torch.equal(a, b), f"{name} step {i}: fused vs unfused max abs diff {(a - b).abs().max().item()}"


def test_fused_ops_flag():
    from pagedmoe.config import EngineConfig
    from pagedmoe.models.layers.fused_ops import resolve_fused_ops

    assert resolve_fused_ops("auto", torch.device("cpu")) is False  # auto: on on CUDA only (measured faster there)
    if torch.cuda.is_available():
        assert resolve_fused_ops("auto", torch.device("cuda")) is True
    assert resolve_fused_ops("off", torch.device("cpu")) is False
    with pytest.raises(ValueError, match="fused_ops must be one of"):
        EngineConfig(fused_ops="maybe")
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="needs a CUDA device"):
                resolve_fused_ops("on", torch.device("cpu"))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_cuda_graphs_fused_matches_unfused(family, tmp_path):
    """On the GPU: bf16, decode in CUDA graphs, the fused kernels captured; the greedy tokens and every
    step's logits equal the unfused path's bit for bit (tiny random models have near-ties, so this fails
    at the first rounding that differs)."""
    from pagedmoe import LLM, SamplingParams

    make_tiny_checkpoint(family, tmp_path, seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (5, 31, 17, 64)]
    tokens, logits = {}, {}
    for mode in ("off", "on"):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=160, max_num_seqs=8,
                  enforce_eager=False, fused_ops=mode)
        assert llm.engine.runner.graphs is not None and llm.engine.model.fused_residual_norm == (mode == "on")
        captured = spy_logits(llm.engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        logits[mode] = captured
        del llm
        torch.cuda.empty_cache()
    assert tokens["off"] == tokens["on"]
    assert len(logits["off"]) == len(logits["on"])
    for i, (a, b) in enumerate(zip(logits["off"], logits["on"])):
        assert torch.equal(a, b), f"{family} step {i}: fused vs unfused max abs diff {(a - b).abs().max().item()}"
