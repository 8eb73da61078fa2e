"""API key, a full waiting queue (503 + Retry-After), the per-request timeout (504), and the metrics' names."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from server_utils import MODEL_NAME, ServerThread, assert_openai_error, make_engine, slow_down

openai = pytest.importorskip("openai")  # the serve extra; the GPU machine has none

LONG = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True}


def test_api_key(tiny_model_dir):
    with ServerThread(make_engine(tiny_model_dir, max_num_seqs=4), api_key="sekret") as server:
        url = server.base_url
        assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}), 401)
        err = assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"},
                                             headers={"Authorization": "Bearer wrong"}), 401)
        assert err["code"] == "invalid_api_key"
        assert_openai_error(httpx.get(url + "/v1/models", headers={"Authorization": "Basic sekret"}), 401)
        assert_openai_error(httpx.post(url + "/tokenize", json={"prompt": "hi"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        # Health and metrics stay open for probes and scrapers.
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def test_full_waiting_queue_answers_503_with_retry_after(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    slow_down(engine, 0.02)
    with ServerThread(engine, max_waiting_requests=1) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as c1, \
                httpx.Client(base_url=server.base_url, timeout=30) as c2:
            with c1.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
                # NOTE: keep the line iterator: when it is garbage-collected, httpx closes the connection.
                running_lines = running.iter_lines()
                next(line for line in running_lines if line.startswith("data: "))  # it runs now
                with c2.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as waiting:
                    assert waiting.status_code == 200
                    assert server.bridge.num_waiting == 1  # max_num_seqs=1: the second one waits
                    resp = httpx.post(server.base_url + "/v1/completions", json=LONG, timeout=30)
                    err = assert_openai_error(resp, 503)
                    assert err["code"] == "server_overloaded"
                    assert int(resp.headers["Retry-After"]) >= 1
                    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                                      json={"messages": [{"role": "user", "content": "x"}], "stream": True})
                    assert_openai_error(chat, 503)
        # Both clients hung up: the running and the waiting request are gone, every block is free.
        m = server.wait_idle()
        assert m['pagedmoe:num_requests_rejected_total{reason="queue_full"}'] == 2
        assert m['pagedmoe:num_requests_aborted_total{reason="disconnect"}'] == 2
        r = httpx.post(server.base_url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200


def test_request_timeout(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=4)
    slow_down(engine, 0.02)
    with ServerThread(engine, request_timeout=0.3) as server:
        resp = httpx.post(server.base_url + "/v1/completions", json=LONG, timeout=30)
        assert assert_openai_error(resp, 504)["code"] == "request_timeout"
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**LONG, "stream": True},
                          timeout=30) as stream:
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        m = server.wait_idle()
        assert m['pagedmoe:num_requests_aborted_total{reason="timeout"}'] == 2
        assert not engine.requests


def test_metrics_names_and_paging_defaults(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                                              "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    m = server.wait_idle()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "expert_wait_seconds_total"):
        assert "pagedmoe:" + name in m, name
    assert m["pagedmoe:prompt_tokens_total"] >= 3 and m["pagedmoe:generation_tokens_total"] >= 4
    assert m["pagedmoe:inter_token_latency_seconds_count"] >= 3
    # Without paging (the default placement): every expert (2 layers x 8) resident, nothing loaded.
    resident = {k: v for k, v in m.items() if k.startswith("pagedmoe:experts{") and 'tier="resident"' in k}
    assert sum(resident.values()) == 2 * 8, resident
    assert sum(v for k, v in m.items() if k.startswith("pagedmoe:experts{")) == 2 * 8
    # the precision label is the dtype the experts are held in (float32 on the CPU), not the table's "bf16"
    assert str(server.engine.dtype) == "torch.float32"
    assert m['pagedmoe:experts{precision="fp32",tier="resident"}'] == 2 * 8
    assert m['pagedmoe:expert_bytes_loaded_total{tier="host"}'] == 0
    assert m['pagedmoe:expert_precision_changes_total{direction="down"}'] == 0


def test_paging_stats_are_exported():
    from prometheus_client.parser import text_string_to_metric_families

    from pagedmoe.server.metrics import ServerMetrics

    stats = {"num_requests_running": 3, "expert_bytes_loaded_total": {"host": 1024, "compressed": 2048},
             "experts": {("resident", "bf16"): 100, ("host", "bf16"): 20, ("compressed", "lossless"): 8},
             "expert_wait_seconds_total": 1.5, "expert_precision_changes_total": {"down": 4, "up": 1}}
    metrics = ServerMetrics("m")
    metrics.attach_engine(lambda: stats, {("resident", "bf16"): 128})
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples[("pagedmoe:num_requests_running", ())] == 3
    assert samples[("pagedmoe:expert_bytes_loaded_total", (("tier", "compressed"),))] == 2048
    assert samples[("pagedmoe:experts", (("precision", "lossless"), ("tier", "compressed")))] == 8
    assert ("pagedmoe:experts", (("precision", "bf16"), ("tier", "resident"))) in samples
    assert samples[("pagedmoe:experts", (("precision", "bf16"), ("tier", "resident")))] == 100
    assert samples[("pagedmoe:expert_wait_seconds_total", ())] == 1.5
    assert samples[("pagedmoe:expert_precision_changes_total", (("direction", "down"),))] == 4
    stats["experts"] = {"host": {"int4": 7}}  # the nested form
    text = metrics.render().decode()
    assert 'pagedmoe:experts{model_name="m",precision="int4",tier="host"} 7.0' in text


def test_pager_flat_stats_are_exported():
    """The pager's own counters (expert_bytes_h2d, expert_wait_s, expert_<tier>_bytes) map onto the metrics."""
    from pagedmoe.server.metrics import ServerMetrics

    stats = {"expert_bytes_h2d": 4096, "expert_bytes_d2d": 512, "expert_wait_s": 0.25,
             "experts": {"resident/bf16": 6, "host/bf16": 2}, "expert_host_bytes": 1000, "expert_resident_bytes": 3000}
    metrics = ServerMetrics("m")
    metrics.attach_engine(lambda: stats, {("resident", "bf16"): 8})
    text = metrics.render().decode()
    for line in ('pagedmoe:expert_bytes_loaded_total{model_name="m",tier="host"} 4096.0',
                 'pagedmoe:expert_bytes_loaded_total{model_name="m",tier="resident"} 512.0',
                 'pagedmoe:expert_bytes_loaded_total{model_name="m",tier="compressed"} 0.0',
                 'pagedmoe:expert_wait_seconds_total{model_name="m"} 0.25',
                 'pagedmoe:experts{model_name="m",precision="bf16",tier="host"} 2.0',
                 'pagedmoe:expert_tier_bytes{model_name="m",tier="host"} 1000.0',
                 'pagedmoe:expert_tier_bytes{model_name="m",tier="resident"} 3000.0'):
        assert line in text, line


