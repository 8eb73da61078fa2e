"""--async-scheduling (engine/async_step.py) against plain steps on tiny checkpoints: every output the
same (tokens, text, finish and stop reasons; logprobs to float32 rounding), over greedy and seeded sampling, stop strings,
stop tokens, EOS, min_tokens, penalties, n > 1, prefix caching, chunked prefill and preemption; the loop
launches step N + 1 before it reads step N's tokens back, one readback a step; the flag refuses what it
cannot take."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint

SYSTEM = list(range(10, 58))  # 48 shared tokens: 3 blocks of 16 (prefix caching)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=3)
    return str(path)


def _workload(eos: int, penalties: bool):
    """11 prompts, 13 sequences. Penalties and logit bias need the previous token on the host (the step
    before completes first: async_step.py), so the mix without them runs every step overlapped."""
    from pagedmoe import SamplingParams as P

    greedy = dict(temperature=0, ignore_eos=True)
    prompts = ["def add(a, b):", "class Point:", SYSTEM + [100, 7, 8], SYSTEM + [101, 7, 9], [5, 6, 7],
               "for i in", "import os", SYSTEM[:40] + [300, 301], "x = ", "print(", "while True:"]
    params = [
        P(max_tokens=9, **greedy),
        P(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),         # seeded sampling
        P(max_tokens=7, **greedy),                                                     # shared prefix
        P(max_tokens=11, logprobs=3, **greedy),                                        # logprobs
        P(max_tokens=30, temperature=0),                                               # EOS may stop it
        P(max_tokens=10, n=3, temperature=0.8, seed=11, ignore_eos=True),              # n > 1, seeded
        P(max_tokens=10, temperature=0.5, top_k=5, seed=3, ignore_eos=True),           # top-k, seeded
        P(max_tokens=8, min_tokens=6, temperature=0, stop_token_ids=[3, 4, 5, 6, 7]),  # min_tokens
        P(max_tokens=1, **greedy),                                                     # one token
        P(max_tokens=14, stop=["(", ")", "\n", " "], **greedy),                       # stop strings
        P(max_tokens=12, stop_token_ids=list(range(0, 400, 3)), **greedy),             # stop tokens
    ]
    if penalties:
        params[6] = P(max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5, **greedy)
        params[4] = P(max_tokens=30, temperature=0, min_tokens=4, logit_bias={eos: 40.0})  # EOS at token 4
    return prompts, params


def _run(ckpt, async_scheduling, penalties=False, **flags):
    from pagedmoe import LLM

    llm = LLM(ckpt, device="cpu", max_model_len=128, async_scheduling=async_scheduling, **flags)
    prompts, params = _workload(min(llm.engine.outputs.eos_token_ids), penalties)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = []
    for o in outs:
        for c in o.outputs:
            lps = None if c.logprobs is None else [{t: (lp.logprob, lp.rank) for t, lp in e.items()}
                                                   for e in c.logprobs]
            got.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps, c.cumulative_logprob))
    return got, llm


@pytest.mark.parametrize("flags", [
    {},
    {"max_num_batched_tokens": 24},                          # chunked prefill
    {"num_kv_blocks": 10, "max_num_batched_tokens": 40},     # preemption by recompute
    {"num_kv_blocks": 10, "max_num_batched_tokens": 40, "swap_space": 0.01},   # preemption by swapping
    {"enable_prefix_caching": False},
], ids=["plain", "chunked", "preempt", "swap", "no-prefix-cache"])
@pytest.mark.parametrize("penalties", [False, True], ids=["overlapped", "penalties"])
def test_outputs_equal_plain_steps(ckpt, flags, penalties):
    plain, _ = _run(ckpt, False, penalties, **flags)
    overlapped, llm = _run(ckpt, True, penalties, **flags)
    assert llm.engine._async is not None
    assert len(plain) == len(overlapped) == 13
    for i, (a, b) in enumerate(zip(plain, overlapped)):
        # a request that stopped at step N still has a row in N + 1, so batches differ from plain steps and
        # a matmul may round a logit 1 ulp apart: logprobs within 1e-5, everything else exact
        assert a[:4] == b[:4], f"output {i}: plain {a}\nasync {b}"
        assert (a[4] is None) == (b[4] is None) and (a[5] is None) == (b[5] is None)
        assert a[5] is None or b[5] == pytest.approx(a[5], rel=1e-5, abs=1e-5)
        for ea, eb in zip(a[4] or [], b[4] or []):
            assert ea.keys() == eb.keys() and all(eb[t][1] == ea[t][1] for t in ea)
            assert [eb[t][0] for t in ea] == pytest.approx([ea[t][0] for t in ea], rel=1e-5, abs=1e-5)
    assert any(r[2] == "stop" and isinstance(r[3], str) for r in plain)  # a stop string did stop one
    assert any(r[2] == "stop" and r[3] is None for r in plain) or not penalties  # EOS stopped one
    stats = llm.engine.get_stats()
    if "num_kv_blocks" in flags and not penalties:
        assert stats["num_preemptions_total"] > 0
        assert (stats["num_swapped_preemptions_total"] == stats["num_preemptions_total"]) == ("swap_space" in flags)
    if "swap_space" in flags:  # the swapped KV is the KV: the tokens of a run that never preempts
        unpreempted, _ = _run(ckpt, False, penalties, max_num_batched_tokens=40)
        assert [r[0] for r in overlapped] == [r[0] for r in unpreempted]
    if flags.get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits_total"] > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks       # every block came back


def test_swap_out_in_a_step_that_runs_nothing(ckpt):
    """4 blocks of 4 tokens. Step 3: A's token in flight is its last (A is not scheduled, its blocks still held) and B
    needs a third block: B preempts itself, so the step runs no forward. B's KV must still reach the host (or B
    recompute): swapped back in from a host slot never written, B's next tokens were computed over garbage. (No
    prefix cache: it would give B its full blocks back without a copy.)"""
    from pagedmoe import LLM, SamplingParams

    greedy = dict(temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]
    params = [SamplingParams(max_tokens=2, **greedy), SamplingParams(max_tokens=6, **greedy)]
    want = [o.outputs[0].token_ids for o in LLM(ckpt, device="cpu", max_model_len=16).generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(ckpt, device="cpu", max_model_len=16, block_size=4, num_kv_blocks=4, swap_space=0.001,
              enable_prefix_caching=False, async_scheduling=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert got == want
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert llm.engine.scheduler.swap.num_used_blocks == 0


def test_step_n_plus_1_launches_before_step_n_is_read(ckpt, monkeypatch):
    """The overlap itself: each step's tokens are read back (the one blocking wait of a step) only after
    the next step is launched; without penalties no step waits for its predecessor."""
    from pagedmoe import LLM, SamplingParams
    from pagedmoe.worker.sampler import DeviceSample

    llm = LLM(ckpt, device="cpu", max_model_len=64, async_scheduling=True)
    log = []
    execute, result = llm.engine.runner.execute, DeviceSample.result

    def logged_execute(*a, **k):
        log.append("launch")
        return execute(*a, **k)

    def logged_result(self):
        log.append("read")
        return result(self)

    monkeypatch.setattr(llm.engine.runner, "execute", logged_execute)
    monkeypatch.setattr(DeviceSample, "result", logged_result)
    before = DeviceSample.readbacks
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    launches, reads = log.count("launch"), log.count("read")
    assert launches == reads == 6 and DeviceSample.readbacks - before == 6  # one readback a step
    for k in range(1, reads):  # the k-th read (step k) comes after step k + 1's launch
        nth = [i for i, x in enumerate(log) if x == "read"][k - 1]
        assert log[:nth].count("launch") >= k + 1, log


def test_the_flag_refuses_what_it_cannot_take(ckpt):
    from pagedmoe import LLM
    from pagedmoe.config import EngineConfig

    with pytest.raises(ValueError, match="async-scheduling does not support --tensor-parallel-size"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async-scheduling does not support paged experts"):
        LLM(ckpt, device="cpu", max_model_len=64, async_scheduling=True, cpu_moe=True)


def test_default_is_on_where_it_can_take_effect(ckpt):
    """No flag: on for a CUDA engine that supports it (vLLM's default), off on CPU and where it cannot take
    effect (no error there: only an explicit --async-scheduling must take effect); --no-async-scheduling: off."""
    from types import SimpleNamespace

    from pagedmoe import LLM
    from pagedmoe.config import EngineConfig, add_engine_args
    from pagedmoe.engine.async_step import async_scheduling_applies
    import argparse

    def engine(device="cuda", pager=None, precision=None, control=None):
        return SimpleNamespace(device=torch.device(device), pager=pager, precision=precision,
                               runner=SimpleNamespace(control=control))

    assert async_scheduling_applies(engine(), None) is True
    assert async_scheduling_applies(engine(), False) is False
    assert async_scheduling_applies(engine("cpu"), None) is False
    assert async_scheduling_applies(engine("cpu"), True) is True
    for blocker in ({"pager": object()}, {"precision": object()}, {"control": object()}):
        assert async_scheduling_applies(engine(**blocker), None) is False
    assert EngineConfig().async_scheduling is None
    assert EngineConfig(tensor_parallel_size=2).async_scheduling is None   # the default does not refuse TP
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).async_scheduling is None
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
    assert LLM(ckpt, device="cpu", max_model_len=64).engine._async is None
    assert LLM(ckpt, device="cpu", max_model_len=64, cpu_moe=True).engine._async is None


@pytest.mark.gpu
def test_gpu_graphs_same_tokens_and_decode_launch_does_not_sync(tmp_path):
    """bf16 with CUDA graphs: the same tokens as plain steps (greedy, seeded sampling, min_tokens; every
    request runs to the same max_tokens, so both runs batch alike), and launching a decode step (inputs,
    graph replay, sampling, the readback's copy) makes no synchronising CUDA call (torch's sync debug
    mode raises on one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pagedmoe import LLM, SamplingParams
    from pagedmoe.engine.async_step import AsyncScheduling

    make_tiny_checkpoint("qwen3_moe", tmp_path, seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(1, 384, (n,), generator=gen).tolist()} for n in (5, 31, 17, 64)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=12, ignore_eos=True, logprobs=2)]
    tokens = {}
    launch = AsyncScheduling._launch

    def strict_launch(self, sched, prev):
        if not all(s.num_new_tokens == 1 for s in sched.scheduled):
            return launch(self, sched, prev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, sched, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    AsyncScheduling._launch = strict_launch
    try:
        for mode in (False, True):
            llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=160, max_num_seqs=8,
                      enforce_eager=False, async_scheduling=mode)
            assert llm.engine.runner.graphs is not None
            tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
            torch.cuda.empty_cache()
    finally:
        AsyncScheduling._launch = launch
    assert tokens[False] == tokens[True]
