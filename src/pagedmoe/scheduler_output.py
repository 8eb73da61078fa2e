"""What one engine step runs: the scheduler's output, read by the model runner (worker/).

Its own module so that worker/ can import it without importing the engine (imports go one way:
engine -> worker). Pure Python; `request` is an engine Request, read by attribute only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedmoe.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # tokens already in the KV cache before this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token, so a new token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """This step's positions whose logits give prompt logprobs (SamplingParams.prompt_logprobs): each predicts
        the prompt token after it, so the last prompt position (it samples) is not one. Empty when not asked."""
        if self.request.params.prompt_logprobs is None:
            return range(0)
        start = self.num_computed_tokens
        return range(start, min(start + self.num_new_tokens, self.request.num_prompt_tokens - 1))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # KV swap space (kvcache/swap.py), copied before the step's forward, in this order:
    swap_out: list[tuple[list[int], int]] = field(default_factory=list)  # (device blocks, host start)
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)   # (host start, device blocks)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def prompt_logprob_spans(self) -> list[tuple[ScheduledRequest, range]]:
        """(scheduled request, positions) of the rows whose logits the step adds after the sampling rows for prompt
        logprobs, in row order; [] in a step where nobody asks for them."""
        spans = [(s, s.prompt_logprob_positions) for s in self.scheduled
                 if s.request.params.prompt_logprobs is not None]
        return [(s, r) for s, r in spans if r]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
