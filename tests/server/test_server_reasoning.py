"""--reasoning-parser over real HTTP with the openai client, on a tiny random checkpoint whose tokenizer has `<think>`
and `</think>` added: as Qwen3's (added tokens that are not special: skip_special_tokens keeps them) under qwen3, and
as special tokens under glm45 (the server turns skip_special_tokens off and takes the other special tokens out
itself). A Lark grammar with token references forces the random model to write a think block, then content, or a
tool call; the prompt closes the think block (enable_thinking false), so the grammar holds from the first token. The
reply's `reasoning` and `reasoning_content` carry the thinking, the content the rest; streamed deltas add up to the
message. Structured outputs wait for the end of the reasoning when the prompt leaves the think block open."""
from __future__ import annotations

import json
from typing import Optional

import httpx
import pytest

from server_utils import MODEL_NAME, Rx, ServerThread, Tok, assert_openai_error, make_engine, token_grammar
from tiny_models import make_tiny_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

MAX_LEN = 1024
THINK, END = "<think>", "</think>"
JUNK = "<|junk|>"   # a special token that is no marker: skip_special_tokens leaves it out, so does the parser
EOS = "<|endoftext|>"
# Qwen3's generation prompt: enable_thinking false closes an empty think block; think_in_prompt (Qwen3-Thinking-2507's
# template) opens one; else the model opens its own
TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
            "{%- elif think_in_prompt is defined and think_in_prompt %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")
MESSAGES = [{"role": "user", "content": "2 + 2?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}]
# required's constraint: compact JSON (x-guidance), one value: a random model cannot wander
CLOCK = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc"]}}, "required": ["zone"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}]


def _checkpoint(path, special: Optional[bool]):
    """The tiny checkpoint with TEMPLATE and JUNK; `<think>`, `</think>` added as special tokens (True), as Qwen3's
    added tokens that are not special (False), or not at all (None: `</think>` is several tokens)."""
    from transformers import AutoTokenizer

    make_tiny_checkpoint("qwen3_moe", path, max_position_embeddings=MAX_LEN)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if special is False:
        tokenizer.add_tokens([THINK, END])
    tokenizer.add_special_tokens({"additional_special_tokens": [THINK, END, JUNK] if special else [JUNK]})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[("qwen3", False), ("glm45", True)], ids=["qwen3", "glm45-special"])
def served(request, tmp_path_factory):
    """(the parser, its server, an openai client on it): markers as special tokens or not."""
    parser, special = request.param
    engine = make_engine(_checkpoint(tmp_path_factory.mktemp(f"tiny_reasoning_{parser}"), special),
                         max_model_len=MAX_LEN)
    with ServerThread(engine, reasoning_parser=parser, enable_auto_tool_choice=True, tool_call_parser="hermes") as s:
        yield parser, s, openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0)


def _create(client, tokenizer, parts, **kw):
    extra = {"structured_outputs": {"grammar": token_grammar([*parts, Tok(EOS)], tokenizer)}, **NO_THINKING,
             **kw.pop("extra_body", {})}
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, extra_body=extra, **kw)


def _reasoning(message_or_delta):
    extra = message_or_delta.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")   # both names, the same text
    return extra.get("reasoning")


