"""`bench serve` numbers: per-request timings -> vLLM's metrics, its result block, and JSON keys.

Definitions are vLLM's (benchmarks/serve.py), so results compare across engines:
  TTFT  arrival of the first chunk with text, from the request's start;
  ITL   time between consecutive chunks with text (all requests pooled);
  TPOT  per request, (latency - TTFT) / (output tokens - 1), over requests with more than one token;
  E2EL  request start to its last chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # the ones the result block prints (e2el is in the JSON)


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: Optional[int] = None  # from the stream's usage; else the number of text chunks
    num_chunks: int = 0
    generated_text: str = ""
    error: str = ""


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      percentiles: tuple[float, ...] = (99.0,)) -> dict:
    completed, total_input, output_lens, ttfts, tpots, itls, e2els = 0, 0, [], [], [], [], []
    for r in results:
        if not r.success:
            output_lens.append(0)
            continue
        n_out = r.output_tokens if r.output_tokens is not None else r.num_chunks
        output_lens.append(n_out)
        total_input += r.prompt_len
        if n_out > 1:
            tpots.append((r.latency - r.ttft) / (n_out - 1))
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        completed += 1
    total_output = int(sum(output_lens))
    m = {
        "duration": duration_s, "completed": completed, "failed": len(results) - completed,
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, values, percentiles))
    m["output_lens"] = output_lens
    return m


_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def format_result_block(m: dict, percentiles: tuple[float, ...] = (99.0,),
                        metrics: tuple[str, ...] = PERCENTILE_METRICS) -> str:
    """vLLM's "Serving Benchmark Result" block, formatted exactly as vLLM prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             "{:<40} {:<10}".format("Successful requests:", m["completed"]),
             "{:<40} {:<10.2f}".format("Benchmark duration (s):", m["duration"]),
             "{:<40} {:<10}".format("Total input tokens:", m["total_input_tokens"]),
             "{:<40} {:<10}".format("Total generated tokens:", m["total_output_tokens"]),
             "{:<40} {:<10.2f}".format("Request throughput (req/s):", m["request_throughput"]),
             "{:<40} {:<10.2f}".format("Output token throughput (tok/s):", m["output_throughput"]),
             "{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", m["total_token_throughput"])]
    for name in metrics:
        title, short = _TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", m[f"mean_{name}_ms"]))
        lines.append("{:<40} {:<10.2f}".format(f"Median {short} (ms):", m[f"median_{name}_ms"]))
        for p in percentiles:
            lines.append("{:<40} {:<10.2f}".format(f"P{p:g} {short} (ms):", m[f"p{p:g}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
