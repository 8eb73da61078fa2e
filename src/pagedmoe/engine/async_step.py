"""--async-scheduling (vLLM's name): the host work of a step runs while the GPU runs the step before it.

A plain step is schedule -> prepare -> launch -> wait for the sampled tokens -> detokenise, stop checks,
outputs; the GPU idles while the host works. Here one call of ``step()`` does, for steps N (in flight) and
N + 1:

  1. schedule N + 1 with N's sampled tokens still unknown: each request N sampled counts one pending token
     (Request.num_pending_tokens), so it decodes again; a request whose pending token is its last by
     max_tokens is left out (it finishes);
  2. prepare and launch N + 1: its rows that decode after a pending token read it on the device from N's
     sampled tokens (ModelRunner.execute's ``pending``); N + 1's sampler runs behind it and queues the copy
     of its tokens to pinned host memory (DeviceSample.start_copy);
  3. wait for N's tokens only (its event, not N + 1's work), then append them, detokenise, check stops and
     build N's outputs, while N + 1 runs;
  4. record N + 1's tokens as computed (Scheduler.update: after 3, so the prefix cache hashes known tokens).

The scheduler is one step behind for stops: a request that stops at N was scheduled into N + 1 too; that
step's token for it is dropped (it is finished when N + 1 completes) and its blocks were freed at N. What
a request receives is what a plain step gives it: greedy and seeded tokens, logprobs, stop strings,
min_tokens (counted with the pending token). Steps with penalties or structured outputs need the previous
token on the host (the penalty counts; the grammar's mask): when step N samples a penalised or constrained
request, N completes before N + 1 is scheduled (a plain step). Batches
can differ from a plain run (a request stopping at N still takes a row of N + 1), so unseeded sampling
draws differently. Not with paged experts, dynamic precision or tensor parallelism (their per-step
host work assumes the plain order): the engine refuses the flag there. Without the flag it is on wherever it
can take effect on CUDA (vLLM's default since 0.14); --no-async-scheduling turns it off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from pagedmoe.scheduler_output import SchedulerOutput
from pagedmoe.worker.sampler import DeviceSample

if TYPE_CHECKING:
    from pagedmoe.engine.request import Request
    from pagedmoe.sampling_params import RequestOutput


@dataclass
class InFlightStep:
    sched: SchedulerOutput
    sampling: list["Request"] = field(default_factory=list)  # the requests it samples, in token order
    sample: Optional[DeviceSample] = None

    def index_of(self) -> dict[str, int]:
        return {r.request_id: i for i, r in enumerate(self.sampling)}


def _unsupported(engine) -> Optional[str]:
    """Why the engine (the LLMEngine; not imported: it imports this module) cannot schedule asynchronously."""
    return ("paged experts (their pager ends each step after its tokens reach the host)" if engine.pager is not None
            else "--expert-precision dynamic (it moves experts between steps)" if engine.precision is not None
            else "--tensor-parallel-size > 1 (the workers get host inputs only)" if engine.runner.control is not None
            else None)


def check_async_scheduling(engine) -> None:
    """The flag fails loudly where it cannot take effect."""
    why = _unsupported(engine)
    if why is not None:
        raise ValueError(f"--async-scheduling does not support {why} yet; run without it")


def async_scheduling_applies(engine, flag: Optional[bool]) -> bool:
    """--async-scheduling: True (asked: it must take effect), False (off) or None (the default: on for a CUDA
    engine that supports it, as vLLM, which leaves it off on its CPU backend; on CPU the step's tokens are on
    the host when it returns, so there is nothing to overlap)."""
    if flag is None:
        return engine.device.type == "cuda" and _unsupported(engine) is None
    return flag


class AsyncScheduling:
    def __init__(self, engine) -> None:
        check_async_scheduling(engine)
        self.engine = engine
        self.in_flight: Optional[InFlightStep] = None

    def step(self) -> list["RequestOutput"]:
        e = self.engine
        t0 = time.perf_counter()
        prev, outputs = self.in_flight, []
        self.in_flight = None
        if prev is not None and (any(r.params.penalised for r in prev.sampling)
                                 or (e.structured.active and any(r.matcher is not None for r in prev.sampling))):
            # penalties and structured outputs' masks need its tokens on the host first
            outputs, prev = self._complete(prev), None
        sched = e.scheduler.schedule()
        launched, failed = None, False
        if not sched.is_empty:
            try:
                launched = self._launch(sched, prev)
            except torch.OutOfMemoryError:
                if not e.survive_step_oom:
                    raise
                failed = True
        if prev is not None:
            outputs += self._complete(prev)
        if launched is not None:
            e.scheduler.update(sched.scheduled)
            self.in_flight = launched
            e.record_step_time(sched, time.perf_counter() - t0)
        elif failed:  # as a plain step's (LLMEngine.fail_step), for the requests still unfinished
            outputs += e.fail_step(SchedulerOutput([s for s in sched.scheduled if not s.request.is_finished]))
        return outputs

    def _launch(self, sched: SchedulerOutput, prev: Optional[InFlightStep]) -> InFlightStep:
        e = self.engine
        pending = (prev.sample.tokens, prev.index_of()) if prev is not None and prev.sampling else None
        logits, rows = e.runner.execute(sched, e.kv, pending)
        logits = e.take_prompt_logprobs(sched, logits, len(rows))  # a step with prompt logprobs reads them back here
        e.activity.end_step()
        e.num_steps += 1
        step = InFlightStep(sched, [sched.scheduled[r].request for r in rows])
        if not step.sampling:
            return step
        masked = e.outputs.mask_min_tokens(logits, step.sampling)
        logits = e.structured.mask(masked, step.sampling, logits)  # constrained requests have no pending token
        params = [r.params for r in step.sampling]
        # a penalised request has no pending token here (step() completed the step that sampled it)
        histories = ([(r.prompt_token_ids, r.output_token_ids) for r in step.sampling]
                     if any(p.penalised for p in params) else None)
        step.sample = e.sampler.sample_device(logits, params, e.generators_of(step.sampling), histories)
        step.sample.start_copy()
        for r in step.sampling:
            r.num_pending_tokens += 1
        return step

    def _complete(self, step: InFlightStep) -> list["RequestOutput"]:
        if not step.sampling:
            return []
        sample = step.sample.result()  # the step's one blocking readback: its tokens' copy event
        for r in step.sampling:
            r.num_pending_tokens -= 1
        return self.engine.emit(step.sampling, sample)
