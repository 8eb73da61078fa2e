"""SamplingParams.prompt_logprobs against transformers: the log_softmax of the full sequence's logits, in a batch with
requests that do not ask for them, with prefill in small chunks, after a prefix cache hit and under preemption."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint

TOL = 1e-4  # float32 engine vs float32 transformers


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(path, prompts, transformers' log_softmax [len(prompt), V] of each prompt alone)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf = make_tiny_checkpoint("qwen3_moe", path, seed=21)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (13, 2, 30, 7, 21, 1)]
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]
    return path, prompts, ref


def _llm(path, **kw):
    from pagedmoe import LLM

    return LLM(str(path), device="cpu", dtype="float32", max_model_len=64, **kw)


def _check(entries, prompt, ref, k):
    """vLLM's shape: None, then per token {its id: Logprob, + the k most likely}; values, ranks and top-k as
    transformers' (ranks and the top set up to ties within TOL)."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, entry, token = ref[i - 1], entries[i], prompt[i]
        assert token in entry and next(iter(entry)) == token
        target = row[token].item()
        assert entry[token].logprob == pytest.approx(target, abs=TOL)
        assert (row > target + TOL).sum() + 1 <= entry[token].rank <= (row > target - TOL).sum() + 1
        assert len(entry) in (k, k + 1) and {lp.rank for lp in entry.values()} >= set(range(1, k + 1))
        top = row.topk(max(k, 1)).values
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
            if t != token:
                assert lp.logprob == pytest.approx(top[lp.rank - 1].item(), abs=TOL)


def _generate(llm, prompts, asks):
    from pagedmoe import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k) for k in asks]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("chunked, async_scheduling", [(False, False), (True, False), (True, True)])
def test_matches_transformers_in_a_mixed_batch(reference, chunked, async_scheduling):
    """async_scheduling: the engine's --async-scheduling loop (on the CPU: the same order of work, no overlap)."""
    path, prompts, ref = reference
    kw = dict(max_num_batched_tokens=5, max_num_seqs=3) if chunked else {}
    kw["async_scheduling"] = async_scheduling
    asks = [3, None, 0, None, 5, 2]
    llm = _llm(path, **kw)
    assert (llm.engine._async is not None) == async_scheduling
    outs = _generate(llm, prompts, asks)
    plain = _generate(_llm(path, **kw), prompts, [None] * len(prompts))
    for out, p, r, k, alone in zip(outs, prompts, ref, asks, plain):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            _check(out.prompt_logprobs, p, r, k)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids  # the generation is unchanged


def test_whole_prompt_computed_after_a_prefix_cache_hit(reference):
    path, prompts, ref = reference
    llm = _llm(path, block_size=8)
    _generate(llm, [prompts[2]], [None])  # caches its blocks
    hits = llm.engine.kv.prefix_cache_hits
    out = _generate(llm, [prompts[2]], [1])[0]
    assert llm.engine.kv.prefix_cache_hits == hits
    _check(out.prompt_logprobs, prompts[2], ref[2], 1)
    assert _generate(llm, [prompts[2]], [None])[0].prompt_logprobs is None
    assert llm.engine.kv.prefix_cache_hits > hits  # requests without them still hit


def test_under_preemption(reference):
    path, prompts, ref = reference
    llm = _llm(path, block_size=8, num_kv_blocks=9, max_num_batched_tokens=16)
    outs = _generate(llm, prompts, [2] * len(prompts))
    assert llm.engine.scheduler.num_preemptions_total > 0
    for out, p, r in zip(outs, prompts, ref):
        _check(out.prompt_logprobs, p, r, 2)


def test_refused_out_of_range():
    from pagedmoe import SamplingParams

    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)


@pytest.mark.gpu
def test_cuda_bf16_close_to_transformers(reference):
    """On CUDA in bf16 (the step that asks for prompt logprobs runs eager; its neighbours' decode steps replay
    graphs, async scheduling on): within bf16 tolerance of transformers' float32 log_softmax, the generation
    unchanged by asking."""
    from pagedmoe import LLM

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path, prompts, ref = reference
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=64)
    asks = [3, None, 0, None, 5, 2]
    outs = _generate(llm, prompts, asks)
    plain = _generate(llm, prompts, [None] * len(prompts))
    for out, p, r, k, alone in zip(outs, prompts, ref, asks, plain):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        if k is None:
            assert out.prompt_logprobs is None
            continue
        entries = out.prompt_logprobs
        assert len(entries) == len(p) and entries[0] is None
        if len(p) < 2:
            continue   # a one-token prompt has no logprob to compare
        got = torch.tensor([entries[i][p[i]].logprob for i in range(1, len(p))])
        want = torch.stack([r[i - 1][p[i]] for i in range(1, len(p))])
        assert (got - want).abs().max().item() < 0.1, (got, want)
