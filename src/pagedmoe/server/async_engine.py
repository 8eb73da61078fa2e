"""The bridge between the HTTP handlers (asyncio) and the engine (one background thread).

NOTE: LLMEngine is not thread-safe, and a step blocks for as long as the model runs. So exactly one
thread, "pagedmoe-engine", ever calls into the engine. Handlers never touch it: they append commands
(add / abort) to a deque and wake the thread; the thread applies all pending commands between two
steps, and hands each step's outputs back to the event loop with ONE loop.call_soon_threadsafe, where
they are routed to their requests' handles. Hence:
  - an abort (client gone, timeout) is applied before the next step starts: the request's KV blocks are
    free within one engine step of the handler noticing;
  - the waiting-queue bound is checked on the loop thread against the last stats snapshot plus the adds
    not yet applied, so concurrent handlers cannot overshoot it (the loop is single-threaded);
  - the engine's stats are read in the engine thread (`get_stats()` after commands and after each
    step) and published as one dict; /metrics reads that snapshot, never the live engine.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from pagedmoe.sampling_params import RequestOutput, SamplingParams

logger = logging.getLogger("pagedmoe.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (a step raised, or the server is shutting down)."""


class OverloadedError(RuntimeError):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine failed the request's step (out of GPU memory); the engine serves on (answered 500)."""


@dataclass
class _Track:
    """Per-request timing, kept by the engine thread for the latency histograms."""

    arrival: float
    num_prompt_tokens: int
    last_token: Optional[float] = None


