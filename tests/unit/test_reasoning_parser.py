"""server/reasoning.py without a server: each --reasoning-parser on crafted outputs (whole and streamed in pieces of
every size give the same), its prompts (a think block the template opens, closes or leaves out), texts strung at
random from the markers' pieces cut at random places, special tokens taken out, the chain into a tool parser, the
flag's check."""
from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("fastapi")  # server/tools.py builds the server's 400s

from pagedmoe.server import reasoning, tools  # noqa: E402

# the generation prompts' ends, as the families' templates write them
PLAIN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"   # Qwen3 (up to 2507): the model opens the block
NO_THINKING = PLAIN + "<think>\n\n</think>\n\n"                       # Qwen3, enable_thinking false
OPEN = PLAIN + "<think>\n"                                            # Qwen3-Thinking-2507 / Qwen3.5: opened there
R1 = "<｜User｜>hi<｜Assistant｜><think>\n"                               # DeepSeek-R1
V31_THINKING, V31 = "<｜User｜>hi<｜Assistant｜><think>", "<｜User｜>hi<｜Assistant｜></think>"   # V3.1


def _streamed(mode, text: str, pieces: list[str]):
    stream, thought, content = mode.stream(), "", ""
    for k, piece in enumerate(pieces):
        r, c = stream.feed(piece, k == len(pieces) - 1)
        thought, content = thought + r, content + c
    return thought, content


def _check(mode, text: str, thought, content):
    """The whole text gives (thought, content); fed in pieces of any size the deltas add up to the same."""
    assert mode.message(text) == (thought, content)
    for size in (1, 2, 3, 5, 7, len(text) + 1):
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        assert _streamed(mode, text, pieces) == (thought or "", content or ""), size


QWEN3_CASES = [
    # prompt, output, reasoning, content
    (PLAIN, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),   # whitespace kept
    (PLAIN, "<think>\nstill thinking", "\nstill thinking", None),                        # cut off: all reasoning
    (PLAIN, "<think>R</think>", "R", None),                                              # nothing after: content null
    (PLAIN, "<think></think>C", None, "C"),                                              # empty reasoning: null
    (PLAIN, "Just an answer.", None, "Just an answer."),                                 # no think block: all content
    (PLAIN, "a</think>b <think>c", None, "a</think>b <think>c"),                         # markers not leading: text
    (PLAIN, "<thin", None, "<thin"),                                                     # a partial marker at the end
    (PLAIN, "", None, ""),
    (PLAIN, "<think>a<think>b</think>c</think>d", "a<think>b", "c</think>d"),            # the first </think> ends it
    (NO_THINKING, "The answer.", None, "The answer."),                                   # enable_thinking false
    (OPEN, "Let me see.\n</think>\n\nIt is 4.", "Let me see.\n", "\n\nIt is 4."),         # <think> in the prompt
    (OPEN, "<think>R</think>C", "R", "C"),
    (OPEN, "thinking, cut off", "thinking, cut off", None),
    (OPEN, "", None, None),
    # whitespace before the block: dropped with <think> (GLM-4.5's template writes "<|assistant|>\n<think>", so its
    # model starts with "\n"); kept where no <think> follows
    (PLAIN, "\n<think>R</think>\nC", "R", "\nC"),
    (PLAIN, " \n\n<think>cut off", "cut off", None),
    (PLAIN, "\n\nC", None, "\n\nC"),
    (PLAIN, "\n \n", None, "\n \n"),
    (OPEN, "\nR</think>C", "\nR", "C"),
]


@pytest.mark.parametrize("parser", ["qwen3", "glm45"])
@pytest.mark.parametrize("prompt, text, thought, content", QWEN3_CASES)
def test_qwen3_and_glm45(parser, prompt, text, thought, content):
    _check(reasoning.resolve(parser, prompt, None), text, thought, content)


DEEPSEEK_R1_CASES = [
    ("Okay, 2 + 2.\n</think>\n\n4", "Okay, 2 + 2.\n", "\n\n4"),
    ("<think>\nOkay.</think>4", "\nOkay.", "4"),      # a <think> the model writes itself is dropped
    ("no end yet", "no end yet", None),               # without </think>: all reasoning
    ("</think>only content", None, "only content"),
    ("R</think>", "R", None),
    ("", None, None),
]


