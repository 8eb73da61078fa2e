"""Sampling filters against a direct computation, seeded reproducibility, logprobs."""
import math

import pytest
import torch

from pagedmoe.sampling_params import SamplingParams
from pagedmoe.worker.sampler import Sampler, apply_min_p, apply_top_k, apply_top_p, processed_logits


def _kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def test_top_k_direct():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    ks = torch.tensor([1, 3, 50, -1, 10])
    out = apply_top_k(logits, ks)
    for i, k in enumerate(ks.tolist()):
        k = 50 if k <= 0 else k
        want = set(torch.argsort(logits[i], descending=True)[:k].tolist())
        assert _kept(out[i]) == want
        assert torch.equal(out[i][list(want)], logits[i][list(want)])


def test_top_p_direct():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 3
    ps = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
    out = apply_top_p(logits, ps)
    for i, p in enumerate(ps.tolist()):
        probs = torch.softmax(logits[i].double(), -1)
        order = torch.argsort(probs, descending=True).tolist()
        want, mass = set(), 0.0
        for t in order:  # smallest prefix of the sorted tokens whose mass reaches p
            want.add(t)
            mass += probs[t].item()
            if mass >= p:
                break
        assert _kept(out[i]) == want, p


def test_min_p_direct():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=g) * 2
    ms = torch.tensor([0.0, 0.1, 0.5, 1.0])
    out = apply_min_p(logits, ms)
    for i, m in enumerate(ms.tolist()):
        probs = torch.softmax(logits[i], -1)
        want = set(torch.nonzero(probs >= m * probs.max()).flatten().tolist())
        assert _kept(out[i]) == want


def test_temperature_scales_logits():
    logits = torch.randn(2, 10)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=2.0)]
    out = processed_logits(logits, params)
    assert torch.allclose(out[0], logits[0] / 0.5) and torch.allclose(out[1], logits[1] / 2.0)


def test_greedy_is_argmax():
    s = Sampler(0, torch.device("cpu"))
    logits = torch.randn(7, 100)
    out = s.sample(logits, [SamplingParams(temperature=0.0)] * 7, [None] * 7)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_requests_reproducible_regardless_of_batch():
    s = Sampler(123, torch.device("cpu"))
    torch.manual_seed(0)
    steps = [torch.randn(3, 64) for _ in range(20)]
    p = SamplingParams(temperature=1.0, seed=42)
    free = SamplingParams(temperature=1.0)

    def run(rows_before):
        g = s.request_generator(42)
        toks = []
        for logits in steps:
            batch = torch.cat([torch.randn(rows_before, 64), logits[:1]])
            params = [free] * rows_before + [p]
            toks.append(s.sample(batch, params, [None] * rows_before + [g]).token_ids[-1])
        return toks

    a, b = run(0), run(2)
    assert a == b
    assert len(set(a)) > 3  # it really samples


def test_samples_stay_inside_filters_and_follow_the_distribution():
    s = Sampler(5, torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, -3.0]]).repeat(4000, 1)
    p = SamplingParams(temperature=0.7, top_k=3)
    toks = torch.tensor(s.sample(logits, [p] * 4000, [None] * 4000).token_ids)
    assert set(toks.tolist()) <= {0, 1, 2}
    want = torch.softmax(logits[0, :3] / 0.7, -1)
    got = torch.bincount(toks, minlength=3)[:3].float() / 4000
    assert torch.allclose(got, want, atol=0.03)


def test_logprobs_top_n_and_rank():
    s = Sampler(0, torch.device("cpu"))
    logits = torch.randn(2, 20)
    out = s.sample(logits, [SamplingParams(temperature=0.0, logprobs=3)] * 2, [None] * 2)
    lsm = torch.log_softmax(logits, -1)
    for i in range(2):
        entry = out.logprobs[i]
        top = torch.topk(lsm[i], 3)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            assert math.isclose(entry[t].logprob, v, rel_tol=1e-6) and entry[t].rank == r + 1
        tok = out.token_ids[i]
        assert entry[tok].rank == 1
        assert math.isclose(out.sampled_logprob[i], lsm[i, tok].item(), rel_tol=1e-6)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(min_p=2.0), dict(max_tokens=0), dict(logprobs=50), dict(n=0),
                                 dict(stop=[""]), dict(stop_token_ids=[-1]), dict(min_tokens=5, max_tokens=2),
                                 # of the wrong type, or a seed torch refuses: refused here, not inside a step
                                 dict(top_k=2.5), dict(max_tokens=2.5), dict(logprobs=2.5), dict(min_tokens=1.5),
                                 dict(top_k=None), dict(temperature="1"), dict(seed=2 ** 64),
                                 dict(seed=-(2 ** 63) - 1)])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_top_k_zero_disables_as_in_vllm():
    """vLLM, its HTTP API here and llama.cpp's --top-k: 0 and -1 both mean no top-k filter."""
    s = Sampler(0, torch.device("cpu"))
    logits = torch.randn(4, 50)

    def draw(top_k):
        params = [SamplingParams(temperature=1.0, top_k=top_k)] * 4
        return s.sample(logits.clone(), params, [s.request_generator(7 + i) for i in range(4)]).token_ids

    assert draw(0) == draw(-1)