def test_quantized_tier_bytes_are_loaded_bytes(tiny_model_dir):
    """--expert-precision static-int4: every expert sits in the quantized tier and is dequantised into the
    compute buffers each step; expert_bytes_loaded_total counts those bytes under tier="quantized"."""
    engine = make_engine(tiny_model_dir, max_num_seqs=4, expert_placement="paged", expert_precision="static-int4")
    with ServerThread(engine) as server:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                                  "ignore_eos": True}, timeout=30)
        assert r.status_code == 200
        m = server.wait_idle()
    assert m['pagedmoe:experts{precision="int4",tier="quantized"}'] == 2 * 8
    loaded = m['pagedmoe:expert_bytes_loaded_total{tier="quantized"}']
    assert loaded == engine.get_stats()["expert_bytes_dequantized"] > 0


def test_engine_failure_is_reported_not_hung(tiny_model_dir):
    """A step that raises kills the engine thread: open and new requests get 503, /health turns 503."""
    engine = make_engine(tiny_model_dir, max_num_seqs=4)

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.step = broken_step
    with ServerThread(engine) as server:
        dead = []
        server.bridge.on_dead = dead.append
        resp = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert assert_openai_error(resp, 503)["code"] == "engine_unavailable"
        assert "simulated device failure" in resp.json()["error"]["message"]
        assert len(dead) == 1 and isinstance(dead[0], RuntimeError)
        assert_openai_error(httpx.get(server.base_url + "/health"), 503)
        again = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert_openai_error(again, 503)


