"""The FastAPI app: routes, API-key and body-size guard, OpenAI error bodies, SSE with disconnect abort.

Routes parse their own bodies (`read_json` + pydantic) instead of FastAPI's body injection, so every
malformed input (bad JSON, NaN, nesting deep enough to hit the recursion limit, wrong types) ends as a
400 with OpenAI's error body rather than a 422 or a 500.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Optional, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pagedmoe.server.async_engine import (AsyncEngine, EngineDeadError, OverloadedError, RequestFailedError,
                                          RequestTimeoutError)
from pagedmoe.server.deployment import log_request
from pagedmoe.server.metrics import CONTENT_TYPE, ServerMetrics, count_resident_experts
from pagedmoe.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, invalid)
from pagedmoe.server.reasoning import check_reasoning_parser
from pagedmoe.server.serving import SSE_DONE, OpenAIServing, check_utf8, sse
from pagedmoe.server.tool_parsers import check_parser_flags
from pagedmoe.server.tools import check_tools

logger = logging.getLogger("pagedmoe.server")

MAX_BODY_BYTES = 64 * 1024 * 1024
_OPEN_PATHS = ("/health", "/metrics", "/version", "/ping")


# -- errors ------------------------------------------------------------------------------------------
def to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OverloadedError):
        return APIError(str(exc), 503, "server_error", None, "server_overloaded",
                        {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503, "server_error", None, "engine_unavailable")
    if isinstance(exc, RequestTimeoutError):
        return APIError(str(exc), 504, "server_error", None, "request_timeout")
    if isinstance(exc, RequestFailedError):  # its step ran out of GPU memory; the server serves on
        return APIError(str(exc), 500, "server_error", None, "engine_step_failed")
    if isinstance(exc, (ValueError, TypeError)):  # the engine refused the request's input
        return invalid(str(exc))
    return APIError(f"internal server error ({type(exc).__name__})", 500, "server_error")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request) -> dict:
    body = await request.body()
    if not body.strip():
        raise invalid("the request body is empty; expected a JSON object")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise invalid(f"the request body must be a JSON object, not {type(obj).__name__}")
    return obj


def parse(model: type[BaseModel], obj: dict):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if len(errors) > 1 and all(err["loc"][:1] == ("prompt",) for err in errors):
            # One error per branch of the prompt's union: say what is accepted instead.
            raise invalid("prompt must be a string, a list of strings, a list of token ids (integers) or a "
                          "list of lists of token ids", "prompt") from None
        parts = [f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        raise invalid("invalid request: " + "; ".join(parts) + more, param) from None


# -- the guard: API key and body size, as plain ASGI (no BaseHTTPMiddleware: it breaks streaming) ----
class _Guard:
    def __init__(self, app, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root + "/"):  # a proxy that forwards --root-path's prefix
            path = path[len(root):]
        if self.api_key and scope["method"] != "OPTIONS" and not path.startswith(_OPEN_PATHS):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not auth:
                return await self._reply(scope, send, APIError(
                    "Missing API key: send the header 'Authorization: Bearer <key>'", 401,
                    "invalid_request_error", None, "invalid_api_key"))
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return await self._reply(scope, send, APIError("Incorrect API key provided.", 401,
                                                               "invalid_request_error", None, "invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await self._reply(scope, send, invalid("invalid Content-Length header"))
            if declared > self.max_body_bytes:
                return await self._reply(scope, send, self._too_large())
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        return await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(f"the request body is larger than {self.max_body_bytes} bytes", 413)

    @staticmethod
    async def _reply(scope, send, err: APIError):
        response = error_response(err)
        await response(scope, None, send)


# -- streaming -----------------------------------------------------------------------------------------
class SSEResponse(StreamingResponse):
    """Server-sent events that notice a client disconnect at once, not at the next write.

    NOTE: Starlette, under ASGI 2.4 servers, only learns of a disconnect when a write fails, i.e. one
    token later (never, for a request still waiting in the queue). Here a listener runs next to the
    stream; on disconnect it cancels the stream and `on_close` aborts the request in the engine.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[str], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def run_stream():
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away during a write
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close("disconnect")


