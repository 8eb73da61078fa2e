"""The output side of tool calling (tools.py): `CallStream`, one choice's text -> (content delta, tool call deltas
in OpenAI's stream format), and the parsers of tool_choice "auto" (`--tool-call-parser`, vLLM's names), each a
`MarkedCalls`: calls are blocks between the model's markers in free text.
  hermes        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes)
  mistral       `[TOOL_CALLS][{"name": ..., "arguments": ...}]` or `[TOOL_CALLS]NAME[ARGS]{...}` (Mistral, Mixtral)
  deepseek_v3   `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json ...```<｜tool▁call▁end｜>...`
  deepseek_v31  `... <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜> ...` (DeepSeek-V3.1)
  glm45         `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...</tool_call>` (GLM-4.5, GLM-4.6)
For all but hermes the markers are special tokens: the request's skip_special_tokens is turned off (vLLM's) and the
tokenizer's other special tokens are taken out of the content instead (`drop`, serving.py). `Markers` (the marker
scan that holds back a marker's possible start while streaming) serves the reasoning parsers too (reasoning.py).
"""
from __future__ import annotations

import functools
import json
import re
import secrets
import string
import uuid
from typing import Any, Optional, Sequence

def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_mistral_tool_call_id() -> str:
    """The mistral parser's (vLLM's): 9 letters and digits, the only ids Mistral's templates take."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def full_call(index: int, name: str, arguments: str, call_id: Optional[str] = None) -> dict:
    return {"index": index, "id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class CallStream:
    """One choice's text -> (content delta, tool call deltas). `calls`: how many calls were emitted."""

    calls = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        raise NotImplementedError

    @property
    def content_when_empty(self) -> Optional[str]:
        return None


class Markers:
    """Finds the first of some marker strings in a text (the longest where several start at one place), and how much
    of a text's end may be the start of one (held back while streaming: the marker may be arriving). Shared by the
    tool parsers and the reasoning parsers (reasoning.py)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        markers = sorted({m for m in markers if m}, key=len, reverse=True)
        self.regex = re.compile("|".join(map(re.escape, markers)))
        self.prefixes = {m[:k] for m in markers for k in range(1, len(m))}
        self.longest = len(markers[0])

    def partial_suffix(self, text: str) -> int:
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            if text[-k:] in self.prefixes:
                return k
        return 0

    def split(self, text: str, finished: bool) -> tuple[str, Optional[str], str]:
        """(the text before the first marker, that marker, the text after it); with no marker: (the text that cannot
        be the start of one, None, the end held back: empty when `finished`)."""
        match = self.regex.search(text)
        if match is not None:
            return text[:match.start()], match.group(), text[match.end():]
        keep = 0 if finished else self.partial_suffix(text)
        return text[:len(text) - keep], None, text[len(text) - keep:]


@functools.lru_cache(maxsize=32)
def markers_of(markers: tuple[str, ...]) -> Markers:
    return Markers(markers)   # made once per parser and tokenizer: a tokenizer may have ~1000 special tokens


_NAME = re.compile(r"[^\s<>\[\]{}\"']+")   # a function name written bare (not in JSON): no spaces, quotes, brackets
_decoder = json.JSONDecoder()


def _arguments(args: Any) -> Optional[str]:
    """A call's arguments as the message carries them: an object re-serialized, JSON text kept as sent."""
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _json_object(text: str) -> Optional[dict]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):   # RecursionError: nested deeper than Python's stack
        return None
    return value if isinstance(value, dict) else None


class ValueEnd:
    """Where a JSON array or object that starts at `start` of a growing text closes: its brackets are counted as the
    text arrives, each character looked at once (outside strings), so that a value streamed in small deltas is
    decoded once it closes, not at every delta (quadratic in its length)."""

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.depth, self.in_string, self.escaped = start, start, 0, False, False
        self.end: Optional[int] = None

    def find(self, text: str) -> Optional[int]:
        """The index after the closing bracket, or None while the value is not closed yet."""
        while self.end is None and self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.end


Calls = Optional[list[tuple[str, str]]]   # what a block's body holds: (name, arguments) each; None: not calls


