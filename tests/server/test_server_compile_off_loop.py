"""A request's constraint is compiled off the event loop: while one request's schema, regex or required tool_choice
compiles (made to take 3 s here), /health and a plain request are answered at once, and the constrained request is
answered as usual afterwards; a bad constraint is still a 400 naming its field."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_utils import MODEL_NAME, assert_openai_error

pytest.importorskip("llguidance")

COMPILE_S = 3.0
PROMPT_ANSWER_S = 1.5   # generous: a 2-core machine under load; on the event loop /health would wait COMPILE_S
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture
def slow_compile(monkeypatch):
    """Every compile (not cache hits) sleeps COMPILE_S; `started` is set when one begins, `done` when it ends."""
    from pagedmoe.structured_outputs import StructuredOutputsParams

    compile_ = StructuredOutputsParams._compile
    events = {"started": threading.Event(), "done": threading.Event()}

    def slow(self):
        events["started"].set()
        time.sleep(COMPILE_S)
        try:
            return compile_(self)
        finally:
            events["done"].set()

    monkeypatch.setattr(StructuredOutputsParams, "_compile", slow)
    return events


def _unique() -> str:
    return f"{time.monotonic_ns() % 10 ** 9}"   # a constraint not in the compile cache


def _requests():
    tag = _unique()
    return {
        "regex": ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0,
                                      "structured_outputs": {"regex": f"(a|{tag})+"}}),
        "json_schema": ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {f"k{tag}": {"type": "integer"}}}}}}),
        "required_tool": ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": f"get_time_{tag}"}}],
            "tool_choice": "required"}),
    }


@pytest.mark.parametrize("kind", ["regex", "json_schema", "required_tool"])
def test_other_requests_are_answered_while_a_constraint_compiles(server, slow_compile, kind):
    path, body = _requests()[kind]
    result = {}

    def constrained():
        result["r"] = httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=60)

    thread = threading.Thread(target=constrained)
    thread.start()
    try:
        assert slow_compile["started"].wait(30), "the constraint was not compiled"
        t0 = time.monotonic()
        health = httpx.get(server.base_url + "/health", timeout=30)
        waited = time.monotonic() - t0
        assert health.status_code == 200
        assert waited < PROMPT_ANSWER_S, f"/health took {waited:.2f} s while a constraint compiled"
        plain = httpx.post(server.base_url + "/v1/completions", timeout=30,
                           json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0})
        assert plain.status_code == 200, plain.text
        assert not slow_compile["done"].is_set(), "the plain request waited for the compile"
    finally:
        thread.join(60)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"]


def test_bad_constraint_is_still_a_400_naming_the_field(server, slow_compile):
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4,
                         "structured_outputs": {"regex": f"({_unique()}"}})
    err = assert_openai_error(r, 400)
    assert err["param"] == "structured_outputs" and "structured_outputs.regex" in err["message"]
    # the checks keep their order: a prompt too long for the context is named before the constraint
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                      "schema": {"type": 7}}}})
    err = assert_openai_error(r, 400)
    assert err["param"] == "max_tokens", err
