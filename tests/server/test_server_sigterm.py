"""`python -m pagedmoe.cli serve` in a subprocess: SIGTERM lets the in-flight stream finish, then exit 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import pagedmoe
from server_utils import MAX_MODEL_LEN, MODEL_NAME


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_model_dir, tmp_path):
    port = _free_port()
    src = str(Path(pagedmoe.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedmoe.cli", "--log-level", "WARNING", "serve", str(tiny_model_dir),
         "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
         "--served-model-name", MODEL_NAME, "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the server exited early:\n" + (tmp_path / "server.log").read_text()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 30, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data: ")]
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    # The request that was running when the signal came finished normally.
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 30
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in (tmp_path / "server.log").read_text()
