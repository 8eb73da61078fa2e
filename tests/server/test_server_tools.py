"""Tool calling over real HTTP with the official openai client, on a tiny random checkpoint that carries the default
model's chat template (which renders tools): named and required tool_choice (constrained, so valid calls come even
from random weights), none, auto with the hermes parser (a 400 without the flags), streamed deltas that accumulate
to the non-streamed message, tool and assistant tool_calls messages, /tokenize with tools, the 400s."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server_utils import MODEL_NAME, ServerThread, assert_openai_error, make_engine
from tiny_models import make_tiny_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

# x-guidance (llguidance's schema options): no free whitespace, which a random model writes until max_tokens
_COMPACT = {"whitespace_flexible": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False, "x-guidance": _COMPACT}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "the time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                   "required": ["zone"], "additionalProperties": False, "x-guidance": _COMPACT}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "weather?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_LEN = 2048


def _valid(call) -> None:
    """The call's arguments validate against its function's parameters (the two schemas above, checked by hand)."""
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("paris", "rome"), args
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7, args
    else:
        assert call.function.name == "get_time" and args in ({"zone": "utc"}, {"zone": "cet"}), call
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory):
    """The tiny checkpoint with room for a tools prompt, and the default model's chat template."""
    path = tmp_path_factory.mktemp("tiny_tools")
    make_tiny_checkpoint("qwen3_moe", path, max_position_embeddings=MAX_LEN)
    from pagedmoe.config import default_model_path

    template = json.loads((Path(default_model_path()) / "tokenizer_config.json").read_text())
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template["chat_template"]
    config_path.write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)   # newer transformers save the template apart
    return path


@pytest.fixture(scope="module")
def tools_server(tools_model_dir):
    engine = make_engine(tools_model_dir, max_model_len=MAX_LEN)
    with ServerThread(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def tc(tools_server):
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="unused", max_retries=0)


def _create(tc, **kw):
    return tc.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MESSAGES),
                                      temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 80), **kw)


