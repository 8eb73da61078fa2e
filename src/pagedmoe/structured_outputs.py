"""StructuredOutputsParams (vLLM's names): constrain a request's output to a JSON schema, any JSON object, a
regex, one of a list of strings, or a grammar (Lark or GBNF).

The constraint is compiled by llguidance (the optional `structured` extra) into one grammar, checked when the
parameters are made (SamplingParams.validate), so a bad schema, regex or grammar is a ValueError before the
request reaches the engine. The engine (engine/structured.py) turns the grammar into a matcher per sequence
and masks the logits of its rows each step. llguidance is imported only here and there, when a constraint is
asked for: without it, unconstrained use is unaffected.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

# Grammars made lately, by what they were made from (least recently used first): compiling takes ~0.1-1 s for a schema
# of thousands of fields, or a choice of thousands of strings, and clients send the same schema, or the same tools,
# with every request. The server compiles in worker threads (serving.compile_constraints), several at once: the lock
# guards the dict only; two threads compiling the same constraint both compile it, and the last one's is kept
COMPILED_GRAMMARS = 64
_COMPILED: "OrderedDict[bytes, str]" = OrderedDict()
_COMPILED_LOCK = threading.Lock()

INSTALL_HINT = ("structured outputs need the llguidance package, which is not installed: pip install llguidance "
                "(or pip install 'pagedmoe[structured]')")
# the constraints, exactly one of which a request gives (vLLM's fields)
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def import_llguidance():
    """The llguidance module, or a one-line ValueError naming `pip install llguidance` (the server answers 400)."""
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge the engine uses)
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return llguidance


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's StructuredOutputsParams):
      - json: a JSON schema (a dict, or its JSON text): the output is a JSON value that validates against it;
      - json_object: True: the output is a JSON object (any);
      - regex: the whole output matches the regular expression (Rust regex syntax, as llguidance reads it);
      - choice: the output is exactly one of these strings;
      - grammar: the output is in the language of a Lark grammar (llguidance's dialect: start rule `start`,
        string literals in double quotes) or a GBNF grammar (llama.cpp's: start rule `root`).
    JSON options: disable_any_whitespace (no whitespace between tokens of the JSON), whitespace_pattern (a regex
    for the whitespace allowed there). structural_tag and disable_additional_properties are vLLM's too, not
    supported here (refused rather than ignored).
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    _compiled: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs: structural_tag is not supported")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs: disable_additional_properties is not supported")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its text), "
                             f"got {type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or (name != "whitespace_pattern" and not value)):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        if (self.disable_any_whitespace or self.whitespace_pattern is not None) and not (self.json or self.json_object):
            raise ValueError("structured_outputs: disable_any_whitespace and whitespace_pattern apply to json and "
                             "json_object only")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def compiled(self) -> str:
        """The llguidance grammar of the constraint, checked (ValueError naming what is wrong); made once, and
        shared by later parameters with the same constraint (_COMPILED)."""
        if self._compiled is None:
            import_llguidance()   # a constraint needs it, compiled before or not
            key = self._cache_key()
            with _COMPILED_LOCK:
                grammar = _COMPILED.get(key) if key is not None else None
                if grammar is not None:
                    _COMPILED.move_to_end(key)
            if grammar is None:
                grammar = self._compile()
                if key is not None:
                    with _COMPILED_LOCK:
                        _COMPILED[key] = grammar
                        if len(_COMPILED) > COMPILED_GRAMMARS:
                            _COMPILED.popitem(last=False)
            self._compiled = grammar
        return self._compiled

    def _cache_key(self) -> Optional[bytes]:
        """What the grammar is made from, hashed; None (not shared) for a value JSON cannot write (too deep)."""
        try:
            text = json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                               self.whitespace_pattern], ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return None
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def _compile(self) -> str:
        llguidance = import_llguidance()
        matcher = llguidance.LLMatcher
        kind = self.kind
        try:
            if kind in ("json", "json_object"):
                schema: Any = {"type": "object"} if kind == "json_object" else self.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
                options: dict = {"whitespace_flexible": not self.disable_any_whitespace}
                if self.whitespace_pattern is not None:
                    options["whitespace_pattern"] = self.whitespace_pattern
                # as defaults: a schema's own "x-guidance" options (llguidance's) win, as with vLLM's guidance backend
                grammar = matcher.grammar_from_json_schema(schema, defaults=options)
            elif kind == "regex":
                grammar = matcher.grammar_from_regex(self.regex)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", list(self.choice))
            else:  # Lark, or GBNF (converted to Lark)
                grammar = llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:  # json.JSONDecodeError too
            raise ValueError(f"structured_outputs.{kind}: {_one_line(str(e))}") from None
        except RecursionError:   # json.loads of a schema's text nested deeper than Python's stack
            raise ValueError(f"structured_outputs.{kind}: the JSON schema is nested too deeply") from None
        error = matcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {_one_line(error)}")
        return grammar

    @classmethod
    def from_dict(cls, values: dict) -> "StructuredOutputsParams":
        """The server's `structured_outputs` field: unknown keys are refused by name."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


def _one_line(message: str) -> str:
    return " ".join(message.split())[:500]
