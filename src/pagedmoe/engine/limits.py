"""The input checks every front end shares (the server's 400, the CLI's error, the offline API's ValueError):
the context window, worded the same way; text that is not UTF-8; a .jsonl file's string fields."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def lone_surrogate(text: str) -> Optional[int]:
    """The index of the first lone surrogate in `text` (JSON's "\ud800", or bytes that were not UTF-8, which
    Python keeps so in sys.argv and stdin), which no tokenizer can encode; None for valid text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def read_utf8(path: Path, what: str) -> str:
    """The text of file `path`; a ValueError naming it (`what`, e.g. "dataset") and the first bad byte."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def jsonl_strings(path: Path, text: str, field: str, expected: str, name: str) -> list[str]:
    """The string `field` of each non-blank line of `text` (the .jsonl file `path`). A ValueError names the file and
    line: "expected `expected`" for a line that is not a JSON object with the field, and `name` (the field as the
    front end quotes it) for a value that is not a string."""
    values = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)[field]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: expected {expected} ({e})") from e
        if not isinstance(value, str):
            raise ValueError(f"{path}:{line_no}: {name} must be a string, got {type(value).__name__}")
        values.append(value)
    return values


def context_length_error(limit: int, num_prompt: int, max_tokens: Optional[int]) -> Optional[tuple[str, str]]:
    """(message, offending parameter) when a prompt of `num_prompt` tokens with up to `max_tokens` new ones
    does not fit a `limit`-token context (OpenAI's wording), else None."""
    if num_prompt >= limit:
        return (f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{num_prompt} tokens (at most {limit - 1} leave room for one new token).", "prompt")
    if max_tokens is not None and num_prompt + max_tokens > limit:
        return (f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or completion.", "max_tokens")
    return None