@pytest.mark.parametrize("text, thought, content", DEEPSEEK_R1_CASES)
def test_deepseek_r1(text, thought, content):
    _check(reasoning.resolve("deepseek_r1", R1, None), text, thought, content)
    _check(reasoning.resolve("deepseek_r1", PLAIN, None), text, thought, content)   # whatever the prompt
    _check(reasoning.resolve("deepseek_v3", V31_THINKING, {"thinking": True}), text, thought, content)


@pytest.mark.parametrize("kwargs", [None, {}, {"thinking": False}, {"enable_thinking": True}])
def test_deepseek_v3_without_thinking_is_all_content(kwargs):
    mode = reasoning.resolve("deepseek_v3", V31, kwargs)
    for text, *_ in DEEPSEEK_R1_CASES:
        _check(mode, text, None, text)
    assert not mode.constraint_waits


@pytest.mark.parametrize("parser, prompt, kwargs, waits", [
    ("qwen3", PLAIN, None, True),           # the model may open a block: the constraint waits for </think>
    ("qwen3", OPEN, None, True),
    ("qwen3", NO_THINKING, {"enable_thinking": False}, False),   # closed in the prompt: from the first token
    ("glm45", NO_THINKING, None, False),
    ("deepseek_r1", R1, None, True),
    ("deepseek_v3", V31_THINKING, {"thinking": True}, True),
    ("deepseek_v3", V31, None, False),
])
def test_when_the_constraint_waits(parser, prompt, kwargs, waits):
    assert reasoning.resolve(parser, prompt, kwargs).constraint_waits is waits


def test_no_parser_no_mode():
    assert reasoning.resolve(None, OPEN, None) is None


def test_streams_reasoning_then_content_and_holds_partial_markers():
    stream = reasoning.resolve("qwen3", PLAIN, None).stream()
    assert stream.feed("<th", False) == ("", "")            # may be <think>: held
    assert stream.feed("ink>\nHm", False) == ("\nHm", "")
    assert stream.feed(", ok.</th", False) == (", ok.", "")  # may be </think>: held
    assert stream.feed("ink>\n\nFour", False) == ("", "\n\nFour")
    assert stream.feed(" </think>", True) == ("", " </think>")   # after the block: text
    stream = reasoning.resolve("qwen3", PLAIN, None).stream()
    assert stream.feed("<tx", False) == ("", "<tx")          # not <think>: content at once


def test_include_reasoning_false_leaves_it_out():
    mode = reasoning.resolve("qwen3", PLAIN, None, include=False)
    _check(mode, "<think>R</think>C", None, "C")
    _check(mode, "<think>cut off", None, None)


SPECIAL = ("<|im_end|>", "<|endoftext|>", "<think>", "</think>")


def test_special_tokens_taken_out_where_skip_special_tokens_was_turned_off():
    """Markers that are special tokens turn skip_special_tokens off (serving.py); the tokenizer's other special tokens
    (`drop`) are then taken out of the reasoning and, unless a tool parser takes the content, of the content."""
    mode = reasoning.resolve("glm45", PLAIN, None)
    assert mode.keeps_special_tokens(SPECIAL) and not mode.keeps_special_tokens(("<|im_end|>",))
    assert not reasoning.resolve("deepseek_v3", V31, None).keeps_special_tokens(SPECIAL)   # it cannot reason
    mode.drop = SPECIAL
    _check(mode, "<think>a<|im_end|>b</think>c<|endoftext|>d</think>", "ab", "cd")
    mode.drop_in_content = False   # a tool parser after this one drops them from the content itself
    _check(mode, "<think>a<|im_end|>b</think>c<|endoftext|>d", "ab", "c<|endoftext|>d")


PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think", ">", "\n", " ", "x", "<", "<|im_end|>", "<|im"]


