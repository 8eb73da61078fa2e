"""Prefill CUDA graphs (worker/cuda_graph.py::PrefillCudaGraphs): a short step that is not decode-only, padded to its
token bucket, gives its real rows' logits and KV writes, and writes nothing else.

CPU: the padded static inputs run eagerly through the model (the torch attention path reads host copies of the
sequence layout) against the same step unpadded. GPU: the engine with the graphs against the same engine prefilling
eager."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint, spy_logits

FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=11, num_hidden_layers=3)
    return path


def _host_step(rows, block_size):
    """The runner's host inputs (ModelRunner.host_inputs' keys) of rows [(tokens, start, blocks, samples)]."""
    ids, pos, slots, qsl, lens, logits = [], [], [], [0], [], []
    for tokens, start, blocks, samples in rows:
        n = len(tokens)
        ids += tokens
        pos += range(start, start + n)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        if samples:
            logits.append(qsl[-1] - 1)
    width = max(len(r[2]) for r in rows)
    tables = torch.tensor([r[2] + [0] * (width - len(r[2])) for r in rows], dtype=torch.int32)
    i64 = dict(dtype=torch.int64)
    return dict(input_ids=torch.tensor(ids, **i64), positions=torch.tensor(pos, **i64), slots=torch.tensor(slots, **i64),
                qsl=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
                block_tables=tables, logits_indices=torch.tensor(logits, **i64), sampling_rows=list(range(len(logits))),
                max_query_len=max(len(r[0]) for r in rows), max_seq_len=max(lens),
                is_decode_only=all(len(r[0]) == 1 for r in rows), pending_ids={})


def _caches(runner):
    return [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _restore(runner, saved):
    for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
        k.copy_(k0)
        v.copy_(v0)


def test_padded_step_matches_the_step(ckpt):
    import dataclasses

    from pagedmoe import LLM
    from pagedmoe.worker.cuda_graph import PrefillCudaGraphs

    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_model_len=128)
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    gen = torch.Generator().manual_seed(4)
    tok = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    # sequence B's first 9 tokens are cached in block 5 (an eager step, the same for both runs)
    ctx_b = tok(9)
    with torch.inference_mode():
        runner.execute_host(_host_step([(ctx_b, 0, [5], False)], bs))
    # the step: sequence A's fresh 21-token prompt over blocks 3, 4 (not sampling: a chunk) and B's decode row;
    # then a one-sequence step of 7 tokens after A's 21 (a prompt's second chunk)
    steps = [[(tok(21), 0, [3, 4], False), (tok(1), 9, [5], True)], [(tok(7), 21, [3, 4], True)]]
    graphs = PrefillCudaGraphs(model, 64, 4, -(-128 // bs), 128, torch.device("cpu"))
    for rows in steps:
        host = _host_step(rows, bs)
        before = _caches(runner)
        with torch.inference_mode():
            ref, _ = runner.execute_host(host)
        ref_caches = _caches(runner)
        _restore(runner, before)
        inputs = runner.to_device(host)
        bucket = graphs.fill(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        assert bucket == (32 if len(host["input_ids"]) > 16 else 16)
        meta = dataclasses.replace(graphs._meta(bucket), query_start_loc_cpu=graphs.query_start_loc.clone(),
                                   seq_lens_cpu=graphs.seq_lens.clone())
        with torch.inference_mode():
            got = model(graphs.input_ids[:bucket], graphs.positions[:bucket], meta, graphs.logits_indices)
        n = ref.shape[0]
        assert n == len(host["logits_indices"]) and got.shape[0] == graphs.max_seqs
        torch.testing.assert_close(got[:n], ref, rtol=1e-5, atol=1e-5)
        written = torch.zeros_like(runner.kv_caches[0][0][..., 0, 0], dtype=torch.bool).reshape(-1)
        written[host["slots"]] = True
        for (k, v), (k_ref, v_ref), (k0, v0) in zip(runner.kv_caches, ref_caches, before):
            for c, c_ref, c0 in ((k, k_ref, k0), (v, v_ref, v0)):
                flat, flat_ref, flat0 = (t.reshape(-1, *t.shape[2:]) for t in (c, c_ref, c0))
                torch.testing.assert_close(flat[written], flat_ref[written], rtol=1e-5, atol=1e-5)
                assert torch.equal(flat[~written], flat0[~written])   # the padding wrote nothing
        _restore(runner, ref_caches)


def test_the_flag_is_checked():
    from pagedmoe.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0"):
        EngineConfig(prefill_graph_tokens=-1)
    with pytest.raises(ValueError, match="--enforce-eager"):
        EngineConfig(prefill_graph_tokens=256, enforce_eager=True)


def test_explicit_tokens_fail_loudly_where_no_graph_is_captured(ckpt, monkeypatch, capsys):
    """On CPU an explicit --prefill-graph-tokens N (flag, env or LLM keyword) is refused in one line before the
    model loads; the default (None) and 0 (eager) start."""
    from pagedmoe import LLM
    from pagedmoe.cli import main
    from pagedmoe.engine import startup

    with pytest.raises(ValueError, match="--prefill-graph-tokens 64 .* this engine runs on cpu"):
        LLM(str(ckpt), device="cpu", max_model_len=64, prefill_graph_tokens=64)
    for tokens in (None, 0):
        llm = LLM(str(ckpt), device="cpu", max_model_len=64, prefill_graph_tokens=tokens)
        assert llm.engine.runner.prefill_graphs is None

    def no_load(*_a, **_k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(startup, "load_model", no_load)
    argv = ["generate", str(ckpt), "--device", "cpu", "--max-model-len", "64", "--prompt", "x"]
    assert main([*argv, "--prefill-graph-tokens", "32"]) == 2
    monkeypatch.setenv("PAGEDMOE_PREFILL_GRAPH_TOKENS", "16")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("pagedmoe generate: error: --prefill-graph-tokens ") for e in err), err
    monkeypatch.setenv("PAGEDMOE_PREFILL_GRAPH_TOKENS", "0")
    with pytest.raises(AssertionError, match="the model loaded"):   # 0 is accepted: start-up goes on to load
        main(argv)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefill_graphs_on_cuda(ckpt, async_scheduling):
    """One request at a time (prompts of 5 to 200 tokens: one step each, and chunked over steps of 128 tokens): the prefill's logits close to the eager prefill's, greedy tokens equal, every prefill replayed."""
    from pagedmoe import LLM, SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (5, 16, 17, 100, 200)]
    runs = {}
    for name, flags in (("eager", dict(prefill_graph_tokens=0)), ("graphs", {}),
                        ("chunked", dict(max_num_batched_tokens=128))):
        llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                  async_scheduling=async_scheduling, **flags)
        graphs = llm.engine.runner.prefill_graphs
        assert (graphs is None) == (name == "eager")
        captured = spy_logits(llm.engine, to_host=True)
        tokens = []
        for p in prompts:
            out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
            tokens.append(out[0].outputs[0].token_ids)
        if graphs is not None:
            assert graphs.buckets[-1] == (128 if name == "chunked" else 256)   # at most max_model_len
            assert graphs.replays >= len(prompts)
        # the routed tokens counted per layer: the graphs' padding rows are routed but not counted (activity.py)
        counted = llm.engine.runner.model.experts.activity.total.sum(1).cpu()
        runs[name] = tokens, captured, counted
        del llm
        torch.cuda.empty_cache()
    ref_tokens, ref_logits, ref_counted = runs["eager"]
    assert ref_counted.min() > 0
    for name in ("graphs", "chunked"):
        tokens, logits, counted = runs[name]
        assert torch.equal(counted, ref_counted), name
        assert tokens == ref_tokens, name
        assert len(logits) == len(ref_logits)
        for a, b in zip(ref_logits, logits):
            torch.testing.assert_close(b, a, rtol=0, atol=0.05 * a.abs().max().item())