class AsyncEngine:
    def __init__(self, engine, max_waiting_requests: Optional[int] = 1024,
                 request_timeout: Optional[float] = None, metrics=None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests or None  # 0 / None: unbounded
        self.request_timeout = request_timeout or None
        self.metrics = metrics
        self.on_dead: Optional[Callable[[BaseException], None]] = None  # called on the loop thread
        self.dead: Optional[BaseException] = None
        self.stats: dict = dict(engine.get_stats())
        # Loop-thread state.
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._streams: dict[str, tuple["RequestHandle", int]] = {}
        # Adds queued but not yet taken by the engine thread. NOTE: the engine thread lowers it in the
        # same locked step as it publishes the stats that count those requests, so waiting = stats +
        # pending never counts a request twice or not at all.
        self._lock = threading.Lock()
        self._num_pending_adds = 0
        # Shared state: deque appends/pops and Event are thread-safe.
        self._commands: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._finish_times: collections.deque = collections.deque(maxlen=512)
        # Engine-thread state.
        self._tracks: dict[str, _Track] = {}

    # -- lifecycle (loop thread) -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedmoe-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is still queued or running, stop the engine thread and wait for it."""
        self._stopping = True
        self._wakeup.set()
        deadline = time.monotonic() + timeout_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._thread is not None and self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))

    def refuse_all(self, reason: str) -> None:
        """Answer every open request with EngineDeadError(reason) (503; a started stream: an error event and
        [DONE]) and take no new ones; the engine thread aborts what it holds and stops."""
        self._stopping = True
        self._wakeup.set()
        self._fail_all(EngineDeadError(reason))

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return int(self.stats.get("num_requests_waiting", 0)) + self._num_pending_adds

    def stats_snapshot(self) -> dict:
        stats = dict(self.stats)
        stats["num_requests_waiting"] = self.num_waiting
        return stats

    # -- requests (loop thread) ------------------------------------------------------------------
    def check_capacity(self, num_new: int) -> None:
        if self.dead is not None or self._stopping:
            raise EngineDeadError("the engine is not running" + (f" ({self.dead!r})" if self.dead else ""))
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + num_new > limit:
            raise OverloadedError(f"the server is overloaded: {self.num_waiting} requests are waiting "
                                  f"(--max-waiting-requests {limit}); retry later", self._retry_after_s())

    def _retry_after_s(self) -> int:
        """Seconds until the queue has likely drained: waiting requests / the completion rate over the last 30 s,
        measured over the span those completions cover (at least 1 s): a server that has been finishing
        requests for 2 s is not taken as 15x slower than it is."""
        now, window = time.monotonic(), 30.0
        recent = [t for t in list(self._finish_times) if now - t < window]   # in completion order
        if not recent:
            return 1
        rate = len(recent) / max(1.0, now - recent[0])
        return int(min(60, max(1, math.ceil(self.num_waiting / rate))))

    def submit(self, request_id: str, prompts: list[tuple[Optional[str], list[int]]],
               params: Union[SamplingParams, list[SamplingParams]], arrival: Optional[float] = None
               ) -> "RequestHandle":
        """Queue one engine request per prompt (ids `{request_id}-{i}`; `params` one for all, or one per
        prompt) and return their handle.

        Synchronous on purpose: the capacity check and the enqueue happen in one go on the loop thread,
        so concurrent handlers cannot overshoot --max-waiting-requests. The caller must see that
        `handle.close()` runs however the HTTP exchange ends (it is idempotent).
        """
        arrival = time.monotonic() if arrival is None else arrival
        self.check_capacity(len(prompts))
        handle = RequestHandle(self, [f"{request_id}-{i}" for i in range(len(prompts))],
                               arrival + self.request_timeout if self.request_timeout else None)
        for i, rid in enumerate(handle.rids):
            self._streams[rid] = (handle, i)  # registered before the add: no output can be missed
        with self._lock:
            self._num_pending_adds += len(prompts)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        for rid, (text, ids), p in zip(handle.rids, prompts, per_prompt):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._commands.append(("add", rid, text, ids, p, arrival, fut))
            handle.add_futures.append(asyncio.wrap_future(fut))
        self._wakeup.set()
        return handle

    def _release(self, handle: "RequestHandle", reason: str) -> None:
        for fut in handle.add_futures:
            fut.cancel()  # an add the engine thread has not taken yet is dropped there
        for rid in handle.rids:
            self._streams.pop(rid, None)
        refused = [f.done() and not f.cancelled() and f.exception() is not None for f in handle.add_futures]
        unfinished = [rid for rid, done, bad in zip(handle.rids, handle.finished, refused) if not (done or bad)]
        if unfinished and self.dead is None:
            # NOTE: counted by the engine thread, which alone knows whether the request finished meanwhile
            for rid in unfinished:
                self._commands.append(("abort", rid, reason))
            self._wakeup.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                target[0].put(target[1], out)

    def _fail_all(self, exc: BaseException) -> None:
        for handle in {id(h): h for h, _ in self._streams.values()}.values():
            handle.fail(exc)

    def _on_engine_dead(self, exc: BaseException) -> None:
        self._fail_all(EngineDeadError(f"the engine stopped: {exc!r}"))
        if self.on_dead is not None:
            self.on_dead(exc)

    def _call_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wakeup.clear()
                self._apply_commands()
                if self._stopping:
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
                    self._tracks.clear()
                    self.stats = dict(engine.get_stats())
                    return
                if not engine.has_unfinished_requests():
                    # idle: a dead tensor-parallel rank is found within a second, not at the next request
                    self._wakeup.wait(1.0)
                    engine.check_health()
                    continue
                steps_before = engine.num_steps
                outputs = engine.step()
                now = time.monotonic()
                self._record(outputs, now)
                self.stats = dict(engine.get_stats())
                if outputs:
                    self._call_loop(self._dispatch, outputs)
                if engine.num_steps == steps_before and not outputs:
                    self._wakeup.wait(0.005)  # nothing could be scheduled: do not spin
        except BaseException as exc:  # noqa: BLE001 - a dead engine must be reported, whatever killed it
            logger.exception("the engine thread stopped")
            self.dead = exc
            if self._loop is not None:
                self._call_loop(self._on_engine_dead, exc)

    def _apply_commands(self) -> None:
        """Apply queued adds/aborts in order; publish stats before resolving the adds' futures."""
        resolved, applied, num_adds = [], False, 0
        while self._commands:
            cmd = self._commands.popleft()
            applied = True
            if cmd[0] == "abort":
                _, rid, reason = cmd
                self.engine.abort_request(rid)
                # a request is counted once: here if it has not finished (its track is still there), else in _record
                if self._tracks.pop(rid, None) is not None and self.metrics is not None:
                    self.metrics.count_aborted(reason)
                continue
            _, rid, text, ids, params, arrival, fut = cmd
            num_adds += 1
            if not fut.set_running_or_notify_cancel():
                # the handler went away before we got here: never added, but counted as aborted by the
                # abort queued behind this add
                self._tracks[rid] = _Track(arrival, len(ids))
                continue
            try:
                self.engine.add_request(rid, text, params, prompt_token_ids=ids)
            except Exception as e:  # noqa: BLE001 - bad input goes back to the handler as a 400
                resolved.append((fut, e))
                continue
            self._tracks[rid] = _Track(arrival, len(ids))
            resolved.append((fut, None))
        if applied:
            stats = dict(self.engine.get_stats())
            with self._lock:
                self.stats = stats
                self._num_pending_adds -= num_adds
            for fut, err in resolved:
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)

    def _record(self, outputs: list[RequestOutput], now: float) -> None:
        m = self.metrics
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue
            if m is not None and out.error is None:  # a failed step's output carries no new token
                if track.last_token is None:
                    m.observe_ttft(now - track.arrival)
                else:
                    m.observe_itl(now - track.last_token)
            track.last_token = now
            if out.finished:
                self._tracks.pop(out.request_id, None)
                self._finish_times.append(now)
                if m is not None and out.error is not None:
                    m.count_aborted("error")  # its step failed (out of GPU memory): not a success
                elif m is not None:
                    m.observe_finished(now - track.arrival, track.num_prompt_tokens,
                                       len(out.outputs[0].token_ids), out.outputs[0].finish_reason)


