"""Tool calling on /v1/chat/completions, as vLLM does it.

- `tools` (OpenAI function tools) go to the chat template (`apply_chat_template(tools=...)`), whatever `tool_choice`.
- `tool_choice`:
  - "none": no tool calls; the output is plain content;
  - named ({"type": "function", "function": {"name": ...}}): the output is constrained (structured outputs) to the
    function's `parameters` schema and becomes that one call's `arguments`; finish_reason stays the output's ("stop");
  - "required": the output is constrained to a JSON array (at least one item) of {"name": one of the tools,
    "parameters": that tool's schema}; each item becomes a call; finish_reason "tool_calls" when the output stopped;
  - "auto" (the default with tools): needs `--enable-auto-tool-choice --tool-call-parser NAME`; the parser takes the
    calls out of free text (vLLM's names: hermes for Qwen2.5 / Qwen3 / Hermes, mistral, deepseek_v3, deepseek_v31,
    glm45: MarkedCalls and its subclasses); finish_reason "tool_calls" when it found one. For all but hermes (their
    markers are special tokens), the request's skip_special_tokens is turned off (vLLM's) and the tokenizer's other
    special tokens are taken out of the content instead (serving.py).
Each choice's output goes through one `CallStream`: `feed(text delta, finished)` -> (content delta, tool call
deltas, OpenAI's stream format). The non-streamed message is the same stream fed the whole text at once, so a
streamed response accumulates to the non-streamed one (tool call ids aside: each response draws its own).
"""
from __future__ import annotations

import copy
import functools
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagedmoe.server.protocol import invalid
from pagedmoe.structured_outputs import StructuredOutputsParams, import_llguidance

TOOL_CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NAMED_USAGE = 'expected {"type": "function", "function": {"name": "my_function"}}'


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_mistral_tool_call_id() -> str:
    """The mistral parser's (vLLM's): 9 letters and digits, the only ids Mistral's templates take."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


# -- request validation --------------------------------------------------------------------------------
def check_tools(tools: Any) -> list[dict]:
    """`tools` as the template gets them (as sent); a 400 naming the first malformed one."""
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where}: only tools of type 'function' are supported: "
                          '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}',
                          "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{where}.function must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name must be a non-empty string", "tools")
        if name in names:
            raise invalid(f"{where}: the function name {name[:64]!r} is given twice", "tools")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid(f"{where}.function.description must be a string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", "tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise invalid(f"{where}.function.strict must be a boolean", "tools")
    return tools


def _named_choice(tool_choice: dict, tools: list[dict]) -> str:
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise invalid(f"tool_choice: {_NAMED_USAGE}", "tool_choice")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"tool_choice.function.name must be a non-empty string; {_NAMED_USAGE}", "tool_choice")
    if all(t["function"]["name"] != name for t in tools):
        raise invalid(f"tool_choice names the function {name[:64]!r}, which is not in tools", "tool_choice")
    return name


def resolve(tools: Any, tool_choice: Any, parallel_tool_calls: bool, parser: Optional[str]) -> Optional["ToolMode"]:
    """The request's tool mode; None for a request without tools (plain chat). `parser`: the server's
    --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    if tools is None or tools == []:
        if tool_choice in (None, "none"):
            return None   # vLLM's: "none" needs no tools; an empty list is none given
        raise invalid("tool_choice needs tools: send the functions the model may call in `tools`", "tool_choice")
    tools = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto"   # OpenAI's default when tools are given
    if isinstance(tool_choice, dict):
        return ToolMode("named", tools, name=_named_choice(tool_choice, tools), parallel=parallel_tool_calls)
    if tool_choice not in TOOL_CHOICES:
        raise invalid(f"tool_choice must be 'none', 'auto', 'required' or a named function ({_NAMED_USAGE}), got "
                      f"{str(tool_choice)[:40]!r}", "tool_choice")
    if tool_choice == "auto" and parser is None:
        raise invalid(AUTO_NEEDS_FLAGS, "tool_choice")
    return ToolMode(tool_choice, tools, parser=parser if tool_choice == "auto" else None,
                    parallel=parallel_tool_calls)


