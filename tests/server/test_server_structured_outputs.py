"""Structured outputs over real HTTP with the official openai client: response_format (json_object, json_schema) and
vLLM's structured_outputs (json, regex, choice, grammar) on /v1/chat/completions and /v1/completions, streamed and
not, the same outputs as the offline engine; a bad constraint is a 400 naming it."""
from __future__ import annotations

import json
import re
import sys

import httpx
import pytest

from server_utils import MODEL_NAME, assert_openai_error

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

# x-guidance (llguidance's schema options): no free whitespace, which a random model writes until max_tokens
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
MESSAGES = [{"role": "user", "content": "a city please"}]
REGEX = r"[xyz]{1,4}=[0-9]{2}"


def _offline(ref, prompt_or_messages, **so):
    from pagedmoe import SamplingParams, StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(**so))
    if isinstance(prompt_or_messages, str):
        return ref.generate([prompt_or_messages], params, use_tqdm=False)[0].outputs[0].text
    return ref.chat(prompt_or_messages, params, use_tqdm=False)[0].outputs[0].text


def _check_city(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"city", "rank"} and obj["city"] in ("paris", "rome")
    assert isinstance(obj["rank"], int) and 1 <= obj["rank"] <= 9


def test_chat_response_format_json_schema(client, ref):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    content = r.choices[0].message.content
    _check_city(content)
    assert r.choices[0].finish_reason == "stop"
    assert content == _offline(ref, MESSAGES, json=SCHEMA)


def test_chat_response_format_json_object(client, ref):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0,
                                       response_format={"type": "json_object"})
    content = r.choices[0].message.content
    assert content.startswith("{") and content == _offline(ref, MESSAGES, json_object=True)[:len(content)]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_structured_outputs(client, ref):
    r = client.completions.create(model=MODEL_NAME, prompt="def add", max_tokens=30, temperature=1.0, seed=4, n=3,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    assert len(r.choices) == 3
    assert all(re.fullmatch(REGEX, c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL_NAME, prompt=["x", "print"], max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert [c.text for c in r.choices] == [_offline(ref, p, choice=["up", "down"]) for p in ("x", "print")]
    assert all(c.text in ("up", "down") for c in r.choices)
    lark = 'start: word (" " word)*\nword: "ab" | "cd"'
    r = client.completions.create(model=MODEL_NAME, prompt="class", max_tokens=12, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"grammar": lark}})
    text = r.choices[0].text
    assert re.fullmatch(r"(ab|cd)( (ab|cd))*", text) or (r.choices[0].finish_reason == "length"
                                                        and re.fullmatch(r"(ab|cd)( (ab|cd))* ?(a|c)?", text)), text
    r = client.completions.create(model=MODEL_NAME, prompt="import", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "c", "schema": SCHEMA}}})
    _check_city(r.choices[0].text)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streaming(client, ref, route):
    body = {"structured_outputs": {"json": SCHEMA}}
    if route == "chat":
        whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                               extra_body=body).choices[0].message.content
        chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60,
                                                     temperature=0, stream=True, extra_body=body))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        whole = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=60, temperature=0,
                                          extra_body=body).choices[0].text
        chunks = list(client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=60, temperature=0,
                                                stream=True, extra_body=body))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(chunks) > 3   # token by token, not one piece at the end
    assert streamed == whole
    _check_city(streamed)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def _post(server, route, **body):
    if route == "chat":
        body = {"messages": MESSAGES, **body}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": "hi", **body}
        path = "/v1/completions"
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, "max_tokens": 4, **body}, timeout=60)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("body, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ({"guided_choice": ["a"]}, "guided_choice", "removed"),
])
def test_bad_constraints_are_400(server, route, body, param, match):
    stream = {"stream": True} if "regex" in body.get("structured_outputs", {}) else {}
    err = assert_openai_error(_post(server, route, **body, **stream), 400)
    assert err["param"] == param and match in err["message"], err


def test_without_llguidance_a_constraint_is_400_naming_the_package(server, monkeypatch):
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    err = assert_openai_error(_post(server, "chat", response_format={"type": "json_object"}), 400)
    assert "pip install llguidance" in err["message"] and "\n" not in err["message"]
    r = _post(server, "chat", response_format={"type": "text"})   # unconstrained requests are served
    assert r.status_code == 200, r.text
