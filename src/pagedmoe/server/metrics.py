"""Prometheus metrics: vLLM's names under the `pagedmoe:` prefix, plus the expert-paging state.

Two sources:
  - request latencies (TTFT, inter-token, end-to-end) and request counts: histograms/counters observed
    by the bridge as outputs arrive (`observe_*`, `count_*`; prometheus-client is thread-safe);
  - engine state (queue lengths, KV usage, token and preemption counters, paging state): read at
    scrape time from the bridge's last `engine.get_stats()` snapshot by `EngineStatsCollector`.

Paging keys in `get_stats()` (written by the expert-paging work; absent keys mean "every expert
resident, nothing moved"):
  expert_bytes_loaded_total       {tier: bytes}                    -> counter{tier}
      (else the pager's flat counters: expert_bytes_h2d -> tier "host", expert_bytes_d2d -> "resident",
       expert_bytes_decoded -> "compressed", expert_bytes_dequantized -> "quantized")
  experts                         {(tier, precision): count}, {"tier/precision": count}
                                  or {tier: {precision: count}}    -> gauge{tier, precision}
  expert_wait_seconds_total       float (else expert_wait_s)       -> counter
  expert_precision_changes_total  {direction: count}               -> counter{direction}
  expert_<tier>_bytes             bytes held by a tier             -> gauge expert_tier_bytes{tier}
  kv_blocks_withheld              KV blocks lent to experts        -> gauge expert_kv_blocks_lent
  expert_cache_hits / _misses     routed fetching's cache          -> counters expert_cache_hits_total,
                                                                      expert_cache_misses_total
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedmoe.engine.expert_stats import dtype_label

P = "pagedmoe:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, with finer low ends: a decode step on an H200 takes milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

DEFAULT_TIERS = ("compressed", "host")
DEFAULT_DIRECTIONS = ("up", "down")
PAGER_BYTE_COUNTERS = {"expert_bytes_h2d": "host", "expert_bytes_d2d": "resident", "expert_bytes_decoded": "compressed",
                       "expert_bytes_dequantized": "quantized"}
_TIER_BYTES = re.compile(r"^expert_(\w+?)_bytes$")


def count_resident_experts(engine) -> dict[tuple[str, str], int]:
    """Without paging stats: every expert of every MoE layer is resident at the model's dtype."""
    total = 0
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "modules"):
        # NOTE: duck-typed on the MoE layer (num_experts + stacked w13) so this file does not import models/.
        total = sum(int(m.num_experts) for m in model.modules()
                    if hasattr(m, "w13") and isinstance(getattr(m, "num_experts", None), int))
    return {("resident", dtype_label(getattr(engine, "dtype", "bf16"))): total}


def _experts_items(value) -> Iterable[tuple[str, str, float]]:
    for key, v in value.items():
        if isinstance(v, dict):  # {tier: {precision: count}}
            for precision, n in v.items():
                yield str(key), str(precision), float(n)
        elif isinstance(key, tuple) and len(key) == 2:
            yield str(key[0]), str(key[1]), float(v)
        else:  # "tier/precision"
            tier, _, precision = str(key).partition("/")
            yield tier, precision or "unknown", float(v)


def _bytes_loaded(s: dict) -> dict:
    if s.get("expert_bytes_loaded_total"):
        return s["expert_bytes_loaded_total"]
    out = {t: 0 for t in DEFAULT_TIERS}
    for key, tier in PAGER_BYTE_COUNTERS.items():
        if key in s:
            out[tier] = out.get(tier, 0) + s[key]
    return out