def template_messages_tool_calls(tool_calls: Any, index: int) -> list[dict]:
    """An assistant message's `tool_calls` for the template: arguments sent as JSON text become objects (vLLM's:
    templates iterate them, e.g. `arguments | items`); text that is not a JSON object stays text."""
    if not isinstance(tool_calls, list):
        raise invalid(f"messages[{index}].tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"messages[{index}].tool_calls[{j}] must be "
                          '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}', "messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        elif args is not None and not isinstance(args, dict):
            raise invalid(f"messages[{index}].tool_calls[{j}].function.arguments must be a JSON string or object",
                          "messages")
        out.append({**call, "function": {**fn, "arguments": args if args is not None else {}}})
    return out


# -- the constraints of named and required ---------------------------------------------------------------
_GUIDANCE = "x-guidance"   # llguidance's options (whitespace, ...), read at a schema's top level only


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


def _hoist(schema: dict, defs: dict, guidance: list, name: str) -> dict:
    """`schema` to nest under another: its $defs / definitions (which its refs name from the root) and x-guidance
    move to the top (collected in `defs`, `guidance`); the same name with another definition is a 400."""
    schema = dict(schema)
    if _GUIDANCE in schema:
        guidance.append(schema.pop(_GUIDANCE))
    for key in ("$defs", "definitions"):
        for def_name, value in (schema.pop(key, None) or {}).items():
            if defs.setdefault(key, {}).setdefault(def_name, value) != value:
                raise invalid(f"tools: function {name[:64]!r} defines {key}/{def_name} differently from another "
                              "tool; tool_choice 'required' needs one definition per name", "tools")
    return schema


def required_schema(tools: list[dict]) -> dict:
    """tool_choice "required": a non-empty array of calls, each {"name": a tool's name, "parameters": its schema} and
    nothing else (vLLM's schema leaves other keys open; the parser would drop them)."""
    defs: dict = {}
    guidance: list = []
    variants = []
    for tool in tools:
        name = tool["function"]["name"]
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [name]},
                                        "parameters": _hoist(_parameters(tool), defs, guidance, name)},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    schema.update(copy.deepcopy(defs))
    if guidance:
        if any(g != guidance[0] for g in guidance):
            raise invalid(f"tools: the functions' parameters give different {_GUIDANCE} options; tool_choice "
                          "'required' applies one set to the whole output", "tools")
        schema[_GUIDANCE] = guidance[0]
    return schema


# -- per-choice output -----------------------------------------------------------------------------------
def _full_call(index: int, name: str, arguments: str, call_id: Optional[str] = None) -> dict:
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