async def _stream_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once the 200 and headers are sent, an error can only be reported as a last event."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # noqa: BLE001
        err = to_api_error(e)
        if err.status_code >= 500 and not isinstance(e, (EngineDeadError, RequestTimeoutError, RequestFailedError)):
            logger.exception("error while streaming")
        yield sse(err.body())
        yield SSE_DONE


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, coro, handle):
    """Await `coro`; if the client disconnects first, cancel it (which aborts the request) and return None."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        handle.close("disconnect")
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        handle.close("client")


# -- the app -------------------------------------------------------------------------------------------
def _own_tokenizer(engine):
    """A tokenizer instance for the loop thread only: fast tokenizers are not safe across threads."""
    try:
        return copy.deepcopy(engine.tokenizer)
    except Exception:  # noqa: BLE001
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(engine.config.tokenizer or engine.model_path)


def build_app(engine, api_key: Optional[str] = None, max_waiting_requests: Optional[int] = 1024,
              request_timeout: Optional[float] = None, max_body_bytes: int = MAX_BODY_BYTES,
              shutdown_timeout: float = 30.0, enable_auto_tool_choice: bool = False,
              tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
              trust_request_chat_template: bool = False, allowed_origins: Sequence[str] = ("*",),
              allowed_credentials: bool = False, allowed_methods: Sequence[str] = ("*",),
              allowed_headers: Sequence[str] = ("*",), root_path: str = "", enable_log_requests: bool = False,
              max_log_len: Optional[int] = None) -> FastAPI:
    """An OpenAI-compatible app around a loaded LLMEngine. The engine thread starts with the app's lifespan.
    enable_auto_tool_choice + tool_call_parser: vLLM's flags for tool_choice "auto" (tools.py); reasoning_parser:
    vLLM's --reasoning-parser (reasoning.py); trust_request_chat_template: vLLM's flag, a request's chat_template is
    rendered (a 400 without it). allowed_*: CORS, vLLM's flags and defaults; root_path: vLLM's --root-path;
    enable_log_requests + max_log_len: vLLM's request log (deployment.py)."""
    parser = check_parser_flags(enable_auto_tool_choice, tool_call_parser)
    check_reasoning_parser(reasoning_parser)
    name = engine.served_model_name
    metrics = ServerMetrics(name)
    bridge = AsyncEngine(engine, max_waiting_requests, request_timeout, metrics)
    metrics.attach_engine(bridge.stats_snapshot, count_resident_experts(engine))
    tokenizer = _own_tokenizer(engine)
    dims = getattr(getattr(engine, "model", None), "dims", None)
    vocab_size = int(dims.vocab_size) if dims is not None else len(tokenizer or ())
    serving = OpenAIServing(bridge, tokenizer, name, engine.max_model_len, vocab_size, parser, reasoning_parser,
                            engine.default_sampling_params, trust_request_chat_template)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        bridge.start()
        try:
            yield
        finally:
            await bridge.shutdown(shutdown_timeout)

    app = FastAPI(title="pagedmoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.root_path = root_path  # set here, not passed in: FastAPI warns that its root_path argument is deprecated
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    # Outside the guard (added last: the outermost): a preflight, which browsers send without the
    # Authorization header, is answered here, and the guard's 401s carry the CORS headers a page needs to read them.
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_credentials=allowed_credentials,
                       allow_methods=list(allowed_methods), allow_headers=list(allowed_headers))
    app.state.bridge, app.state.metrics, app.state.serving = bridge, metrics, serving

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        if exc.status_code == 503 and exc.code == "server_overloaded":
            metrics.count_rejected("queue_full")
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return error_response(APIError(str(exc.detail), exc.status_code, "invalid_request_error"))

    # Registered by type, not left to the Exception handler below: Starlette re-raises whatever reaches that
    # one after answering, so uvicorn would log a full traceback for a client's bad input.
    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def _bad_input(request: Request, exc: Exception):
        err = to_api_error(exc)  # the engine or the tokenizer refused the request's input: a 400
        logger.warning("%s %s: 400 for %s: %s", request.method, request.url.path, type(exc).__name__,
                       str(exc)[:200])
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        err = to_api_error(exc)
        if err.status_code >= 500:
            logger.exception("error while handling a request", exc_info=exc)
        return error_response(err)

    def _submit(prefix, prepared, arrival):
        try:
            response_id, handle = serving.submit(prefix, prepared, arrival)
        except (OverloadedError, EngineDeadError) as e:
            raise to_api_error(e) from None
        if enable_log_requests:
            log_request(response_id, prepared.prompts, prepared.params, max_log_len)
        return response_id, handle

    async def _run(request: Request, handle, n: int):
        try:
            return await _unless_disconnected(request, serving.final_outputs(handle, n), handle)
        except (RequestTimeoutError, EngineDeadError, RequestFailedError, ValueError, TypeError) as e:
            raise to_api_error(e) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = parse(CompletionRequest, await read_json(request))
        serving.check_model(req.model)
        req.check_unsupported()
        await serving.compile_constraints(req)   # off the event loop (a first compile takes up to ~1 s)
        prepared = serving.completion_prompts(req)
        response_id, handle = _submit("cmpl", prepared, arrival)
        if req.stream:
            return SSEResponse(_stream_errors(serving.completion_stream(response_id, req, prepared, handle)),
                               handle.close)
        outputs = await _run(request, handle, prepared.num_choices)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(serving.completion_response(response_id, req, prepared, outputs))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = parse(ChatCompletionRequest, await read_json(request))
        serving.check_model(req.model)
        req.check_unsupported()
        tools = serving.chat_tools(req)
        await serving.compile_constraints(req, tools)   # off the event loop (a first compile takes up to ~1 s)
        prepared = serving.chat_prompt(req, tools)
        response_id, handle = _submit("chatcmpl", prepared, arrival)
        if req.stream:
            return SSEResponse(_stream_errors(serving.chat_stream(response_id, req, prepared, handle)),
                               handle.close)
        outputs = await _run(request, handle, prepared.num_choices)
        if outputs is None:
            return Response(status_code=499)
        return JSONResponse(serving.chat_response(response_id, req, prepared, outputs))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": started, "owned_by": "pagedmoe",
            "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not bridge.is_healthy:
            return error_response(APIError("the engine is not running", 503, "server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from pagedmoe import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await read_json(request))
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("send exactly one of 'prompt' or 'messages'")
        serving.need_tokenizer(None)
        if req.prompt is not None:
            check_utf8(req.prompt, "prompt", "prompt")
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.special_tokens)
        else:
            if req.continue_final_message and req.add_generation_prompt:
                raise invalid("continue_final_message needs add_generation_prompt false", "continue_final_message")
            text = serving.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template_kwargs, check_tools(req.tools) if req.tools else None,
                                       req.chat_template)
            ids = tokenizer.encode(text, add_special_tokens=req.special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request))
        serving.check_model(req.model)
        serving.need_tokenizer(None)
        limit = max(vocab_size, len(tokenizer))
        bad = [t for t in req.tokens if not 0 <= t < limit]
        if bad:
            raise invalid(f"token ids must be in [0, {limit}); got {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app
