"""Malformed and hostile raw HTTP requests: each gets a 4xx with OpenAI's error body; the server stays healthy."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from server_utils import MAX_MODEL_LEN, MODEL_NAME, assert_openai_error

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "hi", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

# (id, method, path, body: dict -> JSON | bytes -> raw, extra headers, status, param or None)
CASES = [
    ("invalid-json", "POST", C, b'{"prompt": "hi",', {}, 400, None),
    ("empty-body", "POST", C, b"", {}, 400, None),
    ("json-array-body", "POST", C, b"[1, 2, 3]", {}, 400, None),
    ("json-string-body", "POST", C, b'"hello"', {}, 400, None),
    ("nan-temperature", "POST", C, b'{"prompt": "hi", "temperature": NaN}', {}, 400, None),
    ("infinite-temperature", "POST", C, b'{"prompt": "hi", "temperature": 1e999}', {}, 400, "temperature"),
    ("deeply-nested-json", "POST", C, b"[" * 200_000 + b"]" * 200_000, {}, 400, None),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe\xfd"}', {}, 400, None),
    ("lone-surrogate-prompt", "POST", C, b'{"prompt": "a\\ud800b"}', {}, 400, "prompt"),
    ("lone-surrogate-message", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', {}, 400,
     "messages"),
    ("lone-surrogate-tokenize", "POST", "/tokenize", b'{"prompt": "ab\\ud800"}', {}, 400, "prompt"),
    ("5000-digit-integer", "POST", C, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, None),
    ("missing-prompt", "POST", C, {"max_tokens": 2}, {}, 400, "prompt"),
    ("prompt-is-number", "POST", C, {"prompt": 5}, {}, 400, "prompt"),
    ("prompt-mixed-list", "POST", C, {"prompt": [1, "a"]}, {}, 400, "prompt"),
    ("prompt-bool-ids", "POST", C, {"prompt": [True, False]}, {}, 400, "prompt"),
    ("prompt-empty-list", "POST", C, {"prompt": []}, {}, 400, "prompt"),
    ("prompt-empty-string", "POST", C, {"prompt": ""}, {}, 400, None),
    ("token-id-out-of-range", "POST", C, {"prompt": [1, 10 ** 9]}, {}, 400, "prompt"),
    ("negative-token-id", "POST", C, {"prompt": [-1]}, {}, 400, "prompt"),
    ("prompt-longer-than-context", "POST", C, {"prompt": [5] * (MAX_MODEL_LEN + 10)}, {}, 400, "prompt"),
    ("5-MB-text-prompt", "POST", C, {"prompt": "a" * 5_000_000}, {}, 400, "prompt"),
    ("text-prompt-longer-than-context", "POST", C, {"prompt": "hello world " * 200}, {}, 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "POST", C, {"prompt": [5] * 100, "max_tokens": 100}, {}, 400,
     "max_tokens"),
    ("max-tokens-zero", "POST", C, {**OK, "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, {**OK, "max_tokens": "ten"}, {}, 400, "max_tokens"),
    ("negative-temperature", "POST", C, {**OK, "temperature": -1}, {}, 400, "temperature"),
    ("top-p-zero", "POST", C, {**OK, "top_p": 0}, {}, 400, "top_p"),
    ("top-p-above-one", "POST", C, {**OK, "top_p": 1.5}, {}, 400, "top_p"),
    ("top-k-negative", "POST", C, {**OK, "top_k": -5}, {}, 400, None),
    ("n-zero", "POST", C, {**OK, "n": 0}, {}, 400, "n"),
    ("n-huge", "POST", C, {**OK, "n": 10 ** 6}, {}, 400, "n"),
    ("logprobs-21", "POST", C, {**OK, "logprobs": 21}, {}, 400, "logprobs"),
    ("seed-too-large", "POST", C, {**OK, "seed": 2 ** 70}, {}, 400, "seed"),
    ("too-many-stop-strings", "POST", C, {**OK, "stop": [f"s{i}" for i in range(100)]}, {}, 400, "stop"),
    ("empty-stop-string", "POST", C, {**OK, "stop": [""]}, {}, 400, "stop"),
    ("presence-penalty-out-of-range", "POST", C, {**OK, "presence_penalty": 2.5}, {}, 400, "presence_penalty"),
    ("repetition-penalty-zero", "POST", C, {**OK, "repetition_penalty": 0.0}, {}, 400, "repetition_penalty"),
    ("logit-bias-not-a-token", "POST", C, {**OK, "logit_bias": {"abc": 1}}, {}, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "POST", C, {**OK, "logit_bias": {str(10 ** 9): 1}}, {}, 400, "logit_bias"),
    ("logit-bias-too-large", "POST", C, {**OK, "logit_bias": {"5": 500}}, {}, 400, "logit_bias"),
    ("min-tokens-above-max", "POST", C, {**OK, "min_tokens": 5}, {}, 400, "min_tokens"),
    # vLLM: an omitted max_tokens is the rest of the context, and min_tokens may not exceed it.
    ("min-tokens-above-rest-of-context", "POST", C, {**OK, "max_tokens": None, "min_tokens": MAX_MODEL_LEN}, {},
     400, "min_tokens"),
    ("chat-min-tokens-above-rest-of-context", "POST", CHAT, {"messages": MSG, "min_tokens": MAX_MODEL_LEN}, {},
     400, "min_tokens"),
    ("stream-options-without-stream", "POST", C, {**OK, "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options"),
    ("unknown-model", "POST", C, {**OK, "model": "gpt-17"}, {}, 404, "model"),
    ("chat-no-messages", "POST", CHAT, {"messages": []}, {}, 400, "messages"),
    ("chat-messages-not-list", "POST", CHAT, {"messages": "hi"}, {}, 400, "messages"),
    ("chat-unknown-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages"),
    ("chat-image-part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, {}, 400, "messages"),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, {}, 400,
     "top_logprobs"),
    # The context-length error names the field the client sent.
    ("chat-max-tokens-too-long", "POST", CHAT, {"messages": MSG, "max_tokens": MAX_MODEL_LEN}, {}, 400,
     "max_tokens"),
    ("chat-max-completion-tokens-too-long", "POST", CHAT, {"messages": MSG, "max_completion_tokens": MAX_MODEL_LEN},
     {}, 400, "max_completion_tokens"),
    ("chat-tool-without-name", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {}}]},
     {}, 400, "tools"),
    # tool_choice auto (the default with tools) needs --enable-auto-tool-choice --tool-call-parser
    ("chat-tools-auto-without-flags", "POST", CHAT,
     {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400, "tool_choice"),
    ("chat-template-kwargs-override", "POST", CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}},
     {}, 400, "chat_template_kwargs"),
    ("get-on-post-route", "GET", C, None, {}, 405, None),
    ("unknown-route", "POST", "/v1/engines/davinci/completions", {**OK}, {}, 404, None),
    ("declared-body-too-large", "POST", C, b"{}", {"content-length": str(10 ** 9)}, 413, None),
    ("detokenize-negative-id", "POST", "/detokenize", {"tokens": [-5]}, {}, 400, "tokens"),
    ("tokenize-nothing", "POST", "/tokenize", {}, {}, 400, None),
]


def _send(client: httpx.Client, method, path, body, headers):
    if body is None:
        return client.request(method, path, headers=headers)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.request(method, path, content=content, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_4xx_with_openai_error(server, case):
    _, method, path, body, headers, status, param = case
    if "content-length" in headers:
        # httpx would send the real length: write the lie on a raw socket.
        import socket

        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {headers['content-length']}\r\n\r\n".encode() + body)
            raw = b""
            while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                raw += chunk
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.split()[1] == str(status).encode(), raw[:200]
        assert json.loads(payload)["error"]["message"]
        return
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        err = assert_openai_error(_send(client, method, path, body, headers), status)
    if param is not None:
        assert err["param"] == param, err


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_bad_input_is_a_400_without_a_traceback(server, monkeypatch):
    # A client error answered 400 logs one line at most: no traceback from uvicorn ("Exception in ASGI
    # application": Starlette re-raises what reaches a handler registered for Exception), none from us.
    seen = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "pagedmoe.server")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            body = b'{"prompt": "hi \\ud800", "max_tokens": 2}'
            err = assert_openai_error(client.post(C, content=body, headers={"content-type": "application/json"}),
                                      400)
            assert err["message"] == "prompt contains a lone surrogate U+D800 at position 3, not valid UTF-8"
            # Input refused deep inside (the tokenizer, the engine) with a TypeError or ValueError.
            monkeypatch.setattr(server.app.state.serving, "check_model", lambda model: ("x",) + None)
            err = assert_openai_error(client.post(C, json=OK), 400)
            assert "tuple" in err["message"]
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    assert not [r for r in seen.records if r.exc_info], [r.getMessage() for r in seen.records]
    assert len(seen.records) <= 1 and all("\n" not in r.getMessage() for r in seen.records)


def test_lone_surrogate_in_a_list_of_prompts_names_its_index(server):
    body = b'{"prompt": ["hi", "ok \\ud800"], "max_tokens": 2}'
    err = assert_openai_error(httpx.post(server.base_url + C, content=body,
                                         headers={"content-type": "application/json"}, timeout=30), 400)
    assert err["message"] == "prompt[1] contains a lone surrogate U+D800 at position 3, not valid UTF-8", err
    assert err["param"] == "prompt"


def test_server_is_healthy_after_hostile_requests(server):
    for case in CASES:  # make sure they all ran against this server, in any test order
        if "content-length" not in case[4] and "MB" not in case[0]:
            with httpx.Client(base_url=server.base_url, timeout=30) as client:
                assert 400 <= _send(client, *case[1:5]).status_code < 500
    assert httpx.get(server.base_url + "/health").status_code == 200
    r = httpx.post(server.base_url + C, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3,
                                              "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    m = server.wait_idle()
    assert not server.engine.requests  # nothing half-added is left in the engine