def test_all_rows_from_the_engine_generator_draw_as_the_gathered_rows_did():
    """A batch whose every row samples from the engine's generator takes one multinomial over the whole batch (no
    argmax, no index gather/scatter): the same tokens as the general path, which gathers those rows (a mixed batch
    with a greedy row still takes it); temperature 1 leaves the logits as they are (x / 1 is x)."""
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 2
    for temp in (1.0, 0.7):
        params = [SamplingParams(temperature=temp) for _ in range(6)]
        fast = Sampler(11, torch.device("cpu")).sample(logits, params, [None] * 6).token_ids
        probs = torch.softmax(logits / temp, dim=-1)
        idx = torch.arange(6)
        want = torch.multinomial(probs[idx], 1, generator=torch.Generator().manual_seed(11)).squeeze(-1)
        assert fast == want.tolist()
    params = [SamplingParams(temperature=1.0) for _ in range(6)]
    assert processed_logits(logits, params) is logits
    mixed = params[:5] + [SamplingParams(temperature=0.0)]
    out = Sampler(11, torch.device("cpu")).sample(logits, mixed, [None] * 6).token_ids
    want = torch.multinomial(torch.softmax(logits[:5], -1), 1, generator=torch.Generator().manual_seed(11))
    assert out == want.squeeze(-1).tolist() + [int(logits[5].argmax())]


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_filters_by_row_chunks_equal_the_whole_batch(monkeypatch, rows):
    """processed_logits on FILTER_ROWS rows at a time (the sampler's memory bound) gives the whole batch's result,
    logits and probabilities, top-k by torch.topk or by a full sort, rows that keep everything beside rows that
    filter; ties at the k-th value stay; the input is left as it was."""
    from pagedmoe.worker import sampler as sm

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 60, generator=g) * 2).round()    # rounded: ties
    before = logits.clone()
    ks, ps = [1, 5, -1, 60, 17, -1, 59], [0.1, 0.5, 1.0, 0.9, 0.99, 0.3, 0.7]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in zip([1.0, 0.7, 1.5, 1.0, 2.0, 1.0, 0.9], ks, ps, [0, 0.05, 0, 0, 0.2, 0, 0])]
    whole = apply_min_p(apply_top_p(apply_top_k(
        logits / torch.tensor([p.temperature for p in params]).unsqueeze(-1), torch.tensor(ks)),
        torch.tensor(ps)), torch.tensor([p.min_p for p in params]))
    monkeypatch.setattr(sm, "FILTER_ROWS", rows)
    for topk_max in (1024, 0):
        monkeypatch.setattr(sm, "TOPK_MAX", topk_max)
        assert torch.equal(processed_logits(logits, params), whole)
        assert torch.equal(processed_logits(logits, params, probs=True), torch.softmax(whole, dim=-1))
    assert torch.equal(logits, before)
    plain = [SamplingParams(temperature=1.0)] * 7
    assert processed_logits(logits, plain) is logits
    assert torch.equal(processed_logits(logits, plain, probs=True), torch.softmax(logits, dim=-1))
    top_k = apply_top_k(logits, torch.tensor(ks))
    for i, k in enumerate(ks):
        k = 60 if k <= 0 else k
        kth = logits[i].sort(descending=True).values[k - 1]
        assert _kept(top_k[i]) == set(torch.nonzero(logits[i] >= kth).flatten().tolist())


def test_processed_logits_top_k_without_a_device_read(monkeypatch):
    """processed_logits hands apply_top_k the largest top_k from the host parameters (no read of the device
    tensor); rows without top-k keep every token."""
    from pagedmoe.worker import sampler as sm

    seen = []
    real = sm.apply_top_k
    monkeypatch.setattr(sm, "apply_top_k", lambda lg, k, k_max=None: seen.append(k_max) or real(lg, k, k_max))
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=9)]
    out = processed_logits(logits, params)
    assert seen == [9]
    assert [len(_kept(r)) for r in out] == [4, 40, 9]


def test_logprobs_by_row_chunks():
    """The logprob tensors, computed FILTER_ROWS rows at a time, equal the whole batch's log_softmax: top values
    and ids, the sampled token's logprob and its rank, over more rows than one chunk."""
    from pagedmoe.worker import sampler as sm

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2 * sm.FILTER_ROWS + 5, 50, generator=g)
    tokens = torch.randint(0, 50, (logits.shape[0],), generator=g)
    params = [SamplingParams(logprobs=3)] * logits.shape[0]
    top_vals, top_ids, chosen, ranks = Sampler._logprob_tensors(logits, tokens, params)
    lp = torch.log_softmax(logits, dim=-1)
    want_vals, want_ids = lp.topk(3, dim=-1)
    assert torch.equal(top_vals, want_vals) and torch.equal(top_ids, want_ids)
    assert torch.equal(chosen, lp[torch.arange(len(tokens)), tokens])
    assert torch.equal(ranks, (lp > chosen.unsqueeze(-1)).sum(-1) + 1)
