"""The server over an engine with async scheduling (the default of a CUDA engine with resident experts; asked
for explicitly here on CPU): completions, streams, stops and concurrent requests as the plain engine gives them."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_utils import MODEL_NAME, ServerThread, make_engine

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def async_server(tiny_model_dir):
    engine = make_engine(tiny_model_dir, async_scheduling=True)
    assert engine._async is not None
    with ServerThread(engine) as s:
        yield s


def _greedy(ref, prompt, max_tokens, **kw):
    from pagedmoe import SamplingParams

    return ref.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]


def test_completion_and_stream_match_the_plain_engine(async_server, ref):
    want = _greedy(ref, PROMPT, 10, ignore_eos=True).outputs[0]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = httpx.post(async_server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == want.text and r["usage"]["completion_tokens"] == 10
    text = ""
    with httpx.stream("POST", async_server.base_url + "/v1/completions", json=dict(body, stream=True),
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"]
                text += ch[0]["text"] if ch else ""
    assert text == want.text


def test_stop_string_is_seen_one_step_late_but_cut_in_place(async_server, ref):
    full = _greedy(ref, PROMPT, 12, ignore_eos=True).outputs[0].text
    stop = full[3:6]
    want = _greedy(ref, PROMPT, 12, ignore_eos=True, stop=[stop]).outputs[0]
    r = httpx.post(async_server.base_url + "/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["text"] == want.text and r["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_each_get_their_own_tokens(async_server, ref):
    prompts = [PROMPT, "The capital of", "1 2 3 4", "hello"]
    want = [_greedy(ref, p, 8, ignore_eos=True).outputs[0].text for p in prompts]

    async def one(c, p):
        r = await c.post(async_server.base_url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        return r.json()["choices"][0]["text"]

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(together()) == want
