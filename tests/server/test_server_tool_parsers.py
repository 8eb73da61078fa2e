"""The auto tool parsers whose markers are special tokens (mistral, deepseek_v3, deepseek_v31, glm45) over real HTTP
with the openai client, on a tiny random checkpoint whose tokenizer has the markers as special tokens (as the real
models' tokenizers have them). A Lark grammar (structured outputs, which join auto) makes the random model write
content, a special token that is no marker, two calls in the parser's format with the markers as those tokens, and
EOS. The server turns skip_special_tokens off for these requests, so the parser sees the markers; the markers, the
other special token and EOS's text (include_stop_str_in_output) stay out of the content; the streamed deltas add up
to the message. tool_choice none keeps the default: the decoder leaves the special tokens out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_utils import MODEL_NAME, Rx, ServerThread, Tok, make_engine, token_grammar
from tiny_models import make_tiny_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

MAX_LEN = 2048
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
JUNK = "<|junk|>"   # a special token that is no marker
SPECIAL = ["[TOOL_CALLS]", "[ARGS]", B, E, CB, CE, SEP, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
           "<arg_value>", "</arg_value>", JUNK]
EOS = "<|endoftext|>"   # the tiny tokenizer's
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "weather?"}]


CITY, DAYS = Rx("[a-z]{2,8}"), Rx("[1-7]")
# the output the grammar forces, per parser: "Sure." <|junk|> " ok", two calls, EOS
OUTPUTS = {
    "mistral": [Tok("[TOOL_CALLS]"), "get_weather", Tok("[ARGS]"), '{"city": "', CITY, '", "days": ', DAYS, "}",
                Tok("[TOOL_CALLS]"), "get_time", Tok("[ARGS]"), '{"zone": "utc"}'],
    "deepseek_v3": [Tok(B), Tok(CB), "function", Tok(SEP), 'get_weather\n```json\n{"city": "', CITY, '", "days": ',
                    DAYS, "}\n```", Tok(CE), "\n", Tok(CB), "function", Tok(SEP),
                    'get_time\n```json\n{"zone": "utc"}\n```', Tok(CE), Tok(E)],
    "deepseek_v31": [Tok(B), Tok(CB), "get_weather", Tok(SEP), '{"city": "', CITY, '", "days": ', DAYS, "}", Tok(CE),
                     Tok(CB), "get_time", Tok(SEP), '{"zone": "utc"}', Tok(CE), Tok(E)],
    "glm45": [Tok("<tool_call>"), "get_weather\n", Tok("<arg_key>"), "city", Tok("</arg_key>"), "\n",
              Tok("<arg_value>"), CITY, Tok("</arg_value>"), "\n", Tok("<arg_key>"), "days", Tok("</arg_key>"), "\n",
              Tok("<arg_value>"), DAYS, Tok("</arg_value>"), "\n", Tok("</tool_call>"), "\n", Tok("<tool_call>"),
              "get_time\n", Tok("<arg_key>"), "zone", Tok("</arg_key>"), "\n", Tok("<arg_value>"), "utc",
              Tok("</arg_value>"), "\n", Tok("</tool_call>")],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny checkpoint, the markers added to its tokenizer as special tokens, the default model's chat template
    (which renders tools)."""
    from transformers import AutoTokenizer

    from pagedmoe.config import default_model_path

    path = tmp_path_factory.mktemp("tiny_tool_parsers")
    make_tiny_checkpoint("qwen3_moe", path, max_position_embeddings=MAX_LEN)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert len(tokenizer) <= 384   # within the model's vocabulary
    config = json.loads((Path(default_model_path()) / "tokenizer_config.json").read_text())
    tokenizer.chat_template = config["chat_template"]
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(OUTPUTS))
def served(request, model_dir):
    """(the parser, its server, an openai client on it)."""
    engine = make_engine(model_dir, max_model_len=MAX_LEN)
    with ServerThread(engine, enable_auto_tool_choice=True, tool_call_parser=request.param) as server:
        yield request.param, server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _create(client, tokenizer, parser: str, **kw):
    parts = ["Sure.", Tok(JUNK), " ok", *OUTPUTS[parser], Tok(EOS)]
    extra = {"structured_outputs": {"grammar": token_grammar(parts, tokenizer)}, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=400,
                                          temperature=1.0, extra_body=extra, **kw)


def _accumulate(chunks):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("seed", [0, 1])
def test_auto_parses_special_token_markers(served, seed):
    parser, server, client = served
    tokenizer = server.engine.tokenizer
    kw = dict(seed=seed, extra_body={"include_stop_str_in_output": True})   # EOS's text in the output: not content
    whole = _create(client, tokenizer, parser, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    # the text between blocks is content (glm45's newline, as hermes's); DeepSeek's section is not
    content = "Sure. ok\n" if parser == "glm45" else "Sure. ok"
    assert whole.message.content == content
    calls = _calls(whole.message)
    assert [name for name, _ in calls] == ["get_weather", "get_time"], calls
    weather = calls[0][1]
    assert set(weather) == {"city", "days"} and weather["city"].isalpha() and weather["days"] in range(1, 8)
    assert calls[1][1] == {"zone": "utc"}
    for call in whole.message.tool_calls:
        if parser == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
        else:
            assert call.id.startswith("chatcmpl-tool-")
    chunks = list(_create(client, tokenizer, parser, stream=True, **kw))
    streamed = _accumulate(chunks)
    assert _calls(streamed.message) == calls and streamed.message.content == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert any(c.choices[0].delta.content for c in chunks[:first_call] if c.choices)   # content streamed first
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1]   # each call whole, in one delta


def test_tool_choice_none_keeps_skip_special_tokens(served):
    """Only auto turns skip_special_tokens off: with none the decoder leaves the markers out, as it always does."""
    parser, server, client = served
    r = _create(client, server.engine.tokenizer, parser, tool_choice="none", seed=0).choices[0]
    assert not r.message.tool_calls and r.finish_reason == "stop"
    assert r.message.content.startswith("Sure. ok") and not any(t in r.message.content for t in SPECIAL)


def test_explicit_skip_special_tokens_false_is_kept(served):
    """A request that asks for the special tokens (skip_special_tokens false) gets them in its content; the parser's
    markers still become calls."""
    parser, server, client = served
    r = _create(client, server.engine.tokenizer, parser, seed=0,
                extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}).choices[0]
    assert [name for name, _ in _calls(r.message)] == ["get_weather", "get_time"]
    assert r.message.content.startswith("Sure." + JUNK + " ok") and r.message.content.endswith(EOS)
