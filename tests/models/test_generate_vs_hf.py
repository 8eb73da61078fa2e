"""Greedy generation for a batch of prompts is token-for-token identical to transformers.generate,
also under preemption (tiny KV cache) and with prefill forced into small chunks."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint

MAX_NEW = 12
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request, tmp_path_factory):
    """(path, prompts, expected continuations) with transformers generating each prompt alone."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_checkpoint(request.param, path, seed=10 + FAMILIES.index(request.param),
                              max_shard_size="200KB")  # several shards + an index
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 17, 9, 33, 1, 24, 12, 40]
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in lengths]
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                              do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    return path, prompts, expected


def _generate(path, prompts, **engine_kw):
    from pagedmoe import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_batch_matches_transformers(reference):
    path, prompts, expected = reference
    got, _ = _generate(path, prompts, max_model_len=128)
    assert got == expected


def test_matches_under_preemption(reference):
    path, prompts, expected = reference
    # 8 blocks of 8 tokens: 64 slots for 8 sequences of up to 52 tokens -> must preempt.
    got, engine = _generate(path, prompts, max_model_len=64, block_size=8, num_kv_blocks=8)
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert got == expected


def test_matches_under_swapped_preemption(reference):
    """--swap-space: preempted requests' KV goes to host memory and back instead of being recomputed; the tokens
    are the reference's (swaps mixed with recomputes: tests/unit/test_scheduler.py)."""
    path, prompts, expected = reference
    got, engine = _generate(path, prompts, max_model_len=64, block_size=8, num_kv_blocks=8, swap_space=0.01)
    sched = engine.scheduler
    assert sched.num_swapped_total > 0 and sched.num_swapped_total == sched.num_preemptions_total
    assert sched.swap.num_used_blocks == 0 and engine.kv.num_free_blocks == engine.kv.num_blocks
    assert got == expected


def test_matches_with_small_prefill_chunks(reference):
    path, prompts, expected = reference
    got, engine = _generate(path, prompts, max_model_len=128, max_num_batched_tokens=5, max_num_seqs=3)
    assert got == expected


def test_sliding_window_bounds_max_model_len(tmp_path):
    """A config with a sliding window (Mixtral's `sliding_window`; Qwen's only with `use_sliding_window`): the engine
    attends to the whole context, which is the window's attention only up to `sliding_window` tokens. Past it the
    tokens were silently not the model's; now the default max_model_len stops at the window and a longer one is
    refused. Within it, transformers' tokens."""
    from pagedmoe import LLM

    hf = make_tiny_checkpoint("mixtral", tmp_path / "mixtral", seed=4, sliding_window=24)
    with pytest.raises(ValueError, match="sliding_window 24"):
        LLM(str(tmp_path / "mixtral"), device="cpu", max_model_len=64)
    prompt = torch.randint(1, 384, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(prompt):].tolist()
    got, engine = _generate(tmp_path / "mixtral", [prompt])
    assert engine.max_model_len == 24 and got == [want[:MAX_NEW]]
    # Qwen3-MoE without use_sliding_window: no window, max_position_embeddings as before
    make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3", sliding_window=24, use_sliding_window=False)
    assert LLM(str(tmp_path / "qwen3"), device="cpu").engine.max_model_len == 256
