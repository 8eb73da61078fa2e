"""Reasoning parsers on /v1/chat/completions, as vLLM's `--reasoning-parser`: the thinking a model writes between
`<think>` and `</think>` goes to the message's `reasoning` field (vLLM 0.11+'s name) and to `reasoning_content` (its
older name, which many clients still read), the same text in both; the rest is the `content`.

The parsers (vLLM's names):
  - qwen3 (Qwen3, also Qwen3-Thinking-2507 / Qwen3.5 templates that open the block in the prompt), glm45 (GLM-4.5,
    GLM-4.6): the output is in reasoning when it starts with `<think>` (dropped, with any whitespace before it:
    GLM-4.5 writes `\\n<think>`) or when the prompt leaves a think block open (its last `<think>` has no `</think>`
    after it; only the prompt after the last message the model did not write counts: a user's `<think>` or an
    earlier turn's block is not the template's); then the text up to `</think>` is reasoning and the rest content,
    and without `</think>` all of it is reasoning (cut off). Otherwise the whole output is content
    (e.g. chat_template_kwargs {"enable_thinking": false}, whose template closes an empty block in the prompt);
  - deepseek_r1 (DeepSeek-R1: the template ends the prompt with `<think>\\n`): the output starts in reasoning (a
    leading `<think>` dropped); the text up to `</think>` is reasoning, the rest content; no `</think>`: all reasoning;
  - deepseek_v3 (DeepSeek-V3.1): as deepseek_r1 when chat_template_kwargs has "thinking": true, else all content.
Whitespace is kept as the model wrote it (vLLM strips none either): Qwen3's "<think>\\nR\\n</think>\\n\\nC" gives
reasoning "\\nR\\n" and content "\\n\\nC". An empty reasoning is null; so is the content when the output stops at
`</think>`.

Each choice's text goes through one `ReasoningStream`: `feed(text delta, finished)` -> (reasoning delta, content
delta), a possible start of `</think>` held back; the non-streamed message is the same stream fed the whole text at
once, so the deltas add up to the message. The content deltas go on to the tool parser (tools.py) when the request
has tools: calls are parsed from the content only, as vLLM does.

Structured outputs (response_format, structured_outputs, a named or required tool_choice) apply after the reasoning,
as in vLLM: where the output starts in a think block the prompt leaves open or may open one itself, the request
carries `</think>`'s token id (SamplingParams.reasoning_end_token_id) and the engine's matcher waits for it
(engine/structured.py). A prompt that closes the think block already (enable_thinking false) is constrained from the
first token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedmoe.server.tool_parsers import markers_of

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    models: str
    opens_in_prompt: bool = False           # the template always ends the prompt inside a think block (DeepSeek-R1)
    thinking_kwarg: Optional[str] = None    # reasoning only when chat_template_kwargs[this] is true (DeepSeek-V3.1)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("Qwen3"),
    "glm45": ReasoningParser("GLM-4.5, GLM-4.6"),
    "deepseek_r1": ReasoningParser("DeepSeek-R1", opens_in_prompt=True),
    "deepseek_v3": ReasoningParser("DeepSeek-V3.1", opens_in_prompt=True, thinking_kwarg="thinking"),
}


def check_reasoning_parser(name: Optional[str]) -> Optional[str]:
    """The server's --reasoning-parser (None: none); a one-line ValueError for an unknown name."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not a known reasoning parser; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return name


def _after_last_think(prompt: str) -> Optional[str]:
    at = prompt.rfind(THINK)
    return None if at < 0 else prompt[at + len(THINK):]


def prompt_opens_think(prompt: str) -> bool:
    """Whether the prompt ends inside a think block: its last `<think>` has no `</think>` after it."""
    after = _after_last_think(prompt)
    return after is not None and END_THINK not in after


def prompt_closes_think(prompt: str) -> bool:
    """Whether the prompt's last think block is closed already (an empty one: enable_thinking false)."""
    after = _after_last_think(prompt)
    return after is not None and END_THINK in after