class EngineStatsCollector:
    """Gauges and counters built from the latest stats snapshot at each scrape."""

    def __init__(self, stats_fn: Callable[[], dict], model_name: str,
                 default_experts: dict[tuple[str, str], int]) -> None:
        self.stats_fn, self.model_name, self.default_experts = stats_fn, model_name, default_experts

    def describe(self):
        return []  # no registration-time collect: the engine may not be up yet

    def collect(self):
        s, m = self.stats_fn(), [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric(m, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric(m, float(value))
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.get("num_requests_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (including preempted ones).",
                    s.get("num_requests_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    s.get("kv_cache_usage_perc", 0.0))
        yield gauge("num_kv_blocks", "KV cache blocks in total.", s.get("num_kv_blocks", 0))
        yield gauge("num_free_kv_blocks", "KV cache blocks free.", s.get("num_free_kv_blocks", 0))
        yield counter("prompt_tokens_total", "Prompt tokens processed (a request's whole prompt, counted when its "
                      "prefill ends).", s.get("prompt_tokens_total", 0))
        yield counter("generation_tokens_total", "Tokens generated.", s.get("generation_tokens_total", 0))
        yield counter("num_preemptions_total", "Preemptions so far (recomputed or swapped).",
                      s.get("num_preemptions_total", 0))
        yield counter("num_swapped_preemptions_total", "Of those, preemptions whose KV went to the swap space.",
                      s.get("num_swapped_preemptions_total", 0))
        yield gauge("num_requests_swapped", "Preempted requests whose KV is in the swap space (vLLM 0.x's name).",
                    s.get("num_requests_swapped", 0))
        yield gauge("swap_space_usage_perc", "Fraction of the swap space's host blocks in use (1 = full).",
                    s.get("swap_space_usage_perc", 0.0))
        yield counter("num_engine_steps_total", "Engine steps run.", s.get("num_steps", 0))
        yield counter("prefix_cache_queries_total", "Prefix cache: tokens of admitted requests looked up.",
                      s.get("prefix_cache_queries_total", 0))
        yield counter("prefix_cache_hits_total", "Prefix cache: of those, tokens found cached (not computed).",
                      s.get("prefix_cache_hits_total", 0))
        if "device_memory_used_bytes" in s:   # CUDA: the process's device memory against --gpu-memory-gb
            yield gauge("device_memory_used_bytes", "Device memory the process holds (CUDA context, torch's pool, "
                        "VMM mappings), as the driver counts it.", s["device_memory_used_bytes"])
            yield gauge("device_memory_peak_bytes", "Peak of device_memory_used_bytes since start-up (polled).",
                        s["device_memory_peak_bytes"])
            yield gauge("gpu_memory_budget_bytes", "The --gpu-memory-gb budget the engine planned for.",
                        s["gpu_memory_budget_bytes"])

        loaded = CounterMetricFamily(P + "expert_bytes_loaded_total",
                                     "Expert bytes brought into the compute buffers, per source tier.",
                                     labels=["model_name", "tier"])
        for tier, n in _bytes_loaded(s).items():
            loaded.add_metric(m + [str(tier)], float(n))
        yield loaded

        held = GaugeMetricFamily(P + "expert_tier_bytes", "Bytes of expert weights each tier holds.",
                                 labels=["model_name", "tier"])
        for key, value in s.items():
            match = _TIER_BYTES.match(key)
            if match and isinstance(value, (int, float)):
                held.add_metric(m + [match.group(1)], float(value))
        yield held

        experts = GaugeMetricFamily(P + "experts", "Experts per tier and precision.",
                                    labels=["model_name", "tier", "precision"])
        for tier, precision, n in _experts_items(s.get("experts") or self.default_experts):
            experts.add_metric(m + [tier, precision], n)
        yield experts

        yield counter("expert_cache_hits_total", "Routed experts found in the GPU expert cache (--expert-fetch "
                      "routed; per layer and step; a stream step looks up every expert).",
                      s.get("expert_cache_hits", 0))
        yield counter("expert_cache_misses_total", "Experts fetched into the GPU expert cache (routed, or by a "
                      "stream step).", s.get("expert_cache_misses", 0))
        yield counter("expert_wait_seconds_total", "Seconds the compute stream waited for experts.",
                      s.get("expert_wait_seconds_total", s.get("expert_wait_s", 0.0)))

        changes = CounterMetricFamily(P + "expert_precision_changes_total",
                                      "Expert precision changes (up: promoted, down: demoted).",
                                      labels=["model_name", "direction"])
        for direction, n in (s.get("expert_precision_changes_total") or {d: 0 for d in DEFAULT_DIRECTIONS}).items():
            changes.add_metric(m + [str(direction)], float(n))
        yield changes

        # dynamic precision: KV blocks whose memory is lent to experts above --min-expert-precision
        yield gauge("expert_kv_blocks_lent", "KV cache blocks lent to expert weights (dynamic precision).",
                    s.get("kv_blocks_withheld", 0))


class ServerMetrics:
    """One registry per server (so several servers in one process, as in tests, do not collide)."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]
        self._ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", lab,
                               buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive tokens.", lab,
                              buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                              lab, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._prompt_len = Histogram(P + "request_prompt_tokens", "Prompt tokens per finished request.", lab,
                                     buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self._gen_len = Histogram(P + "request_generation_tokens", "Generated tokens per finished request.",
                                  lab, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self._success = Counter(P + "request_success", "Requests finished, by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self._aborted = Counter(P + "num_requests_aborted", "Requests aborted before finishing, by reason "
                                "(disconnect, timeout, client, error: their step failed).", lab + ["reason"], registry=r)
        self._rejected = Counter(P + "num_requests_rejected", "Requests refused, by reason (queue_full).",
                                 lab + ["reason"], registry=r)

    def attach_engine(self, stats_fn: Callable[[], dict], default_experts: dict[tuple[str, str], int]) -> None:
        self.registry.register(EngineStatsCollector(stats_fn, self.model_name, default_experts))

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, e2e_s: float, num_prompt_tokens: int, num_generated: int, reason) -> None:
        self._e2e.observe(e2e_s)
        self._prompt_len.observe(num_prompt_tokens)
        self._gen_len.observe(num_generated)
        self._success.labels(self.model_name, str(reason)).inc()

    def count_aborted(self, reason: str, n: int = 1) -> None:
        self._aborted.labels(self.model_name, reason).inc(n)

    def count_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
