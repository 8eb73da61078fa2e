"""The offline API end to end on a tiny checkpoint: sampling options, stop conditions, bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_checkpoint("qwen3_moe", path, seed=3)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    from pagedmoe import LLM

    return LLM(str(ckpt), device="cpu", max_model_len=96)


def _params(**kw):
    from pagedmoe import SamplingParams

    return SamplingParams(**kw)


def test_text_prompts_and_output_fields(llm):
    outs = llm.generate(["def add(a, b):", "class Point:"], _params(temperature=0, max_tokens=5,
                                                                    ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["def add(a, b):", "class Point:"]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 5 and c.finish_reason == "length" and o.finished
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == llm.get_tokenizer().encode(o.prompt)


def test_seeded_sampling_is_reproducible(llm):
    p = _params(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(["for i in"], p, use_tqdm=False)[0].outputs[0].token_ids
    # Same seed inside a different batch gives the same tokens.
    b = llm.generate(["x", "for i in", "def"], [_params(temperature=1.0, max_tokens=4), p,
                                                _params(temperature=0.7, max_tokens=8)],
                     use_tqdm=False)[1].outputs[0].token_ids
    c = llm.generate(["for i in"], _params(temperature=1.0, top_p=0.9, seed=99, max_tokens=12,
                                           ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and a != c


def test_stop_token_ids_and_stop_strings(llm):
    greedy = llm.generate(["print("], _params(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    third = greedy.token_ids[2]
    out = llm.generate(["print("], _params(temperature=0, max_tokens=10, ignore_eos=True,
                                           stop_token_ids=[third]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:greedy.token_ids.index(third) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == third
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip():
        out = llm.generate(["print("], _params(temperature=0, max_tokens=10, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:text.index(stop)]


def test_eos_stops_unless_ignored(llm):
    logits_bias_prompt = [5, 6, 7]
    out = llm.generate([logits_bias_prompt], _params(temperature=0, max_tokens=40), use_tqdm=False)[0]
    eos = llm.engine.outputs.eos_token_ids
    c = out.outputs[0]
    if c.finish_reason == "stop":
        assert c.token_ids[-1] in eos
    else:
        assert len(c.token_ids) == 40 and not set(c.token_ids) & eos


def test_logprobs(llm):
    out = llm.generate(["x = "], _params(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1 and len(entry) == 2
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids,
                                                                                   out.logprobs)))


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], _params(temperature=0, max_tokens=3), use_tqdm=False)
    want = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}],
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    assert out[0].prompt_token_ids == list(want)


def test_bad_requests_are_refused_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 96], _params(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], _params(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 10**6]], _params(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["a"], _params(top_p=2.0), use_tqdm=False)
    # A batch whose second prompt is bad queues nothing.
    with pytest.raises(ValueError):
        llm.generate(["ok", [1] * 500], _params(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    out = llm.generate(["still fine"], _params(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("prompts, expected", [
    ("a\udcffb", r"prompt 0 is not valid text: it holds a lone surrogate \(U\+DCFF at index 1\)"),
    (["ok", {"prompt": "\ud800"}], "prompt 1 is not valid text"),
    (["ok", 5], "prompt 1 must be a string, a list of token ids or a dict, got int"),
    ([{"prompt": 5}], "prompt 0: 'prompt' must be a string, got int"),
    ([{"prompt_token_ids": 5}], "prompt 0: token ids must be a list of integers, got 5"),
    ([[1, 2.5]], "prompt 0: token ids must be a list of integers"),
    (5, "prompts must be a prompt or a list of prompts, got int"),
])
def test_bad_prompts_are_a_value_error_naming_them(llm, prompts, expected):
    with pytest.raises(ValueError, match=expected):
        llm.generate(prompts, _params(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_tuple_of_token_ids_is_one_prompt_as_a_list(llm):
    """A list of ints is one token-id prompt (the documented form); a tuple is taken the same, alone or in a
    batch."""
    greedy = _params(temperature=0, max_tokens=2, ignore_eos=True)
    want = llm.generate([1, 2, 3], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for prompts in ((1, 2, 3), [(1, 2, 3)], [{"prompt_token_ids": (1, 2, 3)}]):
        out = llm.generate(prompts, greedy, use_tqdm=False)
        assert len(out) == 1 and out[0].prompt_token_ids == [1, 2, 3] and out[0].outputs[0].token_ids == want


@pytest.mark.parametrize("kw, expected", [
    (dict(stop=5), "stop must be a non-empty string or a list of them, got 5"),
    (dict(stop=[5]), "stop must be a non-empty string or a list of them"),
    (dict(stop=b"x"), "stop must be"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of non-negative integers, got 5"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be"),
])
def test_bad_stop_is_a_value_error(kw, expected):
    with pytest.raises(ValueError, match=expected):
        _params(**kw)
    assert _params(stop=("a", "b"), stop_token_ids=(1,)).stop == ["a", "b"]


def test_a_step_that_raises_leaves_nothing_queued(llm, monkeypatch):
    """An error (or Ctrl-C) inside generate() aborts its requests: the next call does not run into them."""
    engine_step = llm.engine.step

    def failing_step():
        engine_step()
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(["def f(", "x = "], _params(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    out = llm.generate(["y"], _params(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_max_tokens_capped_by_model_len(llm):
    out = llm.generate([[3] * 90], _params(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"


def test_unknown_engine_option():
    from pagedmoe import LLM

    with pytest.raises(TypeError, match="gpu_memory_utilization"):
        LLM("x", gpu_memory_utilization=0.9)


def test_missing_and_corrupt_checkpoints(ckpt, tmp_path):
    from pagedmoe import LLM
    from pagedmoe.models.loader import CheckpointError

    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="truncated or corrupt|cannot read"):
        LLM(str(broken), device="cpu")
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(str(broken), device="cpu")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LLM(str(broken), device="cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: .*MixtralForCausalLM"):
        LLM(str(broken), device="cpu")


def test_budget_too_small_names_the_minimum(ckpt):
    from pagedmoe import LLM

    with pytest.raises(ValueError, match=r"the minimum is|needs \d+\.\d+ GiB"):
        LLM(str(ckpt), device="cpu", gpu_memory_gb=0.001)


def test_too_few_kv_blocks_names_the_flag_and_the_blocks_one_sequence_needs(ckpt, monkeypatch):
    """--num-kv-blocks replaces the budget: too few for one max-length sequence is about the flag, not a budget
    ("the minimum is 0.03 GiB"), and is refused before the model loads; exactly enough starts."""
    from pagedmoe import LLM
    from pagedmoe.engine import startup

    LLM(str(ckpt), device="cpu", max_model_len=64, block_size=16, num_kv_blocks=4)   # 64 / 16: enough

    def no_load(*_a, **_k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(startup, "load_model", no_load)
    with pytest.raises(ValueError) as info:
        LLM(str(ckpt), device="cpu", max_model_len=65, block_size=16, num_kv_blocks=4)
    assert str(info.value) == ("--num-kv-blocks 4 cannot hold one sequence of max_model_len=65 tokens: that needs 5 "
                               "blocks of 16 tokens; give at least 5 (or lower --max-model-len)")


def test_moe_backend_triton_without_cuda_fails_at_start_up(ckpt, monkeypatch):
    """Not at the first request's step ('fused_moe runs on CUDA'), as --fused-ops on and --backbone-gemm triton."""
    from pagedmoe import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--moe-backend triton runs Triton kernels: it needs a CUDA device"):
        LLM(str(ckpt), device="cpu", max_model_len=64, moe_backend="triton")


def test_dummy_weights_are_random_not_zero(ckpt):
    from pagedmoe import LLM

    llm = LLM(str(ckpt), device="cpu", load_format="dummy", max_model_len=64)
    w = llm.engine.expert_store.views(0)[0]
    assert w.std() > 0.01 and (w == 0).float().mean() < 0.01


def test_cli_generate(ckpt, tmp_path):
    out_json = tmp_path / "out.json"
    import os
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {"PYTHONPATH": src, "PAGEDMOE_MAX_MODEL_LEN": "64"}
    r = subprocess.run([sys.executable, "-m", "pagedmoe.cli", "generate", str(ckpt), "--prompt", "def f(",
                        "--max-tokens", "4", "--device", "cpu", "--output-json", str(out_json)],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out_json.read_text())
    assert len(data) == 1 and len(data[0]["token_ids"]) <= 4
    bad = subprocess.run([sys.executable, "-m", "pagedmoe.cli", "generate", str(ckpt), "--prompt", "x",
                          "--top-p", "3", "--device", "cpu"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert bad.returncode == 2 and "top_p" in bad.stderr and "Traceback" not in bad.stderr