class MarkedCalls(CallStream):
    """The auto parsers' stream: calls are blocks that open with the START marker and end with END (or where
    _block_end says), any number, anywhere in the text (an unclosed block at the end counts). A block whose body does
    not parse stays in the content, markers and all; the text around the blocks is the content. SECTION: markers
    around a run of blocks (DeepSeek's), taken out, with the whitespace between the blocks. `drop`: other strings
    taken out of the content (the tokenizer's special tokens when the parser has them kept: serving.py).
    Streamed: content until a marker may be starting (its possible start held back), each call whole once its block
    closes. Content that is only whitespace is held back until more content follows, and dropped if a call was found
    (the message's content is then null), so the stream adds up to the message."""

    START: str = ""
    END: Optional[str] = None
    SECTION: Optional[tuple[str, str]] = None
    keeps_special_tokens = False   # True: its markers are special tokens, which skip_special_tokens would drop

    def __init__(self, tools: Sequence[dict] = (), drop: Sequence[str] = ()) -> None:
        self.tools = tools
        self.markers = markers_of((self.START, *(self.SECTION or ()), *(d for d in drop if d != self.START)))
        self.buf, self.in_call, self.in_section = "", False, False
        self.pending_ws, self.sent_content = "", False
        self.scanned = 0   # how much of an open block's text _block_end has searched already (streaming stays linear)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        self.buf += text
        content, calls = "", []
        while True:
            if self.in_call:
                end = self._block_end(self.buf)
                if end is None and not finished:
                    break
                body_end, block_end = end if end is not None else (len(self.buf), len(self.buf))
                found = self._parse(self.buf[:body_end])
                if found is None:
                    content += self.START + self.buf[:block_end]
                for name, arguments in found or ():
                    calls.append(full_call(self.calls, name, arguments, self.new_id()))
                    self.calls += 1
                self.buf, self.in_call = self.buf[block_end:], False
                continue
            before, marker, rest = self.markers.split(self.buf, finished)
            if marker is None and self.in_section and not finished:
                break   # text between blocks waits for the next marker: content unless only whitespace
            content += self._outside(before)
            self.buf = rest
            if marker is None:
                break
            if marker == self.START:
                self.in_call = True
                self._open_block()
            elif self.SECTION is not None and marker in self.SECTION:
                self.in_section = marker == self.SECTION[0]
            # else a string of `drop`: taken out
        return self._content(content, finished), calls

    def _outside(self, text: str) -> str:
        return "" if self.in_section and not text.strip() else text

    def _open_block(self) -> None:
        self.scanned = 0

    def _block_end(self, buf: str) -> Optional[tuple[int, int]]:
        """(where the body ends, where the block ends) in `buf`, the text after START; None while it may go on.
        Searches only the text not searched by earlier calls (and END's possible start before it)."""
        at = buf.find(self.END, self.scanned)
        if at < 0:
            self.scanned = max(0, len(buf) - len(self.END) + 1)
            return None
        return at, at + len(self.END)

    def _parse(self, body: str) -> Calls:
        raise NotImplementedError

    @staticmethod
    def new_id() -> str:
        return make_tool_call_id()

    def _content(self, content: str, finished: bool) -> str:
        if content.strip():
            out, self.pending_ws, self.sent_content = self.pending_ws + content, "", True
            return out
        self.pending_ws += content
        if finished and (self.sent_content or not self.calls):
            out, self.pending_ws = self.pending_ws, ""
            return out
        return ""


class HermesCalls(MarkedCalls):
    """vLLM's hermes parser's format (Qwen2.5, Qwen3, Hermes):
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; arguments may be JSON text."""

    START, END = "<tool_call>", "</tool_call>"

    def _parse(self, body: str) -> Calls:
        obj = _json_object(body)
        if obj is None or not isinstance(obj.get("name"), str):
            return None
        arguments = _arguments(obj.get("arguments", {}))
        return None if arguments is None else [(obj["name"], arguments)]


class MistralCalls(MarkedCalls):
    """vLLM's mistral parser's formats: `[TOOL_CALLS]` then a JSON array of {"name": ..., "arguments": {...}} (or one
    such object; arguments may be JSON text), the block ending with the array; or the newer (tokenizer v11+)
    `[TOOL_CALLS]NAME[ARGS]{...}` (`[ARGS]` may be missing), one call per marker. Ids: 9 letters and digits, which
    Mistral's templates require."""

    START = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def _open_block(self) -> None:
        super()._open_block()
        self.value: Optional[ValueEnd] = None   # the JSON (array, object) once it starts
        self.bare = False                       # a name came first: NAME[ARGS]{...}
        self.broken = False

    def _block_end(self, buf: str) -> Optional[tuple[int, int]]:
        """Where the JSON value closes (found by ValueEnd, then decoded once). A value that closes but does not
        decode never ends (the rest of the text is the body)."""
        while self.value is None and self.scanned < len(buf):
            ch = buf[self.scanned]
            if ch == "{" or (ch == "[" and not self.bare):
                self.value = ValueEnd(self.scanned)
                break
            self.bare = self.bare or not ch.isspace()
            self.scanned += 1
        if self.value is None or self.broken or self.value.find(buf) is None:
            return None
        try:
            end = _decoder.raw_decode(buf, self.value.start)[1]
        except (ValueError, RecursionError):
            self.broken = True
            return None
        return end, end

    def _parse(self, body: str) -> Calls:
        body = body.strip()
        if body[:1] in ("[", "{"):
            try:
                value = json.loads(body)
            except (ValueError, RecursionError):
                return None
            items = value if isinstance(value, list) else [value]
            calls = []
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    return None
                arguments = _arguments(item.get("arguments", {}))
                if arguments is None:
                    return None
                calls.append((item["name"], arguments))
            return calls or None
        name, brace, rest = body.partition("{")
        name = name.strip().removesuffix("[ARGS]").strip()
        arguments = _json_object(brace + rest)
        if not _NAME.fullmatch(name) or arguments is None:
            return None
        return [(name, json.dumps(arguments, ensure_ascii=False))]

    @staticmethod
    def new_id() -> str:
        return make_mistral_tool_call_id()


