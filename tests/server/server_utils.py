"""Helpers for the server tests: a real uvicorn server in a background thread around a tiny model."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Optional

import httpx

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 128


def make_engine(model_dir, **overrides):
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    flags = dict(model=str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                 served_model_name=MODEL_NAME)
    flags.update(overrides)
    return LLMEngine(EngineConfig(**flags))


def slow_down(engine, seconds: float) -> None:
    """Make every engine step take at least `seconds` (so the timing of aborts can be checked in steps)."""
    step = engine.step

    def slow_step():
        out = step()
        time.sleep(seconds)
        return out

    engine.step = slow_step


class ServerThread:
    """`with ServerThread(engine, api_key=...) as s:` serves build_app(engine) on s.base_url; `uvicorn_kwargs`
    adds uvicorn.Config keywords (TLS: s.base_url is https then)."""

    def __init__(self, engine, uvicorn_kwargs: Optional[dict] = None, **app_kwargs) -> None:
        import uvicorn

        from pagedmoe.server.app import build_app

        self.engine = engine
        self.app = build_app(engine, **app_kwargs)
        self.bridge = self.app.state.bridge
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        scheme = "https" if (uvicorn_kwargs or {}).get("ssl_certfile") else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                                **(uvicorn_kwargs or {}))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="test-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{label="v",...}': value} (labels sorted, model_name dropped)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until the engine holds no request; return the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["pagedmoe:num_requests_running"] == 0 and m["pagedmoe:num_requests_waiting"] == 0
                    and m["pagedmoe:num_free_kv_blocks"] == m["pagedmoe:num_kv_blocks"]):
                return m
            assert time.monotonic() < deadline, f"the engine did not drain: {m}"
            time.sleep(0.02)


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert set(err) >= {"message", "type", "param", "code"}, body
    return err


class Tok(str):
    """A token in a forced-output grammar (token_grammar): that token, not its text."""


class Rx(str):
    """A regex in a forced-output grammar (token_grammar)."""


def token_grammar(parts: list, tokenizer) -> str:
    """A Lark grammar (llguidance's) for exactly `parts` in a row: text, Tok (that token: <[id]>), Rx (a regex). The
    tests force a random model's output with it (structured_outputs.grammar)."""
    out = []
    for part in parts:
        if isinstance(part, Tok):
            out.append(f"<[{tokenizer.convert_tokens_to_ids(str(part))}]>")
        elif isinstance(part, Rx):
            out.append(f"/{part}/")
        else:
            out.append(json.dumps(part, ensure_ascii=False))
    return "start: " + " ".join(out)
