"""Sampling values inside the accepted ranges but at their extremes: each request is answered, and the
engine thread (shared by every request) survives them. Each test has its own server: a failure here
kills the engine."""
from __future__ import annotations

import httpx

from server_utils import ServerThread, make_engine, slow_down

LONG = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}


def _alongside_a_running_request(tiny_model_dir, running_extra: dict, body: dict) -> httpx.Response:
    """POST `body` to /v1/completions while another request (with `running_extra`) is being decoded, so both
    are sampled in the same steps; check that both finish and the server stays healthy."""
    engine = make_engine(tiny_model_dir, max_num_seqs=4)
    slow_down(engine, 0.01)
    with ServerThread(engine) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={**LONG, **running_extra}) as running:
                lines = running.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # it is being decoded now
                resp = client.post("/v1/completions", json=body)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and '"error"' not in rest[-2], rest[-2:]
            assert client.get("/health").status_code == 200
            again = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert again.status_code == 200, again.text
    return resp


def test_top_k_larger_than_int64_beside_another_top_k(tiny_model_dir):
    # top_k >= vocabulary keeps every token; a batch row with a real top_k must not turn it into a tensor
    # overflow that stops the engine.
    resp = _alongside_a_running_request(tiny_model_dir, {"top_k": 5},
                                        {"prompt": "hi", "max_tokens": 3, "top_k": 2 ** 70})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def test_tiny_repetition_penalty(tiny_model_dir):
    # repetition_penalty is accepted in (0, 100]: a seen token's positive logit is divided by it, which at
    # 1e-39 (0 in float32) made it +inf and the softmax NaN, and the step raised.
    for penalty, temperature in ((1e-39, 1.0), (1e-30, 0.5)):
        body = {"prompt": "hi hi hi", "max_tokens": 3, "repetition_penalty": penalty, "temperature": temperature}
        resp = _alongside_a_running_request(tiny_model_dir, {}, body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
