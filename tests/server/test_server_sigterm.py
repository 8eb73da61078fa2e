"""`python -m pagedmoe.cli serve` in a subprocess: SIGTERM lets the in-flight stream finish, then exit 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import pagedmoe
from server_utils import MAX_MODEL_LEN, MODEL_NAME


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(log, *args) -> tuple[subprocess.Popen, str]:
    """Start `pagedmoe serve *args` and wait for /health; return the process and its base URL."""
    port = _free_port()
    src = str(Path(pagedmoe.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedmoe.cli", "--log-level", "WARNING", "serve", *args, "--port", str(port),
         "--served-model-name", MODEL_NAME, "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, "the server exited early:\n" + Path(log.name).read_text()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_model_dir, tmp_path):
    log = open(tmp_path / "server.log", "w+")
    proc = None
    try:
        proc, base = _serve(log, str(tiny_model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4")
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 30, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    # The request that was running when the signal came finished normally.
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 30
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_requests_left_at_the_shutdown_timeout_are_answered_503(tmp_path):
    """SIGTERM with requests that cannot finish within --shutdown-timeout: each is answered (a 503
    engine_unavailable body; a started stream: an error event, then [DONE]) and the process exits 0. uvicorn
    used to cancel them: a plain-text 'Internal Server Error', a stream cut without [DONE], a traceback each."""
    log = open(tmp_path / "server.log", "w+")
    proc = None
    # The embedded model on the CPU, 2000 tokens each: far more than one second of steps.
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 2000, "ignore_eos": True}
    try:
        proc, base = _serve(log, "--device", "cpu", "--max-num-seqs", "1", "--shutdown-timeout", "1")
        plain: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: plain.append(
            httpx.post(base + "/v1/completions", json=body, timeout=60)))
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
            lines = resp.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]  # it runs now
            waiting.start()  # it waits behind the stream (--max-num-seqs 1)
            deadline = time.monotonic() + 30
            while f'pagedmoe:num_requests_waiting{{model_name="{MODEL_NAME}"}} 1.0' not in httpx.get(base + "/metrics").text:
                assert time.monotonic() < deadline, "the second request did not reach the queue"
                time.sleep(0.05)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        waiting.join(timeout=60)
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
        assert time.monotonic() - t0 < 10
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "engine_unavailable" and "shutting down" in err["message"], err
    assert len(plain) == 1 and plain[0].status_code == 503, (plain[0].status_code, plain[0].text)
    assert plain[0].json()["error"]["code"] == "engine_unavailable"
    assert "Traceback" not in (tmp_path / "server.log").read_text()
