"""Out of GPU memory in a step, injected on the CPU (issue 19 item 3): the request whose step fails gets a 500 with
the reason (a stream: an error event, then [DONE]); the server stays healthy and answers the next requests
correctly (tests/e2e/test_oom.py: the offline API and the start-up messages)."""
from __future__ import annotations

import json

import httpx

from fault_injection import OomOnce
from server_utils import MODEL_NAME, ServerThread, make_engine
from tiny_models import make_tiny_checkpoint


def test_server_survives_an_oom_in_a_step(tmp_path):
    make_tiny_checkpoint("qwen3_moe", tmp_path)
    engine = make_engine(tmp_path)
    execute = engine.runner.execute
    body = {"model": MODEL_NAME, "prompt": [4, 8, 15, 16], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ServerThread(engine) as s:
        url = s.base_url + "/v1/completions"
        good = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
        engine.runner.execute = OomOnce(execute, at=3)
        resp = httpx.post(url, json=body, timeout=60)
        assert resp.status_code == 500, resp.text
        err = resp.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_step_failed"
        assert err["message"].startswith("out of GPU memory while running a step of 1 request (1 token)")
        assert httpx.get(s.base_url + "/health", timeout=10).status_code == 200
        assert httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"] == good

        engine.runner.execute = OomOnce(execute, at=2)
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["message"].startswith("out of GPU memory while running a step")
        assert httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"] == good
        assert s.bridge.is_healthy
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert s.metrics()['pagedmoe:num_requests_aborted_total{reason="error"}'] == 2


def test_a_failed_step_adds_no_token_latency(tmp_path):
    """A request whose step fails got no token from it: no time-to-first-token (failed in its prefill) and no
    inter-token latency (failed in a decode step) is observed for it, only the abort with reason "error"."""
    make_tiny_checkpoint("qwen3_moe", tmp_path)
    engine = make_engine(tmp_path)
    execute = engine.runner.execute
    body = {"model": MODEL_NAME, "prompt": [4, 8, 15, 16], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    ttft, itl = "pagedmoe:time_to_first_token_seconds_count", "pagedmoe:inter_token_latency_seconds_count"
    with ServerThread(engine) as s:
        url = s.base_url + "/v1/completions"
        before = s.metrics()
        engine.runner.execute = OomOnce(execute, at=1)   # the prefill step: no first token
        assert httpx.post(url, json=body, timeout=60).status_code == 500
        m = s.wait_idle()
        assert m[ttft] == before[ttft] and m[itl] == before[itl]
        engine.runner.execute = OomOnce(execute, at=3)   # two tokens, then the third step fails
        assert httpx.post(url, json=body, timeout=60).status_code == 500
        m = s.wait_idle()
        assert m[ttft] == before[ttft] + 1 and m[itl] == before[itl] + 1
        assert m['pagedmoe:num_requests_aborted_total{reason="error"}'] == 2
        assert m["pagedmoe:e2e_request_latency_seconds_count"] == before["pagedmoe:e2e_request_latency_seconds_count"]
