"""Continuous batching with chunked prefill and preemption by recompute. Pure Python.

One step's plan: every running request first (a decode token, or the next chunk of its prefill), in
arrival order, then waiting requests first-come first-served while the token budget
(`max_num_batched_tokens`), the sequence limit (`max_num_seqs`) and the KV blocks allow. When a running
request needs a block and none is free, the most recently arrived running request is preempted: its
blocks are freed and it goes back to the front of the waiting queue. With a swap space (kvcache/swap.py,
--swap-space) its computed KV goes to host memory first and comes back when it is readmitted (the step's
`swap_out` / `swap_in` copies, queued before its forward); without one, or when the host has no run of
blocks that long, it is recomputed from its prompt and the tokens it already generated.

With prefix caching (kvcache/prefix_cache.py) a request is admitted after the longest run of cached
blocks its tokens start with: those tokens are not computed again. A request whose next block another
running request is computing right now waits for it (parallel samples of one prompt share it so).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

from pagedmoe.engine.request import Request, RequestStatus
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.kvcache.swap import SwapSpace
from pagedmoe.scheduler_output import ScheduledRequest, SchedulerOutput

__all__ = ["Scheduler", "ScheduledRequest", "SchedulerOutput"]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 swap: Optional[SwapSpace] = None) -> None:
        self.kv = kv
        self.swap = swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.num_swapped_total = 0   # preemptions that swapped the KV out instead of dropping it

    # -- queue management ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Mark finished (or aborted), drop it from the queues and free its blocks."""
        assert status.finished
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv.free(request.request_id)
        if self.swap is not None:
            self.swap.release(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            if request.num_pending_tokens and request.num_output_tokens >= request.max_tokens:
                idx += 1  # --async-scheduling: the step in flight samples its last token; it finishes
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request preempted itself; everything after it is gone too
            out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
            budget -= num_new
            idx += 1

        # Admit nothing new in a step that had to preempt: the cache is under pressure.
        held_back = []
        while (not out.preempted_ids and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            if self.swap is not None and self.swap.holds(request.request_id):
                if not self._swap_in(request, budget, out):
                    break
                budget -= out.scheduled[-1].num_new_tokens
                continue
            # prefix caching: start after the blocks already cached (a waiting request has none computed); cached
            # tokens have no logits, so a request asking for prompt logprobs computes its whole prompt (as vLLM)
            cached = self.kv.find_cached(request) if request.params.prompt_logprobs is None else []
            if self.kv.waits_for(request, len(cached)):
                held_back.append(self.waiting.popleft())  # its next block is being computed: share it
                continue
            start = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - start, budget)
            if not self.kv.allocate(request.request_id, start + num_new, cached):
                break
            self.kv.admitted(request, len(cached))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = start
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, start))
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))
        if out.swap_out and not out.scheduled:
            self._recompute_instead_of_swapping(out)
        return out

    def _recompute_instead_of_swapping(self, out: SchedulerOutput) -> None:
        """A step that schedules nothing runs no forward, and the swap-out copies are queued before a forward: its
        preempted requests recompute instead (--async-scheduling: every running request preempted itself or
        samples its last token in the step in flight)."""
        for request in self.waiting:
            if request.request_id in out.preempted_ids and self.swap.holds(request.request_id):
                self.swap.release(request.request_id)
                request.num_computed_tokens = 0
                self.num_swapped_total -= 1
        out.swap_out.clear()

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()  # lowest priority: the latest arrival still running
            self._preempt(victim, out)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        rid, computed = request.request_id, request.num_computed_tokens
        n = -(-computed // self.kv.block_size)
        start = self.swap.reserve(rid, n) if self.swap is not None and n else None
        if start is not None:  # its KV goes to the host before anything reuses the blocks (this step's copies)
            out.swap_out.append((self.kv.block_table(rid)[:n], start))
            self.num_swapped_total += 1
        else:
            request.num_computed_tokens = 0
        self.kv.free(rid)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _swap_in(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        """Readmit a swapped request: its computed blocks that are still in the prefix cache (a prefix other requests
        share, or blocks nobody reused yet) are taken from there, fresh blocks for the rest of its computed tokens and
        its next ones, and the host copy of that rest is queued into them. False (nothing changed) when the blocks
        are not free."""
        rid, start, bs = request.request_id, request.num_computed_tokens, self.kv.block_size
        cached = self.kv.find_cached(request)[:start // bs]   # full computed blocks only
        num_new = min(request.num_tokens - start, budget)
        if not self.kv.allocate(rid, start + num_new, cached):
            return False
        n = -(-start // bs)
        if n > len(cached):
            out.swap_in.append((self.swap.start(rid) + len(cached), self.kv.block_table(rid)[len(cached):n]))
        self.swap.release(rid)  # reused by a later swap-out only: queued after this copy on the same stream
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new, start))
        return True

    def update(self, scheduled: Iterable[ScheduledRequest]) -> None:
        """Record that the scheduled tokens are now in the KV cache (--async-scheduling: requests that
        finished meanwhile are left alone: their blocks are freed)."""
        for s in scheduled:
            if s.request.is_finished:
                continue
            s.request.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            self.kv.cache_blocks(s.request, s.request.num_computed_tokens)
