"""`pagedmoe serve [MODEL]`: load the engine, then run the OpenAI-compatible server under uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any, Optional

from pagedmoe.config import add_engine_args, engine_config_from_args, env_default, parse_bool
from pagedmoe.server.deployment import UVICORN_LOG_LEVELS

logger = logging.getLogger("pagedmoe.server")


def _env(name: str, conv, default: Any, expected: Optional[str] = None) -> Any:
    """Server flags follow the engine flags' rule: PAGEDMOE_<FLAG_NAME> sets the default, the flag wins."""
    return env_default(name, conv, default, expected=expected)


def _optional_float(text: str) -> Optional[float]:
    return None if text.lower() in ("", "none", "0") else float(text)


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                                   "/metrics). Server flags also read PAGEDMOE_<FLAG_NAME>.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the embedded model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=_env("host", str, "127.0.0.1"),
                   help="address to bind (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=_env("port", int, 8000))
    g.add_argument("--api-key", default=_env("api_key", str, None),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize")
    g.add_argument("--max-waiting-requests", type=int, default=_env("max_waiting_requests", int, 1024),
                   help="answer 503 with Retry-After when this many requests wait for the engine (0: no bound)")
    g.add_argument("--request-timeout", type=_optional_float,
                   default=_env("request_timeout", _optional_float, None, "a number of seconds or none"),
                   help="seconds a request may take from arrival to its last token (default: no limit); "
                        "past it the request is aborted and answered 504")
    g.add_argument("--shutdown-timeout", type=float, default=_env("shutdown_timeout", float, 30.0),
                   help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   default=_env("enable_auto_tool_choice", parse_bool, False),
                   help='tool_choice "auto" (the default when a request gives tools): the model may call tools, '
                        "found in its text by --tool-call-parser")
    g.add_argument("--tool-call-parser", default=_env("tool_call_parser", str, None),
                   help="the format of the model's tool calls, for --enable-auto-tool-choice (vLLM's names): "
                        "hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes), mistral ([TOOL_CALLS]: "
                        "Mistral, Mixtral), deepseek_v3 (DeepSeek-V3, R1), deepseek_v31 (DeepSeek-V3.1), "
                        "glm45 (GLM-4.5, GLM-4.6)")
    g.add_argument("--reasoning-parser", default=_env("reasoning_parser", str, None),
                   help="move the model's thinking (<think>...</think>) out of the chat reply's content into its "
                        "reasoning and reasoning_content fields (vLLM's names): qwen3 (Qwen3), deepseek_r1 "
                        "(DeepSeek-R1), deepseek_v3 (DeepSeek-V3.1: with chat_template_kwargs thinking true), "
                        "glm45 (GLM-4.5, GLM-4.6)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   default=_env("trust_request_chat_template", parse_bool, False),
                   help="render a chat_template a request sends (its text) instead of refusing it with a 400 "
                        "(vLLM's flag; a template runs in Jinja's sandbox)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   default=_env("disable_uvicorn_access_log", parse_bool, False))
    d = p.add_argument_group("deployment (vLLM's flags)")
    for name, default in (("origins", '["*"]'), ("methods", '["*"]'), ("headers", '["*"]')):
        d.add_argument(f"--allowed-{name}", default=_env(f"allowed_{name}", str, default),
                       help=f"CORS: the allowed {name}, a JSON list of strings (default {default})")
    d.add_argument("--allowed-credentials", action="store_true",
                   default=_env("allowed_credentials", parse_bool, False),
                   help="CORS: let browsers send credentials (cookies, Authorization) cross-origin")
    d.add_argument("--ssl-keyfile", default=_env("ssl_keyfile", str, None), help="TLS: the private key file")
    d.add_argument("--ssl-certfile", default=_env("ssl_certfile", str, None), help="TLS: the certificate file")
    d.add_argument("--ssl-ca-certs", default=_env("ssl_ca_certs", str, None),
                   help="TLS: CA certificates to check client certificates against")
    d.add_argument("--ssl-cert-reqs", type=int, default=_env("ssl_cert_reqs", int, 0),
                   help="TLS: client certificates, as Python's ssl module: 0 none, 1 optional, 2 required")
    d.add_argument("--root-path", default=_env("root_path", str, ""),
                   help="the path prefix a reverse proxy serves the API under (e.g. /llm); requests are answered "
                        "with or without it")
    d.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS,
                   default=env_default("uvicorn_log_level", str.lower, None, choices=UVICORN_LOG_LEVELS),
                   help="uvicorn's log level (default: the global --log-level)")
    d.add_argument("--enable-log-requests", action="store_true",
                   default=_env("enable_log_requests", parse_bool, False),
                   help="log each request at INFO: its id, prompt lengths and sampling parameters")
    d.add_argument("--max-log-len", type=int, default=_env("max_log_len", int, None),
                   help="with --enable-log-requests, also log each prompt's first N characters (default: no prompt "
                        "text)")
    add_engine_args(p)  # includes --served-model-name
    p.set_defaults(func=run_serve)


def _make_server(config, bridge, shutdown_timeout: float):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die of the
        signal (exit status -15). Here the signal only starts the graceful shutdown: exit status 0."""

        async def shutdown(self, sockets=None):
            # NOTE: past its timeout_graceful_shutdown uvicorn cancels the responses still running: a plain-text
            # 500, a stream cut without [DONE], a traceback each. At --shutdown-timeout the bridge answers them
            # instead (503 engine_unavailable; a stream's error event and [DONE]); uvicorn's own timeout, a
            # second later, is left for a client that does not read its answer.
            timer = asyncio.get_running_loop().call_later(
                shutdown_timeout, bridge.refuse_all,
                f"the server is shutting down: the request did not finish within --shutdown-timeout "
                f"{shutdown_timeout:g} s")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.server.app import build_app
    from pagedmoe.server.deployment import check_max_log_len, check_root_path, check_tls, json_str_list
    from pagedmoe.server.reasoning import check_reasoning_parser
    from pagedmoe.server.tool_parsers import check_parser_flags

    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    check_parser_flags(args.enable_auto_tool_choice, args.tool_call_parser)   # before the (long) load
    check_reasoning_parser(args.reasoning_parser)
    cors = {f"allowed_{name}": json_str_list(f"--allowed-{name}", getattr(args, f"allowed_{name}"))
            for name in ("origins", "methods", "headers")}
    tls = check_tls(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    root_path = check_root_path(args.root_path)
    check_max_log_len(args.max_log_len)
    engine = LLMEngine(engine_config_from_args(args, model=args.model))
    app = build_app(engine, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                    request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser,
                    trust_request_chat_template=args.trust_request_chat_template,
                    allowed_credentials=args.allowed_credentials, root_path=root_path,
                    enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len, **cors)
    config = uvicorn.Config(app, host=args.host, port=args.port, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout + 1,
                            access_log=not args.disable_uvicorn_access_log,
                            log_level=args.uvicorn_log_level or logging.getLevelName(logging.getLogger().level).lower(),
                            **tls)
    server = _make_server(config, app.state.bridge, args.shutdown_timeout)
    dead = []

    def on_dead(exc: BaseException) -> None:
        # A dead engine cannot recover: exit non-zero so a supervisor restarts the server.
        dead.append(exc)
        server.should_exit = True

    app.state.bridge.on_dead = on_dead
    logger.info("serving %s on %s://%s:%d (max_model_len %d)", engine.served_model_name,
                "https" if tls else "http", args.host, args.port, engine.max_model_len)
    server.run()
    if dead:
        logger.error("the engine stopped (%r); exiting", dead[0])
        return 1
    return 0
