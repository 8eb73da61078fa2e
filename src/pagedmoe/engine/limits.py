"""The input checks every front end shares (the server's 400, the CLI's error, the offline API's ValueError):
the context window, worded the same way; text that is not UTF-8."""
from __future__ import annotations

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
