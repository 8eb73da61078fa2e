"""Tool calling on /v1/chat/completions, as vLLM does it.

- `tools` (OpenAI function tools) go to the chat template (`apply_chat_template(tools=...)`), whatever `tool_choice`.
- `tool_choice`:
  - "none": no tool calls; the output is plain content;
  - named ({"type": "function", "function": {"name": ...}}): the output is constrained (structured outputs) to the
    function's `parameters` schema and becomes that one call's `arguments`; finish_reason stays the output's ("stop");
  - "required": the output is constrained to a JSON array (at least one item) of {"name": one of the tools,
    "parameters": that tool's schema}; each item becomes a call; finish_reason "tool_calls" when the output stopped;
  - "auto" (the default with tools): needs `--enable-auto-tool-choice --tool-call-parser NAME`; the parser takes the
    calls out of free text (tool_parsers.py); finish_reason "tool_calls" when it found one.
Each choice's output goes through one `CallStream` (tool_parsers.py): `feed(text delta, finished)` -> (content delta, tool call
deltas, OpenAI's stream format). The non-streamed message is the same stream fed the whole text at once, so a
streamed response accumulates to the non-streamed one (tool call ids aside: each response draws its own).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedmoe.server.protocol import invalid
from pagedmoe.server.tool_parsers import TOOL_PARSERS, CallStream, ValueEnd, full_call
from pagedmoe.structured_outputs import StructuredOutputsParams, import_llguidance

TOOL_CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NAMED_USAGE = 'expected {"type": "function", "function": {"name": "my_function"}}'


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
        return "", [full_call(0, self.name, text)]

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
        self.item: Optional[ValueEnd] = None   # the item being streamed: decoded once it closes

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        self.text += text
        out = []
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n[,":
                self.pos += 1
            if self.pos >= len(self.text) or self.text[self.pos] != "{":
                break
            self.item = self.item or ValueEnd(self.pos)
            if self.item.find(self.text) is None:
                break   # the item is not complete yet
            try:
                item, end = self._decoder.raw_decode(self.text, self.pos)
            except ValueError:
                break   # not JSON (a constraint makes it so; no more items are taken)
            self.pos, self.item = end, None
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
                out.append(full_call(self.calls, item["name"], args))
                self.calls += 1
        return "", out

    @property
    def content_when_empty(self) -> Optional[str]:
        return ""



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
