"""server/tools.py without a server: the hermes parser on crafted texts (whole and streamed in pieces of every size
give the same), required's array splitter, named's deltas, request validation (tools, tool_choice, the flags)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")  # server/tools.py builds the server's 400s

from pagedmoe.server import tool_parsers, tools  # noqa: E402
from pagedmoe.server.protocol import APIError  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "now"}}]


def _auto():
    return tools.resolve(TOOLS, "auto", True, "hermes")


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _streamed(mode, text: str, size: int):
    """Feed `text` in pieces of `size` characters; the content and the calls accumulated as a client does."""
    stream = mode.stream()
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, k == len(pieces) - 1)
        content += c
        for d in mode.keep(deltas):
            entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            assert ("id" in d) == (d["index"] not in calls or entry["name"] == "")  # id, type, name: first delta only
            entry["name"] += d["function"].get("name", "")
            entry["arguments"] += d["function"]["arguments"]
    return content, [{"function": calls[i]} for i in sorted(calls)], stream


HERMES_CASES = [
    # text, content, calls
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me look.\n\n",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> and then some text',
     " and then some text",
     [("get_weather", {"city": "Rome"})]),
    # malformed JSON stays in the content, tags and all; the good call is still taken
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>\n'
     '<tool_call>{"name": "get_time"}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>\n', [("get_time", {})]),
    ('<tool_call>[1, 2]</tool_call>', "<tool_call>[1, 2]</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # arguments sent as a JSON string are kept as that string
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    # an unclosed block at the end counts when its body parses, else stays content
    ('x <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}', "x ", [("get_time", {"zone": "utc"})]),
    ('x <tool_call>{"name": "get_ti', 'x <tool_call>{"name": "get_ti', []),
    # no calls: the text as it is, whitespace too; a lone "<tool" is text
    ("Just an answer. <tool", "Just an answer. <tool", []),
    ("  \n", "  \n", []),
    ("", "", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_whole_and_streamed(text, content, calls):
    mode = _auto()
    got_content, got_calls, stream = mode.message(text)
    assert got_content == content
    assert _names_args(got_calls) == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)
    assert mode.finish_reason(stream, "stop") == ("tool_calls" if calls else "stop")
    for size in (1, 2, 3, 5, 11, len(text) + 1):
        s_content, s_calls, _ = _streamed(mode, text, size)
        assert s_content == (content or ""), size
        assert _names_args(s_calls) == calls, size


def test_hermes_streams_content_before_the_call_at_once():
    stream = _auto().stream()
    assert stream.feed("Sure, ", False) == ("Sure, ", [])
    assert stream.feed("checking <tool", False) == ("checking ", [])     # "<tool" may open a call: held
    assert stream.feed('_call>{"name": "get_time", ', False) == ("", [])
    content, calls = stream.feed('"arguments": {}}</tool_call>', False)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time"] and calls[0]["index"] == 0
    assert stream.feed("\n", True) == ("\n", [])     # whitespace after content is kept


def test_parallel_tool_calls_false_keeps_the_first():
    mode = tools.resolve(TOOLS, "auto", False, "hermes")
    text = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    _, calls, _ = mode.message(text)
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_named_and_required_streams():
    named = tools.resolve(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, None)
    stream = named.stream()
    _, first = stream.feed('{"ci', False)
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert stream.feed('ty": "x"}', True) == ("", [{"index": 0, "function": {"arguments": 'ty": "x"}'}}])
    assert named.finish_reason(stream, "stop") == "stop"
    content, calls, _ = named.message('{"city": "x"}')
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "x"}'}

    required = tools.resolve(TOOLS, "required", True, None)
    text = '[{"name": "get_weather", "parameters": {"city": "Lyon"}}, {"name": "get_time", "parameters": {}}]'
    content, calls, stream = required.message(text)
    assert content == "" and _names_args(calls) == [("get_weather", {"city": "Lyon"}), ("get_time", {})]
    assert required.finish_reason(stream, "stop") == "tool_calls"
    assert required.finish_reason(stream, "length") == "length"
    for size in (1, 4, 7):
        assert _names_args(_streamed(required, text, size)[1]) == _names_args(calls)
    # cut off: the items complete by then
    assert _names_args(required.message(text[:70])[1]) == [("get_weather", {"city": "Lyon"})]


def test_required_schema():
    defs_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}},
        "x-guidance": {"whitespace_flexible": False}}}}
    schema = tools.required_schema([defs_tool, TOOLS[1]])
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["$defs"] == {"P": {"type": "integer"}} and schema["x-guidance"] == {"whitespace_flexible": False}
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert "$defs" not in first["properties"]["parameters"] and "x-guidance" not in first["properties"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    clash = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"P": {"type": "string"}}}}}
    with pytest.raises(APIError, match=r"\$defs/P"):
        tools.required_schema([defs_tool, clash])


def test_deeply_nested_parameters_are_a_400():
    """A schema nested deeper than Python's stack (the request body itself parses) was a RecursionError: a 500."""
    pytest.importorskip("llguidance")
    deep: dict = {}
    for _ in range(600):
        deep = {"type": "array", "items": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": {"D": deep}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError, match="nested too deeply|recursion") as e:
            tools.resolve([tool], choice, True, None).constraint()
        assert e.value.status_code == 400 and e.value.param == "tools"


@pytest.mark.parametrize("tool_list, choice, parser, param, match", [
    (None, "auto", "hermes", "tool_choice", "needs tools"),
    (None, {"type": "function", "function": {"name": "get_time"}}, None, "tool_choice", "needs tools"),
    (TOOLS, "auto", None, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    (TOOLS, None, None, "tool_choice", "--enable-auto-tool-choice"),   # auto is the default with tools
    (TOOLS, "sometimes", None, "tool_choice", "must be 'none', 'auto', 'required'"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "not in tools"),
    (TOOLS, {"type": "function"}, None, "tool_choice", "expected"),
    ([{"type": "function"}], "none", None, "tools", "tools\\[0\\].function"),
    ([{"type": "code_interpreter"}], "none", None, "tools", "only tools of type 'function'"),
    ([{"type": "function", "function": {"name": ""}}], "none", None, "tools", "non-empty"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "none", None, "tools", "JSON schema"),
    ([TOOLS[0], TOOLS[0]], "none", None, "tools", "given twice"),
    ("f", "none", None, "tools", "a list"),
])
def test_resolve_refuses(tool_list, choice, parser, param, match):
    with pytest.raises(APIError, match=match) as e:
        tools.resolve(tool_list, choice, True, parser)
    assert e.value.status_code == 400 and e.value.param == param


def test_resolve_modes():
    assert tools.resolve(None, None, True, None) is None
    assert tools.resolve(None, "none", True, None) is None
    assert tools.resolve([], None, True, "hermes") is None
    assert tools.resolve(TOOLS, "none", True, None).stream() is None
    assert tools.resolve(TOOLS, None, True, "hermes").choice == "auto"


def test_parser_flags():
    assert tool_parsers.check_parser_flags(False, None) is None
    for name in ("hermes", "mistral", "deepseek_v3", "deepseek_v31", "glm45"):
        assert tool_parsers.check_parser_flags(True, name) == name
    with pytest.raises(ValueError, match="known: deepseek_v3, deepseek_v31, glm45, hermes, mistral$"):
        tool_parsers.check_parser_flags(True, "pythonic")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        tool_parsers.check_parser_flags(True, None)
    with pytest.raises(ValueError, match="no effect without --enable-auto-tool-choice"):
        tool_parsers.check_parser_flags(False, "hermes")


def test_template_tool_calls():
    calls = tools.template_messages_tool_calls(
        [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
         {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}], 2)
    assert calls[0]["function"]["arguments"] == {"a": 1} and calls[1]["function"]["arguments"] == "not json"
    with pytest.raises(APIError, match=r"messages\[2\].tool_calls\[0\]"):
        tools.template_messages_tool_calls([{"id": "1"}], 2)


# -- the other auto parsers: mistral, deepseek_v3, deepseek_v31, glm45 -----------------------------------
def _check_parser(parser: str, text: str, content, calls, tool_list=TOOLS, drop=()):
    """The whole text gives `content` and `calls`; fed in pieces of any size (one character too) the same."""
    mode = tools.resolve(tool_list, "auto", True, parser)
    mode.drop = drop
    got_content, got_calls, stream = mode.message(text)
    assert got_content == content
    assert _names_args(got_calls) == calls
    assert mode.finish_reason(stream, "stop") == ("tool_calls" if calls else "stop")
    for size in (1, 2, 3, 5, 7, 11, len(text) + 1):
        s_content, s_calls, _ = _streamed(mode, text, size)
        assert s_content == (content or ""), size
        assert _names_args(s_calls) == calls, size
    return got_calls


MISTRAL_CASES = [
    # text, content, calls
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    # content before; several calls in the array; arguments as JSON text kept
    ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, '
     '{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}]', "Let me check. ",
     [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "utc"})]),
    ('[TOOL_CALLS]{"name": "get_time"}', None, [("get_time", {})]),   # one object, no arguments
    # the marker inside a string of the arguments is no marker
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "[TOOL_CALLS] x"}}] done', " done",
     [("get_weather", {"city": "[TOOL_CALLS] x"})]),
    # the newer form: NAME[ARGS]{...}, one call per marker; [ARGS] may be missing
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('Sure.[TOOL_CALLS]get_time{"zone": "cet"}', "Sure.", [("get_time", {"zone": "cet"})]),
    # malformed: stays content, the marker and all; a good call after a bad one is still taken
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ', '[TOOL_CALLS][{"name": "get_weather", '
     '"arguments": {"city": ', []),
    ('[TOOL_CALLS][{"arguments": {}}] after', '[TOOL_CALLS][{"arguments": {}}] after', []),
    ('[TOOL_CALLS][1, 2]', "[TOOL_CALLS][1, 2]", []),
    ('[TOOL_CALLS]get_time[ARGS]{"zone": 1, }', '[TOOL_CALLS]get_time[ARGS]{"zone": 1, }', []),
    ('[TOOL_CALLS]get time{}[TOOL_CALLS]get_time{}', "[TOOL_CALLS]get time{}", [("get_time", {})]),
    ('[TOOL_CALLS]get_time', "[TOOL_CALLS]get_time", []),
    # no calls: the text as it is; a partial marker at the end is text
    ("Just an answer [TOOL_CA", "Just an answer [TOOL_CA", []),
    ("[1, 2] [TOOL]", "[1, 2] [TOOL]", []),
]


