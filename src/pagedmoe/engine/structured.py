"""Structured outputs in the engine: one llguidance matcher per constrained sequence (Request.matcher), a token
bitmask per constrained row each step, the matcher advanced with each sampled token.

- add_request: `start(request)` builds the matcher from the compiled grammar (structured_outputs.py) and the
  engine's tokenizer (llguidance's bridge, built once, at the first constrained request), or copies an unused one
  of the same grammar (FRESH_MATCHERS);
- each step, before sampling: `mask(logits, requests)` fills the bitmask of the constrained rows on the host and
  sets their disallowed tokens to -inf (worker/token_mask.py); the logits' columns past the tokenizer's vocabulary
  (padding rows of the embedding) are disallowed too. Only while some request is constrained (`active`): an
  unconstrained step does no work here;
- OutputProcessor.append_token calls `advance(request, token)`: a matcher that has stopped (the grammar is
  complete and allows nothing but EOS) finishes its request ("stop");
- SamplingParams.reasoning_end_token_id (a thinking model's `</think>`, set by the server's --reasoning-parser):
  until that token is sampled (`Request.constraint_after`) the request's row is not masked and its matcher does not
  advance; the constraint starts with the token after it.
The matcher lives on the Request, so preemption (recompute keeps the output tokens), prefix caching and n > 1
(one request per sample) need nothing more. --async-scheduling completes a step that sampled a constrained
request before launching the next (engine/async_step.py): its mask needs that token. Under tensor parallelism
rank 0 alone samples, so the mask is applied there only.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

import torch

from pagedmoe.structured_outputs import import_llguidance
from pagedmoe.worker.token_mask import apply_token_bitmask, keep_grammar_when_empty

if TYPE_CHECKING:
    from pagedmoe.engine.request import Request

logger = logging.getLogger("pagedmoe")

# Unused matchers kept, by grammar: building one takes ~0.2 s for a large JSON schema, on the engine thread (every
# stream waits), copying one ~20 us; the n samples of a request, and later requests with the same schema or tools,
# copy the first one's
FRESH_MATCHERS = 32


class StructuredOutputs:
    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.active: set[str] = set()   # ids of unfinished constrained requests
        self._ll_tokenizer = None
        # an unused matcher per grammar seen lately (by its hash, least recently used first): a request copies one
        self._fresh: OrderedDict[bytes, object] = OrderedDict()

    def _bridge(self):
        """llguidance's view of the engine's tokenizer (built once: ~1 s for a large vocabulary).

        NOTE: built here, on the engine thread, at the first constrained request, not in the server's worker thread
        next to the first compile (serving.compile_constraints): llguidance's LLTokenizer holds the GIL while it is
        built (measured: a 150k-token vocabulary, ~2 s in all, ~1.1 s of it in LLTokenizer with the GIL held, and
        the tokenizer's JSON copy in from_tokenizer ~0.6 s more), so on another thread it would stall the event
        loop and the engine thread just the same; and that thread would need a tokenizer of its own (a fast
        tokenizer is not to be shared between threads), a deepcopy that holds the GIL ~0.5-0.7 s more. What would
        help is building it at startup when llguidance is installed (startup time, for servers that never see a
        constraint) or an llguidance that lets the GIL go."""
        if self._ll_tokenizer is None:
            llguidance = import_llguidance()
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model was loaded without one")
            size = len(self.tokenizer)
            eos = sorted(t for t in self.eos_token_ids if t < size) or None
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=eos)
            except Exception as e:  # noqa: BLE001 - a slow (not Rust-backed) tokenizer, an unusual one
                raise ValueError(f"structured outputs cannot use this model's tokenizer: {e}") from None
        return self._ll_tokenizer

    def start(self, request: "Request") -> None:
        """The request's matcher; a ValueError (before the request is queued) if its grammar cannot be built."""
        so = request.params.structured_outputs
        grammar = so.compiled()
        key = hashlib.sha256(grammar.encode()).digest()
        fresh = self._fresh.get(key)
        if fresh is None:
            llguidance = import_llguidance()
            fresh = llguidance.LLMatcher(self._bridge(), grammar, log_level=0)
            if fresh.is_error():
                raise ValueError(f"structured_outputs.{so.kind}: {' '.join(fresh.get_error().split())[:500]}")
            self._fresh[key] = fresh
            if len(self._fresh) > FRESH_MATCHERS:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(key)
        request.matcher = fresh.deep_copy()
        request.constraint_after = request.params.reasoning_end_token_id
        self.active.add(request.request_id)

    def finished(self, request_id: str) -> None:
        self.active.discard(request_id)

    def mask(self, logits: torch.Tensor, requests: list["Request"],
             before_min_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """logits [N, V] of the step's sampling rows -> the same with each constrained row's disallowed tokens at
        -inf (a new tensor); the input itself when no row is constrained.

        before_min_tokens: the logits before min_tokens banned EOS and the stop tokens (OutputProcessor.
        mask_min_tokens). A constrained row under min_tokens whose grammar allows only banned tokens (a grammar that
        is complete, or needs a stop token now) would have no token left, and sampling from it fails (NaN
        probabilities); such a row keeps the grammar's tokens instead: the grammar wins, as in vLLM."""
        if not self.active:
            return logits
        rows = [i for i, r in enumerate(requests) if r.matcher is not None and r.constraint_after is None]
        if not rows:
            return logits
        vocab = self._bridge().vocab_size
        bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
        for j, i in enumerate(rows):   # llguidance writes row j in place (host memory, its layout: token_mask.py)
            row = bitmask[j]
            requests[i].matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        out = apply_token_bitmask(logits, rows, bitmask, vocab)
        if before_min_tokens is not None and before_min_tokens is not logits:
            under = [j for j, i in enumerate(rows) if requests[i].num_output_tokens < requests[i].params.min_tokens]
            if under:
                out = keep_grammar_when_empty(out, before_min_tokens, [rows[j] for j in under], bitmask[under], vocab)
        return out


def advance(request: "Request", token: int) -> bool:
    """Feed the sampled token to the request's matcher; True when the output is complete (the matcher has stopped:
    its grammar allows nothing more), or when the matcher failed (a token it did not allow: logged). A matcher
    waiting for the end of the reasoning (`constraint_after`) takes no token: that one starts the constraint."""
    if request.constraint_after is not None:
        if token == request.constraint_after:
            request.constraint_after = None
        return False
    matcher = request.matcher
    if not matcher.consume_token(token):
        logger.warning("structured outputs: the matcher refused token %d (%s); the request stops", token,
                       matcher.get_error())
        return True
    return matcher.is_stopped()

