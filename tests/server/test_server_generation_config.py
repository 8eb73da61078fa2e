"""The model's generation_config.json as the server's default sampling parameters (vLLM's --generation-config):
a field the request leaves out (or sends as null) takes the model's default, a field it sets wins; max_new_tokens
is the default max_tokens, capped by the context. Seen in the SamplingParams the server submits to the engine."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from server_utils import ServerThread, make_engine

FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5}
MESSAGES = [{"role": "user", "content": "hi"}]


def sampling(params) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                      "repetition_penalty", "max_tokens")}


MODEL = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1, "max_tokens": 5}


@pytest.fixture(scope="module")
def gen_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with sampling fields in its generation_config.json (beside its token ids)."""
    path = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(tiny_model_dir, path)
    file = path / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **FILE}))
    return path


@pytest.fixture(scope="module")
def served(gen_dir):
    """(server, the SamplingParams of each choice it submitted, newest last)."""
    with ServerThread(make_engine(gen_dir)) as server:
        sent = []
        submit = server.bridge.submit

        def spy(response_id, prompts, params, arrival):
            sent.extend(params)
            return submit(response_id, prompts, params, arrival)

        server.bridge.submit = spy
        yield server, sent


def post(server, route: str, body: dict) -> dict:
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_left_out_fields_take_the_models_defaults(served):
    server, sent = served
    assert server.engine.default_sampling_params == {name: v for name, v in MODEL.items() if name != "min_p"}
    r = post(server, "/v1/completions", {"prompt": "x = 1", "ignore_eos": True})
    assert sampling(sent[-1]) == MODEL
    assert r["usage"]["completion_tokens"] == 5   # max_new_tokens, not OpenAI's 16
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True})
    assert sampling(sent[-1]) == MODEL and r["usage"]["completion_tokens"] == 5
    # null reads as left out (vLLM's pydantic models do the same)
    post(server, "/v1/completions", {"prompt": "x", "temperature": None, "top_k": None, "max_tokens": None})
    assert sampling(sent[-1]) == MODEL


def test_fields_the_request_sets_win(served):
    server, sent = served
    mine = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.1, "repetition_penalty": 1.0}
    r = post(server, "/v1/completions", {"prompt": "x = 1", "max_tokens": 3, "ignore_eos": True, **mine})
    assert sampling(sent[-1]) == {**mine, "top_k": -1, "max_tokens": 3}   # top_k 0: off, as -1
    assert r["usage"]["completion_tokens"] == 3
    post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2, "temperature": 1.0})
    assert sampling(sent[-1]) == {**MODEL, "temperature": 1.0, "max_tokens": 2}
    post(server, "/v1/completions", {"prompt": "x", "n": 2, "seed": 4})
    assert [sampling(p) for p in sent[-2:]] == [MODEL, MODEL]   # each sample of n


def serving(defaults, max_model_len=128):
    """OpenAIServing alone (no engine: prompts as token ids), for what it builds from a request."""
    from pagedmoe.server.serving import OpenAIServing

    return OpenAIServing(None, None, "tiny", max_model_len, 1000, defaults=defaults)


def test_max_new_tokens_is_the_default_capped_by_the_context():
    from pagedmoe.server.protocol import APIError, CompletionRequest

    long_prompt = list(range(1, 101))   # 100 of the 128 tokens: 28 left
    s = serving({"max_tokens": 1000})
    # not a 400: the default is capped at the rest of the context (the engine stops at max_model_len)
    params = s.completion_prompts(CompletionRequest(prompt=long_prompt)).params
    assert params.max_tokens == 1000
    with pytest.raises(APIError, match="max_tokens=28"):
        s.completion_prompts(CompletionRequest(prompt=long_prompt, min_tokens=30))
    with pytest.raises(APIError, match="maximum context length"):   # a request's own max_tokens is checked
        s.completion_prompts(CompletionRequest(prompt=long_prompt, max_tokens=1000))


def test_without_defaults_nothing_changes():
    from pagedmoe.server.protocol import CompletionRequest

    s = serving({})
    params = s.completion_prompts(CompletionRequest(prompt=[1, 2, 3])).params
    assert sampling(params) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                "repetition_penalty": 1.0, "max_tokens": 16}   # OpenAI's 16
    assert s.completion_prompts(CompletionRequest(prompt=[1, 2, 3], max_tokens=None)).params.max_tokens is None
    # the model's max_new_tokens alone: the other fields keep pagedmoe's defaults
    s = serving({"max_tokens": 7})
    assert s.completion_prompts(CompletionRequest(prompt=[1, 2, 3])).params.max_tokens == 7


def test_generation_config_vllm_and_override_reach_the_server(gen_dir):
    engine = make_engine(gen_dir, generation_config="vllm", override_generation_config='{"temperature": 0.1}')
    assert engine.default_sampling_params == {"temperature": 0.1}
    with ServerThread(engine) as server:
        sent = []
        submit = server.bridge.submit
        server.bridge.submit = lambda rid, prompts, params, arrival: sent.extend(params) or submit(
            rid, prompts, params, arrival)
        post(server, "/v1/completions", {"prompt": "x"})
    assert sampling(sent[-1]) == {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                  "repetition_penalty": 1.0, "max_tokens": 16}
