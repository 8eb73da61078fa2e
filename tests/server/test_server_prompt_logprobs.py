"""/v1/completions with echo and logprobs: the echoed prompt's tokens carry their logprobs (the first one's null)
before the generated ones, and echo with max_tokens 0 answers the prompt alone (lm-eval-harness's loglikelihood),
as vLLM does; over real HTTP, against the offline engine's prompt_logprobs."""
from __future__ import annotations

import json

import httpx
import pytest

from server_utils import MODEL_NAME, assert_openai_error

PROMPT = "def add(a, b):\n    return"


def _offline(ref, k, max_tokens):
    from pagedmoe import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    return ref.generate([PROMPT], params, use_tqdm=False)[0]


def _post(server, **body):
    return httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body})


def _check_prompt_part(lp, want, k):
    ids = want.prompt_token_ids
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        entry = want.prompt_logprobs[i]
        assert lp["tokens"][i] == entry[ids[i]].decoded_token
        assert lp["token_logprobs"][i] == pytest.approx(entry[ids[i]].logprob, abs=1e-4)
        assert len(lp["top_logprobs"][i]) >= k
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets


def test_echo_with_logprobs(server, ref):
    want = _offline(ref, 2, 4)
    r = _post(server, echo=True, logprobs=2, max_tokens=4)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    n = len(want.prompt_token_ids)
    assert choice["text"] == PROMPT + want.outputs[0].text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n + 4
    _check_prompt_part(lp, want, 2)
    gen = want.outputs[0]
    for j, tid in enumerate(gen.token_ids):
        assert lp["token_logprobs"][n + j] == pytest.approx(gen.logprobs[j][tid].logprob, abs=1e-4)
    assert choice["finish_reason"] == "length"


def test_echo_without_generation(server, ref):
    """What lm-eval-harness's loglikelihood sends: the prompt with its logprobs, no token generated."""
    want = _offline(ref, 1, 1)
    r = _post(server, echo=True, logprobs=1, max_tokens=0)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(want.prompt_token_ids)
    _check_prompt_part(choice["logprobs"], want, 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    # without logprobs: the prompt alone
    plain = _post(server, echo=True, max_tokens=0).json()["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None


def test_echo_with_logprobs_streamed(server, ref):
    want = _offline(ref, 0, 3)
    chunks = []
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 0, "max_tokens": 3, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == PROMPT + want.outputs[0].text
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert len(tokens) == len(want.prompt_token_ids) + 3
    _check_prompt_part(chunks[0]["logprobs"], want, 0)


def test_max_tokens_zero_needs_echo(server):
    assert assert_openai_error(_post(server, max_tokens=0), 400)["param"] == "max_tokens"
    assert assert_openai_error(_post(server, max_tokens=0, echo=True, stream=True), 400)["param"] == "max_tokens"
