"""The CUDA path (Triton attention, grouped_mm experts, decode CUDA graphs) against transformers."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint, spy_logits

pytestmark = pytest.mark.gpu
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_checkpoint(request.param, path, seed=20 + FAMILIES.index(request.param))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (5, 31, 17, 64, 2, 40, 9, 23)]
    return path, hf, prompts


def _run(path, prompts, max_tokens=10, **kw):
    from pagedmoe import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", max_model_len=160, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_float32_cuda_greedy_matches_transformers(checkpoint):
    path, hf, prompts = checkpoint
    got, _ = _run(path, prompts, dtype="float32", enforce_eager=True)
    with torch.no_grad():
        for p, tokens in zip(prompts, got):
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                              pad_token_id=0)
            assert out[0, len(p):].tolist() == tokens


def test_bf16_cuda_graphs_match_eager(checkpoint):
    path, _, prompts = checkpoint
    eager, _ = _run(path, prompts, dtype="bfloat16", enforce_eager=True)
    graphs, llm = _run(path, prompts, dtype="bfloat16", enforce_eager=False, max_num_seqs=8)
    assert llm.engine.runner.graphs is not None
    assert graphs == eager


def test_bf16_prefill_logits_close_to_transformers(checkpoint):
    from pagedmoe.sampling_params import SamplingParams

    path, hf, prompts = checkpoint
    _, llm = _run(path, prompts[:1], max_tokens=1, dtype="bfloat16", enforce_eager=True)
    captured = spy_logits(llm.engine)
    llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[3]])).logits[0, -1].float()
    ours = captured[0][0].cpu()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 3e-2, rel


@pytest.mark.parametrize("kernel", ["cudnn-dense", "flash"])
def test_bf16_fresh_prefill_through_torch_kernels_close_to_transformers(checkpoint, monkeypatch, kernel):
    """PAGEDMOE_PREFILL_ATTENTION's kernels in the engine: a step of whole prompts of different lengths (the dense
    path pads them) gives last-token logits close to transformers', as the Triton kernel's are; chunked steps
    after it keep the Triton kernel."""
    from pagedmoe.kernels import paged_attention as pa
    from pagedmoe.sampling_params import SamplingParams

    path, hf, prompts = checkpoint
    monkeypatch.setattr(pa, "PREFILL_ATTENTION", kernel)
    called = []
    fresh = pa.fresh_prefill_attention
    monkeypatch.setattr(pa, "fresh_prefill_attention", lambda *a: called.append(a[7]) or fresh(*a))
    _, llm = _run(path, prompts[:1], max_tokens=1, dtype="bfloat16", enforce_eager=True)
    captured = spy_logits(llm.engine)
    batch = [prompts[3], prompts[1], prompts[5]]   # 64, 31 and 40 tokens: one fresh step
    llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    assert called and set(called) == {kernel}
    ours = captured[0]
    with torch.no_grad():
        for i, p in enumerate(batch):
            ref = hf(torch.tensor([p])).logits[0, -1].float()
            rel = ((ours[i].cpu() - ref).norm() / ref.norm()).item()
            assert rel < 3e-2, (i, rel)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bf16_cuda_graphs_match_eager_as_the_batch_shrinks(checkpoint, async_scheduling):
    """Sequences that finish at different steps take the decode batch through the buckets 8, 4, 2, 1: every
    bucket's graph writes its logits into the first rows of one shared buffer (worker/cuda_graph.py), read
    before the next replay; the tokens equal eager steps', with --async-scheduling too (step N + 1 is launched
    before step N's tokens are read)."""
    from pagedmoe import LLM, SamplingParams

    path, _, prompts = checkpoint
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 12, 5, 20, 1, 9, 16, 7)]
    runs = []
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=160, max_num_seqs=8,
                  enforce_eager=eager, async_scheduling=async_scheduling and not eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        if not eager:
            assert llm.engine.runner.graphs.buckets == [1, 2, 4, 8]
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == [3, 12, 5, 20, 1, 9, 16, 7]


def test_float32_cuda_swapped_preemption_matches_transformers(checkpoint):
    """--swap-space on CUDA (pinned host memory, asynchronous copies queued before the step, async scheduling and
    decode graphs on): 8 sequences of up to 74 tokens in 10 blocks of 8 must preempt; each victim's KV goes to the
    host and back, and the greedy tokens are transformers'."""
    from pagedmoe import LLM, SamplingParams

    path, hf, prompts = checkpoint
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=80, block_size=8, num_kv_blocks=10,
              swap_space=0.05)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    sched = llm.engine.scheduler
    assert llm.engine.runner.kv_swap.host.is_pinned() and llm.engine._async is not None
    assert sched.num_swapped_total > 0 and sched.num_swapped_total == sched.num_preemptions_total
    assert sched.swap.num_used_blocks == 0 and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                              pad_token_id=0)
            assert out[0, len(p):].tolist() == o.outputs[0].token_ids
