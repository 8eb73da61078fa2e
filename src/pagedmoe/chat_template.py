"""--chat-template (vLLM's flag): a Jinja chat template in place of the tokenizer's own, for every chat path (the
server's /v1/chat/completions, `pagedmoe chat`, LLM.chat). The value is a file holding the template or the template
itself; it is read and parsed once, before the model loads, so a missing file or a template with a syntax error is
one line at start-up, not a 400 on every request. LLM.chat(chat_template=...) takes the same for one call; with
the server's --trust-request-chat-template a request's chat_template (text only) is rendered."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

_JINJA_MARKS = ("{%", "{{", "{#")
# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                                      "continue_final_message", "chat_template", "tools", "documents"})


def check_template_kwargs(kwargs: dict) -> None:
    """ValueError (one line) where chat_template_kwargs sets one of apply_chat_template's own arguments."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")


def load_chat_template(value: Optional[str], flag: str = "--chat-template") -> Optional[str]:
    """The template text of `value` (a file's contents, or `value` itself when it holds Jinja markup), parsed; None
    for None. ValueError (one line) for an empty value, a file that is missing, unreadable or not UTF-8, or a
    template Jinja cannot parse."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{flag} must be a file holding a Jinja chat template or the template itself, got {value!r}")
    if any(mark in value for mark in _JINJA_MARKS):
        text, where = value, flag
    else:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{flag}: no such file {value!r} (nor is it a template: no {{% or {{{{ in it)")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag}: cannot read {value!r} as UTF-8 text: {e}") from None
        if not text.strip():
            raise ValueError(f"{flag}: {value!r} is empty")
        where = f"{flag} {value!r}"
    _parse(text, where)
    return text


def request_chat_template(text: str) -> str:
    """A request's chat_template (the server's --trust-request-chat-template): the template's text only, never a
    path (a request must not make the server read its files), parsed; ValueError (one line) otherwise."""
    if not text.strip():
        raise ValueError("chat_template must be a Jinja template's text, got an empty string")
    _parse(text, "chat_template")
    return text


def _parse(text: str, where: str) -> None:
    """The template parsed by the Jinja environment transformers renders chat templates with (its extensions, such
    as loop controls, included), so what parses here renders there."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # an older or newer transformers: plain Jinja with loop controls
        _compile_jinja_template = None
    try:
        if _compile_jinja_template is not None:
            _compile_jinja_template(text)
        else:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
