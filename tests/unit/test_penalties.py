"""Logit bias and penalties against a direct, element-by-element computation of their definitions."""
import math

import pytest
import torch

from pagedmoe.sampling_params import SamplingParams
from pagedmoe.worker.penalties import apply_penalties
from pagedmoe.worker.sampler import Sampler


def _direct(row, p, prompt, output):
    out = []
    for t, x in enumerate(row):
        x += (p.logit_bias or {}).get(t, 0.0)
        if p.repetition_penalty != 1.0 and (t in prompt or t in output):
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = output.count(t)
        x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        out.append(x)
    return out


CASES = [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=1.3),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, presence_penalty=0.2, frequency_penalty=0.4, logit_bias={3: 5.0, 9: -100}),
    SamplingParams(),  # untouched
    SamplingParams(logit_bias={0: 2.5, 11: 100.0}),
]


def test_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    V = 12
    logits = torch.randn(len(CASES), V, generator=g) * 3
    histories = [([1, 2, 2, 5], [2, 7, 7, 7, 0]), ([4], [4, 4, 1]), ([], [3, 3, 10]), ([6, 8, 8], [9]),
                 ([1, 3], [3, 9, 9, 11]), ([1], [1]), ([], [])]
    got = apply_penalties(logits, CASES, histories)
    for i, p in enumerate(CASES):
        want = _direct(logits[i].tolist(), p, *histories[i])
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), i
    assert torch.equal(got[5], logits[5])


def test_greedy_follows_penalised_logits_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    sampler = Sampler(0, torch.device("cpu"))
    plain = sampler.sample(logits, [SamplingParams(temperature=0, logprobs=1)], [None], [([], [1])])
    assert plain.token_ids == [1]
    pen = sampler.sample(logits, [SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=1)], [None],
                         [([], [1])])
    assert pen.token_ids == [2]  # 5 - 2 < 4
    raw = torch.log_softmax(logits, -1)[0]
    assert pen.sampled_logprob[0] == pytest.approx(raw[2].item())
    biased = sampler.sample(logits, [SamplingParams(temperature=0, logit_bias={3: 10.0})], [None], [([], [])])
    assert biased.token_ids == [3]
    # sampling with a bias of -100 never picks the token
    p = SamplingParams(temperature=1.0, logit_bias={1: -100.0, 2: -100.0})
    seen = {sampler.sample(logits, [p], [None], [([], [])]).token_ids[0] for _ in range(50)}
    assert seen <= {0, 3}


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(repetition_penalty=0.0), dict(logit_bias={-1: 1.0}),
                                 dict(logit_bias={1: 101.0}), dict(n=0), dict(repetition_penalty=math.nan)])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_samples_get_consecutive_seeds():
    p = SamplingParams(n=3, seed=10)
    assert [p.for_sample(j).seed for j in range(3)] == [10, 11, 12]
    assert all(p.for_sample(j).n == 1 for j in range(3))
    assert SamplingParams(n=2).for_sample(1).seed is None