class RequestHandle:
    """The prompts of one HTTP request inside the engine: iterate `outputs()`, then `close()`."""

    def __init__(self, bridge: AsyncEngine, rids: list[str], deadline: Optional[float]) -> None:
        self.bridge, self.rids, self.deadline = bridge, rids, deadline
        # NOTE: only the newest output per prompt is kept (outputs carry everything so far), so a client
        # that stops reading costs one output per prompt, not one per token.
        self._latest: dict[int, RequestOutput] = {}
        self._error: Optional[BaseException] = None
        self._ready = asyncio.Event()
        self.add_futures: list[asyncio.Future] = []
        self.finished = [False] * len(rids)
        self._closed = False

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, newest output) until every prompt has finished.

        Outputs carry the full text and tokens so far; when the consumer falls behind, only the newest
        output per prompt is yielded. Leaving early (cancelled on a disconnect, a timeout, an error)
        aborts what has not finished.
        """
        reason = "client"
        try:
            results = await self._wait(asyncio.gather(*self.add_futures, return_exceptions=True))
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            remaining = len(self.rids)
            while remaining:
                await self._wait(self._ready.wait())
                self._ready.clear()
                if self._error is not None:
                    raise self._error
                if self._closed:
                    # closed from outside (its client left). NOTE: the handler's task is cancelled too, but
                    # before Python 3.12 asyncio.wait_for (--request-timeout) can lose that cancel (gh-86296)
                    return
                latest, self._latest = self._latest, {}
                for i in sorted(latest):
                    if latest[i].error is not None:
                        self.finished[i] = True  # the engine has dropped it: nothing to abort
                        raise RequestFailedError(latest[i].error)
                    if latest[i].finished and not self.finished[i]:
                        self.finished[i] = True
                        remaining -= 1
                    yield i, latest[i]
        except asyncio.CancelledError:
            reason = "disconnect"
            raise
        except RequestTimeoutError:
            reason = "timeout"
            raise
        except RequestFailedError:
            reason = "error"    # a sample's step failed: its siblings end with it, not by the client's doing
            raise
        finally:
            self.close(reason)

    async def _wait(self, awaitable):
        if self.deadline is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, max(0.0, self.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"the request did not finish within --request-timeout "
                                      f"{self.bridge.request_timeout:g} s") from None

    def put(self, index: int, output: RequestOutput) -> None:
        self._latest[index] = output
        self._ready.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._ready.set()

    def close(self, reason: str = "client") -> None:
        """Abort every prompt that has not finished (idempotent)."""
        if not self._closed:
            self._closed = True
            self.bridge._release(self, reason)
            self._ready.set()  # outputs() ends