def _tp_worker_pid() -> int:
    """The pid of the one tensor-parallel rank this process started."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if ppid == os.getpid() and b"pagedmoe.parallel.worker" in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank in /proc")
def test_dead_tensor_parallel_rank_is_reported_while_idle(tiny_model_dir):
    """--tensor-parallel-size 2 and rank 1 killed while the server is idle: within seconds the engine is reported
    dead, naming the rank (`pagedmoe serve` then exits 1), and /health turns 503; it used to answer 200 until the
    next request failed with gloo's "Connection closed by peer"."""
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2, device="cpu")
    try:
        with ServerThread(engine) as server:
            dead = []
            server.bridge.on_dead = dead.append
            assert httpx.get(server.base_url + "/health").status_code == 200
            os.kill(_tp_worker_pid(), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dead and "tensor-parallel rank 1" in str(dead[0]), dead
            assert_openai_error(httpx.get(server.base_url + "/health"), 503)
    finally:
        engine.shutdown()


def test_swap_space_metrics(tiny_model_dir):
    """Eight concurrent requests in a KV cache of 10 blocks of 8 preempt; with --swap-space every victim's KV goes
    to the host and back: the counters say so, the gauges are back at 0 once the engine is idle, and every request
    gets its tokens (greedy: the same as the tokens of an engine that never preempts)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[(5 * i + j) % 300 + 1 for j in range(20)] for i in range(8)]

    def run(engine):
        with ServerThread(engine) as server:
            def one(p):
                r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
                    "prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(one, prompts))
            return got, server.wait_idle()

    got, m = run(make_engine(tiny_model_dir, max_model_len=64, block_size=8, num_kv_blocks=10, swap_space=0.01))
    assert m["pagedmoe:num_preemptions_total"] > 0
    assert m["pagedmoe:num_swapped_preemptions_total"] == m["pagedmoe:num_preemptions_total"]
    assert m["pagedmoe:num_requests_swapped"] == 0 and m["pagedmoe:swap_space_usage_perc"] == 0
    assert all(n == 20 for _, n in got)
    reference, m0 = run(make_engine(tiny_model_dir, max_model_len=64))
    assert m0["pagedmoe:num_preemptions_total"] == 0 and m0["pagedmoe:num_swapped_preemptions_total"] == 0
    assert got == reference


def test_request_larger_than_the_waiting_bound_is_a_400(tiny_model_dir):
    # 503 + Retry-After means "retry later"; a request with more sequences (prompts x n) than
    # --max-waiting-requests could never be admitted, however long the client waits.
    with ServerThread(make_engine(tiny_model_dir, max_num_seqs=4), max_waiting_requests=4) as server:
        url = server.base_url + "/v1/completions"
        err = assert_openai_error(httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "n": 5}, timeout=30), 400)
        assert err["param"] == "n" and "--max-waiting-requests 4" in err["message"]
        err = assert_openai_error(httpx.post(url, json={"prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2},
                                             timeout=30), 400)
        assert err["param"] == "n"
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 5})
        assert_openai_error(chat, 400)
        r = httpx.post(url, json={"prompt": ["a", "b"], "max_tokens": 2, "n": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        assert server.metrics().get('pagedmoe:num_requests_rejected_total{reason="queue_full"}', 0) == 0


def test_retry_after_uses_the_rate_over_the_span_observed(monkeypatch):
    # 20 completions in the last 2 s drain 20 waiting requests in ~2 s: Retry-After 2, not 30 (the old rule
    # divided by the whole 30 s window right after start-up or an idle spell)
    from pagedmoe.server import async_engine

    class Idle:
        def get_stats(self):
            return {"num_requests_waiting": 20}

    bridge = async_engine.AsyncEngine(Idle())
    now = 1000.0
    monkeypatch.setattr(async_engine.time, "monotonic", lambda: now)
    bridge._finish_times.extend(now - 2.0 + 0.1 * i for i in range(20))
    assert bridge._retry_after_s() == 2
    bridge._finish_times.clear()
    bridge._finish_times.extend([now - 40.0, now - 0.2])   # one old completion outside the window, one recent
    assert bridge._retry_after_s() == 20                   # one a second at most (the span's 1 s floor)