class NamedCalls(CallStream):
    """The whole output is the arguments of one call: its first delta carries id, type and name (vLLM's)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        if self.calls:
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        if not text and not finished:
            return "", []
        self.calls = 1
        return "", [_full_call(0, self.name, text)]

    @property
    def content_when_empty(self) -> Optional[str]:
        return ""   # vLLM's message for named and required


class RequiredCalls(CallStream):
    """The output is a JSON array of {"name", "parameters"}: each item is sent whole, as one call, once it closes
    (its parameters re-serialized compactly, as vLLM does). A cut-off output (finish_reason length) keeps the
    items complete by then."""

    _decoder = json.JSONDecoder()

    def __init__(self) -> None:
        self.text, self.pos = "", 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        self.text += text
        out = []
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n[,":
                self.pos += 1
            if self.pos >= len(self.text) or self.text[self.pos] != "{":
                break
            try:
                item, end = self._decoder.raw_decode(self.text, self.pos)
            except ValueError:
                break   # the item is not complete yet
            self.pos = end
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                out.append(_full_call(self.calls, item["name"], args))
                self.calls += 1
        return "", out

    @property
    def content_when_empty(self) -> Optional[str]:
        return ""


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
                    calls.append(_full_call(self.calls, name, arguments, self.new_id()))
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
            elif self.SECTION is not None and marker in self.SECTION:
                self.in_section = marker == self.SECTION[0]
            # else a string of `drop`: taken out
        return self._content(content, finished), calls

    def _outside(self, text: str) -> str:
        return "" if self.in_section and not text.strip() else text

    def _block_end(self, buf: str) -> Optional[tuple[int, int]]:
        """(where the body ends, where the block ends) in `buf`, the text after START; None while it may go on."""
        at = buf.find(self.END)
        return None if at < 0 else (at, at + len(self.END))

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

    def _block_end(self, buf: str) -> Optional[tuple[int, int]]:
        start = len(buf) - len(buf.lstrip())
        if start == len(buf):
            return None
        if buf[start] not in "[{":
            start = buf.find("{", start)   # NAME[ARGS]{...}
            if start < 0:
                return None
        try:
            end = _decoder.raw_decode(buf, start)[1]
        except (ValueError, RecursionError):
            return None   # not complete yet (or never: then the rest of the text is the body)
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


@dataclass
class ToolMode:
    choice: str                    # "none", "auto", "required", "named"
    tools: list[dict]
    name: Optional[str] = None     # named: the function
    parser: Optional[str] = None   # auto: the --tool-call-parser
    parallel: bool = True          # parallel_tool_calls: false keeps the first call only (vLLM's)
    drop: tuple[str, ...] = ()     # auto: strings taken out of the content (serving.py: the special tokens it keeps)
    _constraint: Optional[StructuredOutputsParams] = field(default=None, init=False, repr=False)
    _error: Optional[Exception] = field(default=None, init=False, repr=False)   # constraint()'s, raised again

    def constraint(self) -> Optional[StructuredOutputsParams]:
        """named / required: the structured outputs constraint, compiled (a bad schema is a 400 on `tools`). Made
        once (the server makes it in a worker thread first: serving.compile_constraints): a later call gives the
        same constraint, or raises the same error."""
        if self.choice not in ("named", "required") or self._constraint is not None:
            return self._constraint
        if self._error is not None:
            raise self._error
        try:
            self._constraint = self._make_constraint()
        except Exception as e:  # noqa: BLE001 - raised again where the request's checks reach it
            self._error = e
            raise
        return self._constraint

    def _make_constraint(self) -> StructuredOutputsParams:
        if self.choice == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            schema = _parameters(tool)
        else:
            try:
                schema = required_schema(self.tools)
            except RecursionError:   # copying $defs nested deeper than Python's stack
                raise invalid("tools: a parameters schema is nested too deeply", "tools") from None
        params = StructuredOutputsParams(json=schema)
        try:
            import_llguidance()
        except ValueError as e:
            raise invalid(f"tool_choice {self.choice!r} constrains the output: {e}", "tool_choice") from None
        try:
            params.compiled()
        except ValueError as e:
            message = str(e).replace("structured_outputs.json: ", "")
            what = f"function {self.name!r}" if self.choice == "named" else "tool_choice 'required'"
            raise invalid(f"tools: the parameters schema of {what} cannot be used: {message}", "tools") from None
        return params

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must keep its special tokens (skip_special_tokens off): "auto" with a parser whose
        markers are special tokens (vLLM's parsers turn skip_special_tokens off for requests with tools)."""
        return self.choice == "auto" and TOOL_PARSERS[self.parser].keeps_special_tokens

    @property
    def parses(self) -> bool:
        """Whether the output becomes tool calls (all but "none")."""
        return self.choice != "none"

    def stream(self) -> Optional[CallStream]:
        """A new per-choice parser; None for "none" (plain content)."""
        if self.choice == "named":
            return NamedCalls(self.name)
        if self.choice == "required":
            return RequiredCalls()
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser](self.tools, self.drop)
        return None

    def keep(self, calls: list[dict]) -> list[dict]:
        return calls if self.parallel else [c for c in calls if c["index"] == 0]

    def finish_reason(self, stream: CallStream, finish: Optional[str]) -> Optional[str]:
        """vLLM's (OpenAI's): "tool_calls" for auto when it found calls and for required when the output stopped;
        a named call keeps the output's ("stop")."""
        if finish is None:
            return None
        if self.choice == "auto" and stream.calls:
            return "tool_calls"
        if self.choice == "required" and finish == "stop":
            return "tool_calls"
        return finish

    def message(self, text: str) -> tuple[Optional[str], list[dict], CallStream]:
        """Non-streamed: (content, tool_calls without their stream index, the stream) of a finished output."""
        stream = self.stream()
        content, deltas = stream.feed(text, True)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in self.keep(deltas)]
        if not content and calls:
            content = stream.content_when_empty
        return content, calls, stream