def _accumulate(chunks):
    """(reasoning, content, the openai client's accumulated choice) of a stream."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, reasoning, content = ChatCompletionStreamState(), "", ""
    for chunk in chunks:
        state.handle_chunk(chunk)
        if chunk.choices:
            reasoning += _reasoning(chunk.choices[0].delta) or ""
            content += chunk.choices[0].delta.content or ""
    return reasoning, content, state.get_final_completion().choices[0]


THOUGHT = [Tok(THINK), "\nHm, ", Rx("[a-z]{2,6}"), Tok(JUNK), " ok.\n", Tok(END)]


@pytest.mark.parametrize("seed", [0, 1])
def test_reasoning_then_content(served, seed):
    _, server, client = served
    tokenizer = server.engine.tokenizer
    parts = [*THOUGHT, "\n\nIt is ", Tok(JUNK), Rx("[0-9]{1,2}"), "."]
    whole = _create(client, tokenizer, parts, seed=seed).choices[0]
    thought = _reasoning(whole.message)
    assert thought.startswith("\nHm, ") and thought.endswith(" ok.\n") and JUNK not in thought, thought
    assert whole.message.content.startswith("\n\nIt is ") and whole.message.content.endswith("."), whole.message
    assert whole.finish_reason == "stop" and not whole.message.tool_calls
    chunks = list(_create(client, tokenizer, parts, seed=seed, stream=True))
    reasoning, content, streamed = _accumulate(chunks)
    assert (reasoning, content) == (thought, whole.message.content)
    first_content = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content)
    assert any(_reasoning(c.choices[0].delta) for c in chunks[:first_content] if c.choices)   # reasoning first
    assert streamed.finish_reason == "stop"


def test_cut_off_reasoning_has_no_content(served):
    _, server, client = served
    r = _create(client, server.engine.tokenizer, [Tok(THINK), Rx("[a-z ]{30,40}")], max_tokens=8).choices[0]
    assert r.finish_reason == "length" and r.message.content is None and _reasoning(r.message)


def test_no_think_block_is_all_content(served):
    _, server, client = served
    r = _create(client, server.engine.tokenizer, ["Four."]).choices[0]
    assert r.message.content == "Four." and _reasoning(r.message) is None


def test_include_reasoning_false(served):
    _, server, client = served
    r = _create(client, server.engine.tokenizer, [*THOUGHT, "Four."], extra_body={"include_reasoning": False})
    assert r.choices[0].message.content == "Four." and _reasoning(r.choices[0].message) is None


@pytest.mark.parametrize("seed", [0, 1])
def test_tool_call_after_the_reasoning(served, seed):
    """Tools (auto, hermes) parse the content only: a call in the think block is reasoning, the one after is a call."""
    _, server, client = served
    tokenizer = server.engine.tokenizer
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    parts = [Tok(THINK), "Maybe " + call + " then.", Tok(END), "\n", call]
    whole = _create(client, tokenizer, parts, tools=TOOLS, seed=seed).choices[0]
    assert _reasoning(whole.message) == "Maybe " + call + " then."
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_time", {"zone": "utc"})]
    reasoning, content, streamed = _accumulate(_create(client, tokenizer, parts, tools=TOOLS, seed=seed, stream=True))
    assert (reasoning, content) == (_reasoning(whole.message), "")
    assert [c.function.name for c in streamed.message.tool_calls] == ["get_time"]
    assert streamed.finish_reason == "tool_calls"


def _gated(client, tokenizer, kwargs: dict, seed: int, **extra):
    """A choice constraint, a think-block-free random model pushed (logit_bias) to write x's, then </think>."""
    x = tokenizer.encode("x", add_special_tokens=False)
    assert len(x) == 1
    bias = {str(x[0]): 100, str(tokenizer.convert_tokens_to_ids(END)): 100}
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=1.0, seed=seed, logit_bias=bias,
        extra_body={"chat_template_kwargs": kwargs, **extra}).choices[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_structured_outputs_start_after_the_reasoning(served, seed):
    """The prompt opens the think block: the constraint waits for </think> (the x's and </think> are free), then
    holds; with it from the first token (as without the gating) neither could be written, and all would be reasoning."""
    _, server, client = served
    r = _gated(client, server.engine.tokenizer, {"think_in_prompt": True}, seed,
               structured_outputs={"choice": ["yes", "no"]})
    assert r.message.content in ("yes", "no") and r.finish_reason == "stop", r.message
    assert _reasoning(r.message) in (None, *("x" * k for k in range(1, 64)))
    required = _gated(client, server.engine.tokenizer, {"think_in_prompt": True}, seed, tools=CLOCK,
                      tool_choice="required")
    calls = {(c.function.name, c.function.arguments) for c in required.message.tool_calls}
    assert calls == {("get_time", '{"zone": "utc"}')}, required.message   # (the array may go on to max_tokens)
    assert _reasoning(required.message) in (None, *("x" * k for k in range(1, 64)))


def test_a_closed_think_block_constrains_from_the_first_token(served):
    _, server, client = served
    r = _gated(client, server.engine.tokenizer, {"enable_thinking": False}, 0,
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}})
    assert json.loads(r.message.content) in ("yes", "no") and _reasoning(r.message) is None


def test_end_marker_of_several_tokens_refuses_a_waiting_constraint(tmp_path):
    """The gate needs </think> as one token id: a tokenizer without it refuses the combination (400), and serves the
    request unconstrained or with the think block closed in the prompt."""
    with ServerThread(make_engine(_checkpoint(tmp_path, None), max_model_len=MAX_LEN),
                      reasoning_parser="deepseek_r1") as s:
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4}
        for extra, param in [({"response_format": {"type": "json_object"}}, "response_format"),
                             ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs")]:
            resp = httpx.post(s.base_url + "/v1/chat/completions", json={**body, **extra}, timeout=30)
            err = assert_openai_error(resp, 400)
            assert err["param"] == param and "</think>" in err["message"] and "tokens, not one" in err["message"]
        assert httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_without_a_reasoning_parser_the_message_is_unchanged(tmp_path):
    with ServerThread(make_engine(_checkpoint(tmp_path, False), max_model_len=MAX_LEN)) as s:
        message = httpx.post(s.base_url + "/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4}, timeout=30).json()["choices"][0]["message"]
    assert "reasoning" not in message and "reasoning_content" not in message


def test_server_refuses_an_unknown_parser(tmp_path):
    make_tiny_checkpoint("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match="known: deepseek_r1, deepseek_v3, glm45, qwen3$"):
        ServerThread(make_engine(tmp_path), reasoning_parser="granite")


def test_a_think_marker_in_the_users_message_does_not_open_a_block(served):
    """The user's own "<think>" was taken for the template's (the prompt's last <think> had no </think> after it):
    the whole answer became reasoning, the content null."""
    _, server, client = served
    x = server.engine.tokenizer.encode("x", add_special_tokens=False)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"What does {THINK} do?"}], max_tokens=4,
        temperature=0.0, logit_bias={str(x[0]): 100}).choices[0]
    assert (r.message.content, _reasoning(r.message)) == ("xxxx", None)