@pytest.mark.parametrize("text, content, calls", MISTRAL_CASES)
def test_mistral(text, content, calls):
    for call in _check_parser("mistral", text, content, calls):
        assert len(call["id"]) == 9 and call["id"].isalnum() and call["id"].isascii()   # Mistral's ids


B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _v3(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


DEEPSEEK_V3_CASES = [
    (B + _v3("get_weather", '{"city": "Paris"}') + E, None, [("get_weather", {"city": "Paris"})]),
    # content before; the newline between calls (V3's template writes one) is not content
    ("Sure.\n" + B + _v3("get_weather", '{"city": "Rome"}') + "\n" + _v3("get_time", "{}") + E,
     "Sure.\n", [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    # other text between calls and after the section is
    (B + _v3("get_time", "{}") + " oops " + _v3("get_time", '{"zone": "utc"}') + E + " Done.",
     " oops  Done.", [("get_time", {}), ("get_time", {"zone": "utc"})]),
    # unclosed section / block at the end: a complete call counts
    (B + _v3("get_time", "{}"), None, [("get_time", {})]),
    (B + f"{CB}function{SEP}get_time\n```json\n{{}}\n```", None, [("get_time", {})]),
    # malformed blocks stay content, markers and all (the section's are taken out)
    (B + _v3("get_time", '{"zone": ') + E, _v3("get_time", '{"zone": '), []),
    (B + f"{CB}function{SEP}get_time\n{{}}{CE}" + E, f"{CB}function{SEP}get_time\n{{}}{CE}", []),   # no fence
    (B + f"{CB}get_time{SEP}{{}}{CE}" + E, f"{CB}get_time{SEP}{{}}{CE}", []),   # V3.1's form
    ("Hello <｜tool▁ca", "Hello <｜tool▁ca", []),
]


@pytest.mark.parametrize("text, content, calls", DEEPSEEK_V3_CASES)
def test_deepseek_v3(text, content, calls):
    _check_parser("deepseek_v3", text, content, calls)


DEEPSEEK_V31_CASES = [
    (B + f'{CB}get_weather{SEP}{{"city": "Paris"}}{CE}' + E, None, [("get_weather", {"city": "Paris"})]),
    ("Let me look." + B + f"{CB}get_time{SEP}{{}}{CE}{CB}get_weather{SEP}{{\"city\": \"Rome\"}}{CE}" + E,
     "Let me look.", [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    (B + f'{CB}get_weather{SEP}{{"city": {CE}' + E, f'{CB}get_weather{SEP}{{"city": {CE}', []),
    (B + f"{CB}get_weather{{}}{CE}" + E, f"{CB}get_weather{{}}{CE}", []),   # no separator
    (B + _v3("get_time", "{}") + E, _v3("get_time", "{}"), []),   # V3's form
]


@pytest.mark.parametrize("text, content, calls", DEEPSEEK_V31_CASES)
def test_deepseek_v31(text, content, calls):
    _check_parser("deepseek_v31", text, content, calls)


GLM_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time"}}]   # no schema: values that parse as JSON are JSON


def _glm(name: str, *pairs: tuple[str, str]) -> str:
    return (f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
            + "</tool_call>")


GLM_CASES = [
    (_glm("get_weather", ("city", "Paris"), ("days", "3")), None, [("get_weather", {"city": "Paris", "days": 3})]),
    # string-typed values stay as written (JSON-looking, spaces, lines); others parse as JSON where they can
    (_glm("get_weather", ("city", "42"), ("days", "three"), ("note", " a\nb ")), None,
     [("get_weather", {"city": "42", "days": "three", "note": " a\nb "})]),
    (_glm("get_time", ("zone", "utc"), ("offset", "2"), ("opts", '{"a": [1, true]}'), ("z", '"x"')), None,
     [("get_time", {"zone": "utc", "offset": 2, "opts": {"a": [1, True]}, "z": "x"})]),
    ("<tool_call>get_time</tool_call>", None, [("get_time", {})]),
    # content before and between calls (as hermes), two calls
    ("Let me see.\n" + _glm("get_time") + "\n" + _glm("get_weather", ("city", "Rome")), "Let me see.\n\n",
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("<tool_call>get_time<arg_key>zone</arg_key><arg_value>cet</arg_value></tool_call> ok", " ok",
     [("get_time", {"zone": "cet"})]),
    # malformed: content, tags and all
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</tool_call>",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</tool_call>", []),
    ("<tool_call>get_time\n<arg_key>a</arg_key><arg_value>1</arg_value> junk</tool_call>",
     "<tool_call>get_time\n<arg_key>a</arg_key><arg_value>1</arg_value> junk</tool_call>", []),
    ("<tool_call>get time\n</tool_call>", "<tool_call>get time\n</tool_call>", []),
    ('<tool_call>{"name": "get_time"}</tool_call>', '<tool_call>{"name": "get_time"}</tool_call>', []),
    ("a <tool_ca", "a <tool_ca", []),
]


@pytest.mark.parametrize("text, content, calls", GLM_CASES)
def test_glm45(text, content, calls):
    _check_parser("glm45", text, content, calls, tool_list=GLM_TOOLS)


@pytest.mark.parametrize("parser, text, calls", [
    ("mistral", 'Hi[INST] there</s>[TOOL_CALLS]get_time{}</s>', [("get_time", {})]),
    ("deepseek_v3", "Hi<｜User｜> there" + B + _v3("get_time", "{}") + E + "<｜end▁of▁sentence｜>",
     [("get_time", {})]),
    ("deepseek_v31", "Hi<｜User｜> there", []),
    ("glm45", "Hi<|user|> there<tool_call>get_time</tool_call><|user|>", [("get_time", {})]),
])
def test_special_tokens_are_taken_out_of_the_content(parser, text, calls):
    """With skip_special_tokens turned off for the parser, the tokenizer's other special tokens (serving.py gives them
    as `drop`) are left out of the content, as the default decode would; the parser's own start marker is not."""
    drop = ("</s>", "[INST]", "[TOOL_CALLS]", "<｜User｜>", "<｜end▁of▁sentence｜>", "<|user|>", "<tool_call>", CB)
    _check_parser(parser, text, "Hi there", calls, drop=drop)


@pytest.mark.parametrize("parser, text, first_marker", [
    ("mistral", '[TOOL_CALLS]get_time{"zone": "utc"}', "[TOOL_CALLS]"),
    ("deepseek_v3", B + _v3("get_time", '{"zone": "utc"}') + E, B),
    ("deepseek_v31", B + f'{CB}get_time{SEP}{{"zone": "utc"}}{CE}' + E, B),
    ("glm45", _glm("get_time", ("zone", "utc")), "<tool_call>"),
])
def test_auto_parsers_stream_content_first_and_hold_partial_markers(parser, text, first_marker):
    stream = tools.resolve(TOOLS, "auto", True, parser).stream()
    assert stream.feed("Sure, ", False) == ("Sure, ", [])
    assert stream.feed("checking " + first_marker[:3], False) == ("checking ", [])   # a marker may be starting
    last = text.rfind(CE) + len(CE) - 1 if CE in text else len(text) - 1   # the call's last character
    content, calls = stream.feed(first_marker[3:] + text[len(first_marker):last], False)
    assert content == "" and calls == []   # the call is not complete yet
    content, calls = stream.feed(text[last:], False)
    assert content == "" and [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_time")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "utc"}
    assert stream.feed(" ok", True) == (" ok", [])


def test_keeps_special_tokens():
    assert tools.resolve(TOOLS, "auto", True, "hermes").keeps_special_tokens is False
    for parser in ("mistral", "deepseek_v3", "deepseek_v31", "glm45"):
        assert tools.resolve(TOOLS, "auto", True, parser).keeps_special_tokens is True
        assert tools.resolve(TOOLS, "none", True, parser).keeps_special_tokens is False
        assert tools.resolve(TOOLS, "required", True, parser).keeps_special_tokens is False


PIECES = {   # pieces of each parser's format, and of special tokens, in any order: texts well and badly formed
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}', " ", "\n", "x", "<tool"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "get_time", '{"zone": "utc"}', '[{"name": "f", "arguments": {"a": 1}}]', "[",
                "{", "}", "]", " ", "\n", "x", '"', "</s>", "[INST]", "[TOOL"],
    "deepseek_v3": [B, E, CB, CE, SEP, "function", "get_time", "\n```json\n", '{"a": 1}', "\n```", " ", "\n", "x", "<｜",
                    "<｜end▁of▁sentence｜>"],
    "deepseek_v31": [B, E, CB, CE, SEP, "get_time", '{"a": 1}', " ", "\n", "x", "<｜", "<｜User｜>"],
    "glm45": ["<tool_call>", "</tool_call>", "get_time", "\n", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "a", "1", " ", "<|user|>", "<tool"],
}


WHOLE_CALLS = {   # and whole calls, so that many texts have some
    "hermes": ['<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>'],
    "mistral": ['[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}', '[TOOL_CALLS][{"name": "f", "arguments": {}}]'],
    "deepseek_v3": [B + _v3("get_time", "{}"), _v3("f", '{"a": 1}')],
    "deepseek_v31": [f"{CB}f{SEP}{{}}{CE}", f'{B}{CB}get_time{SEP}{{"a": 1}}{CE}'],
    "glm45": [_glm("get_time", ("a", "1")), "<tool_call>f</tool_call>"],
}


@pytest.mark.parametrize("parser", sorted(PIECES))
def test_random_texts_stream_as_the_whole(parser):
    """Texts strung from pieces of the format at random, fed whole and cut at random places, give the same content
    and calls (with and without special tokens to drop)."""
    import random

    rng = random.Random(parser)
    for trial in range(400):
        text = "".join(rng.choice(PIECES[parser] + WHOLE_CALLS[parser] * 3) for _ in range(rng.randint(0, 12)))
        mode = tools.resolve(TOOLS, "auto", True, parser)
        mode.drop = ("</s>", "[INST]", "<｜end▁of▁sentence｜>", "<｜User｜>", "<|user|>") if trial % 2 else ()
        content, calls, _ = mode.message(text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        stream, s_content, s_calls = mode.stream(), "", []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        for k, piece in enumerate(pieces):
            c, deltas = stream.feed(piece, k == len(pieces) - 1)
            s_content, s_calls = s_content + c, s_calls + deltas
        assert (s_content, _names_args(s_calls)) == (content or "", _names_args(calls)), (text, pieces)


LONG_CALLS = {   # one call whose arguments hold a long string (the %s)
    "hermes": '<tool_call>{"name": "f", "arguments": {"x": "%s"}}</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"x": "%s"}}]',
    "mistral NAME[ARGS]": '[TOOL_CALLS]f[ARGS]{"x": "%s"}',
    "deepseek_v3": B + _v3("f", '{"x": "%s"}') + E,
    "deepseek_v31": f'{B}{CB}f{SEP}{{"x": "%s"}}{CE}{E}',
    "glm45": _glm("f", ("x", "%s")),
    "required": '[{"name": "f", "parameters": {"x": "%s"}}]',   # tool_choice required's array (tools.py)
}


def _stream_long_call(case: str, repeats: int) -> float:
    """Seconds to stream one call whose argument is `repeats` copies of brackets and escapes, a character a
    delta; the call's arguments checked."""
    import time

    parser = case.split()[0]
    value = ("a{[" if parser == "glm45" else "a{[\\\"") * repeats   # brackets (and escapes: JSON) in the string
    text = LONG_CALLS[case] % value
    mode = tools.resolve(TOOLS, *(("required", True, None) if parser == "required" else ("auto", True, parser)))
    stream, calls, start = mode.stream(), [], time.perf_counter()
    for ch in text:
        calls += stream.feed(ch, False)[1]
    calls += stream.feed("", True)[1]
    elapsed = time.perf_counter() - start
    expected = value if parser == "glm45" else json.loads(f'"{value}"')
    assert [json.loads(c["function"]["arguments"])["x"] for c in calls] == [expected]
    return elapsed


@pytest.mark.parametrize("case", sorted(LONG_CALLS))
def test_long_call_streamed_a_character_at_a_time_stays_linear(case):
    """A call's block was searched (mistral, required: JSON-decoded) from its start at every delta: quadratic, a
    200 kB argument streamed a character at a time took tens of seconds. Each character is now looked at once, so
    4x the text takes ~4x the time (quadratic: ~16x). A ratio of the best of three runs at each size, not a time
    limit, so a slow or busy machine does not fail it."""
    small = min(_stream_long_call(case, 5_000) for _ in range(3))
    large = min(_stream_long_call(case, 20_000) for _ in range(3))
    assert large < 8 * small, f"4x the text took {large / small:.1f}x the time ({small:.3f} -> {large:.3f} s)"