@dataclass
class ReasoningMode:
    """One request's reasoning parsing (made by `resolve`)."""

    thinks: bool                  # the output may hold reasoning (deepseek_v3: only with "thinking": true)
    opened: bool                  # the output starts in reasoning (else only a leading <think> opens it)
    constraint_waits: bool        # a structured outputs constraint starts after </think> (the prompt does not close it)
    include: bool = True          # include_reasoning (vLLM's request field): false leaves the reasoning out
    drop: tuple[str, ...] = ()    # special tokens taken out (serving.py: skip_special_tokens turned off for markers)
    drop_in_content: bool = True  # false: the tool parser that takes the content takes them out of it itself

    def keeps_special_tokens(self, special_tokens: tuple[str, ...]) -> bool:
        """Whether the output needs its special tokens (skip_special_tokens off): the markers are special tokens of the
        tokenizer, which skip_special_tokens would leave out, and the request may reason."""
        return self.thinks and (THINK in special_tokens or END_THINK in special_tokens)

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)

    def message(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """Non-streamed: (reasoning or None, content) of a finished output; the content is None when the output
        reasoned and wrote nothing after."""
        stream = self.stream()
        reasoning, content = stream.feed(text, True)
        return reasoning or None, content or (None if stream.reasoned else content)


def fields(reasoning: Optional[str]) -> dict:
    """The message's (or a delta's) reasoning fields: vLLM 0.11+'s `reasoning` and the older `reasoning_content`."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def after_input(prompt: str, last_input: Optional[str]) -> str:
    """The prompt after the text of its last message the model did not write (user, system, tool), where the
    template found it: the think markers that tell whether the output starts in a block are the template's (and a
    continued assistant message's), not ones a user typed or an earlier turn's reasoning. Not found: the prompt."""
    needle, end = (last_input or "").strip(), len(prompt)
    while needle and (at := prompt.rfind(needle, 0, end)) >= 0:
        stop = at + len(needle)
        if not any(_cuts(prompt, edge, marker) for edge in (at, stop) for marker in (THINK, END_THINK)):
            return prompt[stop:]
        end = stop - 1   # found inside a marker of the template's ("hi" in "<think>"): an earlier one
    return prompt


def _cuts(text: str, at: int, marker: str) -> bool:
    """Whether `at` falls strictly inside an occurrence of `marker` in `text`."""
    found = text.find(marker, max(0, at - len(marker) + 1), at + len(marker) - 1)
    return 0 <= found < at


def resolve(parser: Optional[str], prompt: str, template_kwargs: Optional[dict],
            include: bool = True, last_input: Optional[str] = None) -> Optional[ReasoningMode]:
    """The request's reasoning mode under the server's --reasoning-parser (None without one). last_input: the text
    of the last message that is not the assistant's (after_input)."""
    if parser is None:
        return None
    prompt = after_input(prompt, last_input)
    spec = REASONING_PARSERS[parser]
    thinks = spec.thinking_kwarg is None or bool((template_kwargs or {}).get(spec.thinking_kwarg))
    opened = spec.opens_in_prompt or prompt_opens_think(prompt)
    return ReasoningMode(thinks, opened, thinks and not prompt_closes_think(prompt), include)


class ReasoningStream:
    """One choice's text -> (reasoning delta, content delta). `reasoned`: whether a think block was found."""

    def __init__(self, mode: ReasoningMode) -> None:
        self.mode = mode
        self.state = "start" if mode.thinks else "content"
        self.reasoned = False
        self.buf, self.lead = "", 0   # lead: the whitespace at the start of the output, while it may precede <think>
        self.in_reasoning = markers_of((END_THINK, *mode.drop))
        self.in_content = markers_of(mode.drop) if mode.drop and mode.drop_in_content else None

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            while self.lead < len(self.buf) and self.buf[self.lead].isspace():   # each character looked at once
                self.lead += 1
            head = self.buf[self.lead:]   # whitespace before <think> is dropped with it (GLM-4.5 writes "\n<think>")
            if head.startswith(THINK):
                self.buf, self.state = head[len(THINK):], "reasoning"
            elif THINK.startswith(head) and not finished:
                return "", ""   # the output may be starting with <think>
            else:
                self.state = "reasoning" if self.mode.opened else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            reasoning, ended = self._scan(self.in_reasoning, finished, END_THINK)
            if ended:
                self.state = "content"
        if self.state == "content":
            content = self._scan(self.in_content, finished, None)[0]
        return (reasoning if self.mode.include else ""), content

    def _scan(self, markers, finished: bool, end: Optional[str]) -> tuple[str, bool]:
        """The buffer's text up to `end` (True: found, the buffer left after it) or up to a possible start of a
        marker; the `drop` strings taken out."""
        if markers is None:
            out, self.buf = self.buf, ""
            return out, False
        out = ""
        while True:
            before, marker, self.buf = markers.split(self.buf, finished)
            out += before
            if marker is None:
                return out, False
            if marker == end:
                return out, True