def _accumulate(chunks):
    """The openai client's own stream accumulation (what `client.chat.completions.stream` returns at the end)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    try:
        return state.get_final_completion().choices[0]
    except openai.LengthFinishReasonError as e:   # raised after accumulating, for finish_reason length
        return e.completion.choices[0]


def _calls(message):
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_template_receives_tools(tools_server, tc):
    prompt = {"model": MODEL_NAME, "messages": MESSAGES}
    plain = httpx.post(tools_server.base_url + "/tokenize", json=prompt, timeout=30).json()
    with_tools = httpx.post(tools_server.base_url + "/tokenize", json={**prompt, "tools": TOOLS}, timeout=30).json()
    assert with_tools["count"] > plain["count"] + 50
    tokenizer = tools_server.engine.tokenizer
    text = tokenizer.decode(with_tools["tokens"])
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    # the chat route renders the same prompt: tool_choice none still shows the tools (vLLM's default)
    r = _create(tc, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens == with_tools["count"]
    assert _create(tc, max_tokens=1).usage.prompt_tokens == plain["count"]


def test_named(tc):
    r = _create(tc, tools=TOOLS, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"   # vLLM's (and OpenAI's) for a named function
    assert not choice.message.content
    assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name == "get_weather"
    _valid(choice.message.tool_calls[0])
    r = _create(tc, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, n=2,
                temperature=1.0, seed=3)
    for choice in r.choices:
        _valid(choice.message.tool_calls[0])
        assert choice.message.tool_calls[0].function.name == "get_time"


def test_required(tc):
    r = _create(tc, tools=TOOLS, tool_choice="required", max_tokens=200)
    choice = r.choices[0]
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _valid(call)
    assert choice.finish_reason == ("tool_calls" if r.usage.completion_tokens < 200 else "length")
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    for choice in _create(tc, tools=TOOLS, tool_choice="required", max_tokens=200, n=3, temperature=1.0,
                          seed=11).choices:
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            _valid(call)


@pytest.mark.parametrize("tool_choice", [NAMED, "required", "none", "auto"])
def test_streaming_accumulates_to_the_message(tc, tool_choice):
    kw = dict(tools=TOOLS, tool_choice=tool_choice, max_tokens=60 if tool_choice in ("none", "auto") else 200)
    whole = _create(tc, **kw).choices[0]
    chunks = list(_create(tc, stream=True, **kw))
    streamed = _accumulate(chunks)
    assert _calls(streamed.message) == _calls(whole.message)
    assert (streamed.message.content or "") == (whole.message.content or "")
    assert streamed.finish_reason == whole.finish_reason
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    if tool_choice is NAMED:   # the arguments arrive in pieces, the first with id, type and name
        assert len(deltas) > 3 and deltas[0].id and deltas[0].function.name == "get_weather"
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
    if tool_choice == "required":   # one delta per call, whole
        assert [d.index for d in deltas] == list(range(len(whole.message.tool_calls)))


def test_auto_and_none_give_plain_content(tc):
    """A random model writes no <tool_call>: auto gives its text as content, as none does."""
    plain = _create(tc, max_tokens=20)
    for choice in ("none", "auto"):
        r = _create(tc, tools=TOOLS, tool_choice=choice, max_tokens=20).choices[0]
        assert r.message.tool_calls in (None, []) and r.finish_reason == "length"
        assert isinstance(r.message.content, str)
    assert plain.choices[0].message.content is not None


# what a Qwen3-style model writes for auto, forced on the random model with a regex (structured outputs join auto)
HERMES_REGEX = (r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'
                r'(\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "rome", "days": [1-7]\}\}\n'
                r'</tool_call>)?( [a-z]{1,3})?')


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_auto_hermes_parses_the_output(tc, seed):
    kw = dict(tools=TOOLS, max_tokens=400, temperature=1.0, seed=seed,
              extra_body={"structured_outputs": {"regex": HERMES_REGEX}})   # tool_choice: auto, the default
    whole = _create(tc, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = whole.message.tool_calls
    assert [c.function.name for c in calls] in (["get_time"], ["get_time", "get_weather"])
    for call in calls:
        _valid(call)
    assert whole.message.content.startswith("Sure.\n") and "tool_call" not in whole.message.content
    chunks = list(_create(tc, stream=True, **kw))
    streamed = _accumulate(chunks)
    assert _calls(streamed.message) == _calls(whole.message)
    assert streamed.message.content == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert any(c.choices[0].delta.content for c in chunks[:first_call] if c.choices)   # content streamed first


def test_tool_messages_are_rendered(tools_server, tc):
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "chatcmpl-tool-1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "rome", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 24C"}]
    tok = httpx.post(tools_server.base_url + "/tokenize", json={"model": MODEL_NAME, "messages": history,
                                                                "tools": TOOLS}, timeout=30).json()
    text = tools_server.engine.tokenizer.decode(tok["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n</tool_call>' in text
    assert "sunny, 24C" in text
    r = _create(tc, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.usage.prompt_tokens == tok["count"]


def test_auto_needs_the_flags(server, client):
    """The module-wide server runs without --enable-auto-tool-choice: auto (the default with tools) is a 400."""
    for kw in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=2, **kw)
        assert "--enable-auto-tool-choice and --tool-call-parser" in str(e.value)
    # named, required and none need no flags
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                       max_tokens=60, temperature=0)
    _valid(r.choices[0].message.tool_calls[0])


@pytest.mark.parametrize("body, param, match", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": NAMED}, "tool_choice", "needs tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", "type 'function'"),
    ({"tools": {"type": "function"}}, "tools", None),
    ({"tools": TOOLS, "tool_choice": 7}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constrains the output"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools", "cannot be used"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}], "tools": TOOLS, "tool_choice": "none"},
     "messages", "tool_calls"),
])
def test_errors(tools_server, body, param, match):
    resp = httpx.post(tools_server.base_url + "/v1/chat/completions",
                      json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **body}, timeout=30)
    err = assert_openai_error(resp, 400)
    assert err["param"] == param
    if match:
        assert match in err["message"], err


def test_server_refuses_bad_flags(tools_model_dir):
    with pytest.raises(ValueError, match="known: deepseek_v3, deepseek_v31, glm45, hermes, mistral"):
        ServerThread(make_engine(tools_model_dir, max_model_len=MAX_LEN), enable_auto_tool_choice=True,
                     tool_call_parser="pythonic")


def test_offline_chat_tools(tools_model_dir, tools_server):
    """LLM.chat(tools=...) renders them as the server does (same prompt tokens)."""
    from pagedmoe import SamplingParams
    from pagedmoe.llm import LLM

    llm = LLM(str(tools_model_dir), max_model_len=MAX_LEN, max_num_seqs=2)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, tools=TOOLS)[0]
    tok = httpx.post(tools_server.base_url + "/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                                "tools": TOOLS}, timeout=30).json()
    assert out.prompt_token_ids == tok["tokens"]
