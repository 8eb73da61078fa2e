"""One request's state as the engine sees it. Pure Python."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from pagedmoe.sampling_params import Logprob, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed its step (out of GPU memory): Request.error says why

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str] = None
    eos_token_id: Optional[int] = None
    max_tokens: int = 16  # resolved from params and max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # SamplingParams.prompt_logprobs: entry i is prompt token i's (None for token 0), filled chunk by chunk
    prompt_logprobs: list[Optional[dict[int, Logprob]]] = field(default_factory=lambda: [None])
    # Tokens whose KV is in the cache. Reset to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    # --async-scheduling: tokens sampled by steps still in flight, not yet in output_token_ids (0, 1, or 2
    # for a moment); the scheduler counts them as tokens, so the next step decodes after them.
    num_pending_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: object = None
    output_text: str = ""  # detokenized output so far
    # Incremental detokenization (engine/output.py): output tokens [detok_prefix, detok_read) are the
    # context the next tokens are decoded after; text is final up to detok_read.
    detok_prefix: int = 0
    detok_read: int = 0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    error: Optional[str] = None  # why the request failed (status FINISHED_ERROR)
    # structured outputs (engine/structured.py): the llguidance matcher of this sequence's grammar, advanced with
    # each output token; None when the output is unconstrained
    matcher: Optional[object] = field(default=None, repr=False)
    # SamplingParams.reasoning_end_token_id while that token has not been sampled yet: the matcher neither masks nor
    # advances (the constraint starts with the token after it); None once it has, or when the constraint starts at once
    constraint_after: Optional[int] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, those of steps in flight included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (once per request per step)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None
