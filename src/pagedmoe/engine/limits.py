"""The context-window check every front end words the same way (the server's 400, the CLI's error)."""
from __future__ import annotations

from typing import Optional


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
