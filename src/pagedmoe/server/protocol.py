"""OpenAI-compatible request bodies (pydantic) and the error type the routes raise.

Field names, defaults and meanings follow OpenAI's API; the extra sampling fields vLLM accepts
(`top_k`, `min_p`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `structured_outputs`, ...) are accepted too. Unknown fields
are ignored, as vLLM does. A field pagedmoe cannot honour (suffix, best_of > 1, ...) is a 400, not a silent
no-op. `tools` / `tool_choice` are checked in tools.py (they depend on the server's flags).

Responses are plain dicts built in `serving.py`: they are written once per token while streaming, and
building pydantic objects there would only cost time.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr

from pagedmoe.structured_outputs import StructuredOutputsParams

# torch.Generator.manual_seed accepts exactly this range; larger values would fail inside the engine.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_STOP_STRINGS = 64  # the engine scans every stop string after every token
MAX_PROMPTS_PER_REQUEST = 256
MAX_N = 128  # samples per prompt
# vLLM's guided decoding fields, removed in vLLM 0.12 for `structured_outputs`: refused by name, not ignored
REMOVED_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                         "guided_grammar": "grammar", "guided_whitespace_pattern": "whitespace_pattern",
                         "guided_decoding_backend": None}


class APIError(Exception):
    """An error answered with OpenAI's error body: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Union[str, int, None] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.type = message, status_code, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: Optional[str] = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param)


TokenIds = list[StrictInt]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[StrictStr] = None
    temperature: Optional[StrictFloat] = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: Optional[StrictFloat] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: Optional[StrictInt] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: Optional[StrictFloat] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[StrictFloat] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[StrictStr] = None
    # vLLM's extra sampling fields
    top_k: Optional[StrictInt] = None
    min_p: Optional[StrictFloat] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[StrictFloat] = Field(default=None, allow_inf_nan=False)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[TokenIds] = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (structured_outputs.py)
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    # structured_outputs_params's outcome, (params, None) or (None, the error): made once, in a worker thread
    # (serving.compile_constraints), and given again in its place in the request's checks
    _structured: Optional[tuple] = PrivateAttr(default=None)

    def check_unsupported(self) -> None:
        """Refuse what the engine cannot do rather than ignoring it."""
        for name, key in REMOVED_GUIDED_FIELDS.items():
            if getattr(self, name) is not None:
                instead = (f'send "structured_outputs": {{"{key}": ...}}' if key else "leave it out")
                raise invalid(f"{name} was removed in vLLM 0.12 and is not accepted: {instead}", name)
        if not 1 <= self.n <= MAX_N:
            raise invalid(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.repetition_penalty is not None and not 0.0 < self.repetition_penalty <= 100.0:
            raise invalid(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}",
                          "repetition_penalty")
        self.token_biases()
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if any(not s for s in stops):
            raise invalid("stop strings must not be empty", "stop")

    def token_biases(self) -> Optional[dict[int, float]]:
        """logit_bias as the engine takes it: OpenAI sends token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise invalid(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias") from None
            if token < 0:
                raise invalid(f"logit_bias keys must be non-negative token ids, got {token}", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise invalid(f"logit_bias values must be numbers in [-100, 100], got {str(value)[:40]}",
                              "logit_bias")
            out[token] = float(value)
        return out

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The constraint of response_format or structured_outputs (not both), compiled (a bad schema, regex or
        grammar, or llguidance missing, is a 400 here); None for none or response_format text. Made once: a later
        call gives the same parameters, or raises the same error."""
        if self._structured is None:
            try:
                self._structured = (self._structured_outputs_params(), None)
            except Exception as e:  # noqa: BLE001 - kept to be raised where the request's checks reach it
                self._structured = (None, e)
        params, error = self._structured
        if error is not None:
            raise error
        return params

    def _structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        fmt, extra = self.response_format, self.structured_outputs
        if fmt is not None and fmt.get("type") not in (None, "text") and extra is not None:
            raise invalid("give response_format or structured_outputs, not both", "structured_outputs")
        param = "structured_outputs" if extra is not None else "response_format"
        try:
            if extra is not None:
                params = StructuredOutputsParams.from_dict(extra)
            else:
                params = _response_format_params(fmt)
            if params is not None:
                params.compiled()
        except (ValueError, TypeError) as e:
            raise invalid(str(e) if param == "structured_outputs" else str(e).replace("structured_outputs", param),
                          param) from None
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM sends per-chunk usage only when include_usage and continuous_usage_stats are both true."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _response_format_params(fmt: Optional[dict]) -> Optional[StructuredOutputsParams]:
    """OpenAI's response_format: {"type": "text"} (none), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (the schema is required; strict is how every
    constrained output is)."""
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError("response_format: type 'json_schema' needs json_schema.schema, a JSON schema object")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}")


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    max_tokens: Optional[StrictInt] = Field(default=16, ge=0)  # 0: echo only (check_unsupported)
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise invalid("best_of must be 1", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens must be at least 1, got 0 (0 only with echo: the prompt and its logprobs)",
                          "max_tokens")
        if self.max_tokens == 0 and self.stream:
            raise invalid("max_tokens 0 (echo without generation) is not supported with stream", "max_tokens")

    @property
    def echo_only(self) -> bool:
        """vLLM's echo without generation (echo, max_tokens 0: lm-eval-harness's loglikelihood): the engine samples
        one token, which the response leaves out."""
        return self.echo and self.max_tokens == 0


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[dict[str, Any]], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[Any]] = None   # an assistant's earlier calls (checked in tools.py)
    tool_call_id: Optional[StrictStr] = None  # a tool message: the call it answers

    def text(self, index: int) -> str:
        """The message's text; a list of parts must be text parts only, joined with newlines (vLLM's chat_utils,
        for templates that take a message's content as a string)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{index}].content[{j}]: only parts of type 'text' are supported "
                              f"(got {str(part.get('type'))[:40]!r})", "messages")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Any]] = None   # checked, with tool_choice, in tools.py
    tool_choice: Optional[Any] = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[StrictStr] = None   # with --trust-request-chat-template
    echo: StrictBool = False
    include_reasoning: StrictBool = True   # vLLM's: false leaves the reasoning out (--reasoning-parser)
    # vLLM's: the template writes its own BOS; true adds the tokenizer's special tokens on top, as /tokenize does.
    add_special_tokens: StrictBool = False

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message needs add_generation_prompt false", "continue_final_message")

    @property
    def reply_role(self) -> str:
        """The reply's role, as vLLM's get_chat_request_role: the assistant's after a generation prompt, else the
        last message's own (the model goes on writing that message, as for continue_final_message)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """vLLM's echo: the last message's content, put before the reply, when it has the reply's role."""
        last = self.messages[-1]
        if not self.echo or last.role != self.reply_role:
            return ""
        return last.text(len(self.messages) - 1)

    @property
    def max_output_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_output_tokens_param(self) -> str:
        """The field the client set the output limit with, for errors about it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(_Base):
    """vLLM's two bodies in one: {"prompt"} or {"messages"}."""

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Any]] = None   # with messages: given to the chat template, as on /v1/chat/completions
    # vLLM's defaults: True for a prompt; False for messages (the chat template writes its own BOS), where
    # True adds the tokenizer's special tokens on top of the template's.
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[StrictStr] = None   # with --trust-request-chat-template

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    tokens: TokenIds
