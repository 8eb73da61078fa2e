"""Streaming for `pagedmoe generate` and `pagedmoe chat`: text printed as the engine produces it, rates
at the end (llama.cpp prints them too), logprobs as a table and as JSON.

Several prompts run in one batch; the output of the first unfinished one is streamed, the others are
buffered and streamed in turn (their text so far at once), so outputs never interleave.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

from pagedmoe.sampling_params import RequestOutput, SamplingParams


@dataclass
class Rates:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0

    def line(self) -> str:
        """llama.cpp-style timings: prompt processing and generation rates."""
        def rate(tokens: int, seconds: float) -> str:
            # no time of that kind (a one-token prompt runs in a decode step; max_tokens 1 has no decode step)
            return f"{tokens / seconds:.1f} tok/s" if seconds > 0 else "n/a tok/s"

        cached = f", {self.cached_tokens} cached" if self.cached_tokens else ""
        return (f"prompt: {self.prompt_tokens} tokens{cached}, {self.prefill_s:.2f} s, "
                f"{rate(self.prompt_tokens - self.cached_tokens, self.prefill_s)} | "
                f"generation: {self.generated_tokens} tokens, {self.decode_s:.2f} s, "
                f"{rate(self.decode_tokens, self.decode_s)} | total {self.wall_s:.2f} s")


def _holdback(params: SamplingParams) -> int:
    """Characters kept back while a request runs: text a stop string will still cut off is never printed."""
    return max((len(s) for s in params.stop), default=1) - 1


def stream(engine, prompts: list[tuple[Optional[str], list[int]]], params: SamplingParams, out: TextIO,
           before: Callable[[int], None] = lambda i: None,
           after: Callable[[int, RequestOutput], None] = lambda i, o: None) -> tuple[list[RequestOutput], Rates]:
    """Run the prompts, writing each one's text to `out` as it grows (`before(i)` first, `after(i, output)`
    once it is done). Returns the final outputs, in prompt order, and the rates."""
    import dataclasses

    params = dataclasses.replace(params, output_kind="cumulative")
    st0, hits0 = dict(engine.step_time), engine.kv.prefix_cache_hits
    t0 = time.perf_counter()
    rids = [f"cli-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    try:
        for rid, (text, ids) in zip(rids, prompts):
            engine.add_request(rid, text, params, prompt_token_ids=ids)
        index = {rid: i for i, rid in enumerate(rids)}
        latest: dict[int, RequestOutput] = {}
        printed, current, holdback = [0] * len(prompts), 0, _holdback(params)
        before(0)
        while current < len(prompts):
            for o in engine.step():
                latest[index[o.request_id]] = o
            while current in latest:
                o = latest[current]
                text = o.outputs[0].text
                end = len(text) if o.finished else len(text) - holdback
                if not o.finished and text.endswith("\ufffd"):
                    end = min(end, len(text) - 1)  # an incomplete UTF-8 character: wait for its next bytes
                if end > printed[current]:
                    out.write(text[printed[current]:end])
                    out.flush()
                    printed[current] = end
                if not o.finished:
                    break
                after(current, o)
                current += 1
                if current < len(prompts):
                    before(current)
            if not engine.has_unfinished_requests() and current < len(prompts) and current not in latest:
                raise RuntimeError("the engine finished without an output for a prompt")
    except BaseException:
        for rid in rids:
            engine.abort_request(rid)
        raise
    st = engine.step_time
    rates = Rates(prompt_tokens=sum(len(ids) for _, ids in prompts),
                  cached_tokens=engine.kv.prefix_cache_hits - hits0,
                  prefill_s=st["prefill_s"] - st0["prefill_s"],
                  generated_tokens=sum(len(latest[i].outputs[0].token_ids) for i in range(len(prompts))),
                  decode_tokens=st["decode_tokens"] - st0["decode_tokens"], decode_s=st["decode_s"] - st0["decode_s"],
                  wall_s=time.perf_counter() - t0)
    return [latest[i] for i in range(len(prompts))], rates


def logprobs_json(output: RequestOutput, num_top: int) -> Optional[list[dict]]:
    """Per generated token: its id, text, logprob and rank, and the `num_top` most likely tokens."""
    c = output.outputs[0]
    if c.logprobs is None:
        return None
    rows = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[tid]
        top = sorted((kv for kv in entry.items() if kv[1].rank <= num_top), key=lambda kv: kv[1].rank)[:num_top]
        rows.append({"token_id": tid, "token": chosen.decoded_token, "logprob": chosen.logprob, "rank": chosen.rank,
                     "top_logprobs": [{"token_id": t, "token": lp.decoded_token, "logprob": lp.logprob}
                                      for t, lp in top]})
    return rows


def format_logprobs(output: RequestOutput, num_top: int) -> str:
    """The logprobs as a table, one generated token per line."""
    lines = []
    for i, row in enumerate(logprobs_json(output, num_top) or []):
        alts = ", ".join(f"{a['token']!r} {a['logprob']:.3f}" for a in row["top_logprobs"])
        lines.append(f"{i:5d}  {row['token']!r:>16} {row['logprob']:9.4f}  (rank {row['rank']})  top: {alts}")
    return "\n".join(lines)