@pytest.mark.parametrize("parser, prompt, kwargs", [
    ("qwen3", PLAIN, None), ("qwen3", OPEN, None), ("qwen3", NO_THINKING, None), ("glm45", PLAIN, None),
    ("deepseek_r1", R1, None), ("deepseek_v3", V31_THINKING, {"thinking": True}), ("deepseek_v3", V31, None)])
def test_random_texts_stream_as_the_whole(parser, prompt, kwargs):
    """Texts strung from the markers' pieces at random, fed whole and cut at random places, give the same reasoning
    and content (with and without special tokens to drop)."""
    rng = random.Random(parser + prompt)
    for trial in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        mode = reasoning.resolve(parser, prompt, kwargs)
        if trial % 2:
            mode.drop, mode.drop_in_content = ("<|im_end|>",), trial % 4 == 1
        thought, content = mode.message(text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _streamed(mode, text, pieces) == (thought or "", content or ""), (text, pieces)


def _chained(mode, tool_mode, pieces: list[str]):
    """serving.py's chain: the reasoning parser first, its content deltas into the tool parser."""
    thinking, calls_stream = mode.stream(), tool_mode.stream()
    thought, content, calls = "", "", []
    for k, piece in enumerate(pieces):
        r, c = thinking.feed(piece, k == len(pieces) - 1)
        c, deltas = calls_stream.feed(c, k == len(pieces) - 1)
        thought, content, calls = thought + r, content + c, calls + deltas
    return thought, content, [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in calls]


TOOLS = [{"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("text, thought, content, calls", [
    ('<think>I need the time.</think>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
     "I need the time.", "", [("get_time", {"zone": "utc"})]),
    # a call written while reasoning is reasoning, not a call
    ('<think><tool_call>{"name": "get_time", "arguments": {}}</tool_call></think>No call.', '<tool_call>{"name": '
     '"get_time", "arguments": {}}</tool_call>', "No call.", []),
])
def test_tool_calls_come_from_the_content_only(text, thought, content, calls):
    mode, tool_mode = reasoning.resolve("qwen3", PLAIN, None), tools.resolve(TOOLS, "auto", True, "hermes")
    for size in (1, 3, 8, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert _chained(mode, tool_mode, pieces) == (thought, content, calls), size


def test_check_reasoning_parser():
    assert reasoning.check_reasoning_parser(None) is None
    for name in ("qwen3", "deepseek_r1", "deepseek_v3", "glm45"):
        assert reasoning.check_reasoning_parser(name) == name
    with pytest.raises(ValueError, match="^--reasoning-parser 'granite' is not a known reasoning parser; known: "
                                         "deepseek_r1, deepseek_v3, glm45, qwen3$"):
        reasoning.check_reasoning_parser("granite")


def test_think_markers_a_user_typed_or_an_earlier_turn_wrote_do_not_count():
    """Only the prompt after the last message the model did not write tells whether the output starts in a think
    block: a user's "<think>" made the whole answer reasoning (content null), and an earlier turn's closed block
    (kept in a tool loop) made a constraint start at the first token although the model thinks again."""
    asks = "What does <think> do?"
    prompt = f"<|im_start|>user\n{asks}<|im_end|>\n<|im_start|>assistant\n"
    _check(reasoning.resolve("qwen3", prompt, None, last_input=asks), "It opens a block.", None, "It opens a block.")
    result = "<tool_response>\n12 C\n</tool_response>"
    loop = (PLAIN + "<think>\nR\n</think>\n\n<tool_call>{}</tool_call><|im_end|>\n"
            f"<|im_start|>user\n{result}<|im_end|>\n<|im_start|>assistant\n")
    assert reasoning.resolve("qwen3", loop, None, last_input="12 C").constraint_waits
    # the template's own markers after it still count: opened, closed (enable_thinking false), a continued message
    assert reasoning.resolve("qwen3", OPEN, None, last_input="hi").opened
    assert not reasoning.resolve("qwen3", NO_THINKING, None, last_input="hi").constraint_waits
    _check(reasoning.resolve("qwen3", PLAIN + "<think>\nSo far", None, last_input="hi"), " more</think>C",
           " more", "C")