class DeepSeekV3Calls(MarkedCalls):
    """vLLM's deepseek_v3 parser's format: <｜tool▁calls▁begin｜> then blocks
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`, then <｜tool▁calls▁end｜>."""

    START, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"
    keeps_special_tokens = True

    def _parse(self, body: str) -> Calls:
        kind, sep, rest = body.partition(self.SEP)
        name, newline, fenced = rest.partition("\n")
        fenced = fenced.strip()
        if kind.strip() != "function" or not sep or not newline or not fenced.startswith("```"):
            return None
        fenced = fenced.removeprefix("```json").removeprefix("```").removesuffix("```")
        return _name_and_object(name.strip(), fenced)


class DeepSeekV31Calls(DeepSeekV3Calls):
    """vLLM's deepseek_v31 parser's format (DeepSeek-V3.1): as deepseek_v3's, with blocks
    `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`."""

    def _parse(self, body: str) -> Calls:
        name, sep, arguments = body.partition(self.SEP)
        return _name_and_object(name.strip(), arguments) if sep else None


def _name_and_object(name: str, arguments: str) -> Calls:
    """One call of a bare name and a JSON object's text (re-serialized), or None."""
    obj = _json_object(arguments)
    if not _NAME.fullmatch(name) or obj is None:
        return None
    return [(name, json.dumps(obj, ensure_ascii=False))]


class Glm45Calls(MarkedCalls):
    """vLLM's glm45 parser's format (GLM-4.5, GLM-4.6):
    `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>` blocks. A value is JSON (a number,
    an object, ...) where the tool's `parameters` schema gives the parameter a type other than string, or no type and
    it parses as JSON; else it is the string as written. The arguments become one JSON object."""

    START, END = "<tool_call>", "</tool_call>"
    PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    keeps_special_tokens = True

    def _parse(self, body: str) -> Calls:
        cut = min((at for at in (body.find("\n"), body.find("<arg_key>")) if at >= 0), default=len(body))
        name, pos, arguments = body[:cut].strip(), cut, {}
        while (pair := self.PAIR.match(body, pos)) is not None:
            key, value = pair.group(1).strip(), pair.group(2)
            arguments[key] = value if self._string_typed(name, key) else _json_or_text(value)
            pos = pair.end()
        if not _NAME.fullmatch(name) or body[pos:].strip():
            return None
        return [(name, json.dumps(arguments, ensure_ascii=False))]

    def _string_typed(self, name: str, key: str) -> bool:
        """Whether the tool's schema says the parameter is a string (or may be one: a list of types with string)."""
        tool = next((t for t in self.tools if t["function"]["name"] == name), None)
        props = ((tool or {}).get("function", {}).get("parameters") or {}).get("properties")
        kind = props.get(key, {}).get("type") if isinstance(props, dict) and isinstance(props.get(key), dict) else None
        return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


TOOL_PARSERS: dict[str, type[MarkedCalls]] = {
    "hermes": HermesCalls, "mistral": MistralCalls, "deepseek_v3": DeepSeekV3Calls,
    "deepseek_v31": DeepSeekV31Calls, "glm45": Glm45Calls}


def check_parser_flags(enable_auto_tool_choice: bool, tool_call_parser: Optional[str]) -> Optional[str]:
    """The server's parser for "auto" (None: "auto" is refused); ValueError (one line) for flags that cannot work."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r} is not a known tool call parser; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (known: "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    if tool_call_parser is not None and not enable_auto_tool_choice:
        raise ValueError(f"--tool-call-parser {tool_call_parser} has no effect without --enable-auto-tool-choice")
    return tool_call_parser if enable_auto_tool_choice else None
