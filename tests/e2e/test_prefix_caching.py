"""Prefix caching end to end on a tiny checkpoint: shared blocks, skipped prefill, outputs identical to a
run without the cache (greedy), with chunked prefill, preemption and paged experts."""
from __future__ import annotations

import pytest

from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_checkpoint("qwen3_moe", path, seed=5)
    return str(path)


SYSTEM = list(range(10, 58))  # 48 shared tokens: 3 blocks of 16
PROMPTS = [SYSTEM + [100 + i, 7, 8 + i] for i in range(4)] + [SYSTEM[:40] + [300, 301]]


def _greedy(max_tokens=6):
    from pagedmoe import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _outputs(llm, prompts, max_tokens=6):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)]


@pytest.mark.parametrize("flags", [
    {},
    {"max_num_batched_tokens": 20},                           # chunked prefill
    {"num_kv_blocks": 9, "max_num_batched_tokens": 32},       # preemption (and eviction)
    {"expert_placement": "paged", "num_gpu_experts": 3},      # paged experts
    {"expert_placement": "paged", "num_gpu_experts": 2, "num_compressed_experts": 2, "dtype": "bfloat16"},
    {"expert_precision": "static-int8"},                      # every expert quantized, paged
], ids=["plain", "chunked", "preempt", "paged", "compressed", "static-int8"])
def test_outputs_match_cache_off(ckpt, flags):
    from pagedmoe import LLM

    on = LLM(ckpt, device="cpu", max_model_len=128, **flags)
    off = LLM(ckpt, device="cpu", max_model_len=128, enable_prefix_caching=False, **flags)
    n = 24 if "num_kv_blocks" in flags else 6  # long outputs need more blocks than there are: preemption
    first = _outputs(on, PROMPTS[:1], n)     # fills the cache
    assert first == _outputs(off, PROMPTS[:1], n)
    assert _outputs(on, PROMPTS, n) == _outputs(off, PROMPTS, n)
    stats = on.engine.get_stats()
    assert stats["prefix_cache_hits_total"] > 0
    assert off.engine.get_stats()["prefix_cache_hits_total"] == 0
    if "num_kv_blocks" in flags:
        assert stats["num_preemptions_total"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_shared_blocks_and_skipped_prefill(ckpt):
    from pagedmoe import LLM

    llm = LLM(ckpt, device="cpu", max_model_len=128)
    eng = llm.engine
    eng.add_request("a", None, _greedy(20), prompt_token_ids=PROMPTS[0])
    eng.step()
    before = eng.step_time["prefill_tokens"]
    eng.add_request("b", None, _greedy(20), prompt_token_ids=PROMPTS[1])
    eng.step()  # b's prefill: only what follows the three shared blocks
    assert eng.kv.block_table("b")[:3] == eng.kv.block_table("a")[:3]
    assert eng.kv.block_table("b")[3] != eng.kv.block_table("a")[3]
    assert eng.step_time["prefill_tokens"] - before == 1 + len(PROMPTS[1]) - 48  # a's decode + b's tail
    assert eng.get_stats()["prefix_cache_hits_total"] == 48
    for rid in ("a", "b"):
        eng.abort_request(rid)


def test_parallel_samples_share_the_prompt(ckpt):
    from pagedmoe import LLM, SamplingParams

    llm = LLM(ckpt, device="cpu", max_model_len=128)
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 5 for c in out.outputs)
    # the prompt is computed once: the two siblings only compute its last, partial block
    assert llm.engine.get_stats()["prefix_cache_hits_total"] == 2 * 48


def test_mla_model(tmp_path):
    """DeepSeek-V2's latent KV cache: the same sharing, the same greedy outputs."""
    from pagedmoe import LLM

    make_tiny_checkpoint("deepseek_v2", tmp_path)
    on = LLM(str(tmp_path), device="cpu", max_model_len=128)
    off = LLM(str(tmp_path), device="cpu", max_model_len=128, enable_prefix_caching=False)
    _outputs(on, PROMPTS[:1])
    assert _outputs(on, PROMPTS) == _outputs(off, PROMPTS)
    assert on.engine.get_stats()["prefix_cache_hits_total"] >= 4 * 48


def test_dynamic_precision_runs_clean(tmp_path):
    """Dynamic precision lends free KV blocks to experts: cached blocks are dropped when withheld, and
    nothing leaks."""
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=7, num_hidden_layers=4)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=16,
              gpu_memory_gb=0.0040, expert_precision="dynamic")
    burst = [[(7 * i + j) % 100 + 3 for j in range(150)] for i in range(8)]  # more KV than the plan has
    shared = [SYSTEM * 2 + [(7 * i + j) % 100 + 3 for j in range(60)] for i in range(8)]
    for prompts in (burst, shared, burst):
        assert all(len(o) == 80 for o in _outputs(llm, prompts, 80))
        llm.engine.kv.pool.check_invariants()
    stats = llm.engine.get_stats()
    assert stats["precision_demotions"] > 0  # KV blocks were lent to experts while the cache held prefixes
    assert stats["prefix_cache_hits_total"] >= 7 * 96
    kv = llm.engine.kv
    kv.pool.check_invariants()
    assert kv.num_free_blocks + kv.pool.num_withheld_blocks == kv.num_blocks and not kv._tables
