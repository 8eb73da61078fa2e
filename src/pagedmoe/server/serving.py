"""/v1/completions and /v1/chat/completions: request -> prompts + SamplingParams -> responses / SSE.

Everything here runs on the event loop thread except compiling a request's constraint (structured outputs, a named
or required tool_choice: compile_constraints), done in a worker thread. It tokenizes with its own tokenizer
instance (see app.py: a fast tokenizer must not be used from two threads at once, and the engine thread decodes).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from pagedmoe.engine.limits import context_length_error, lone_surrogate
from pagedmoe.sampling_params import RequestOutput, SamplingParams
from pagedmoe.server.async_engine import AsyncEngine, RequestHandle
from pagedmoe.server import reasoning as reasoning_parsers
from pagedmoe.server import tools as tool_calls
from pagedmoe.server.protocol import (MAX_PROMPTS_PER_REQUEST, APIError, ChatCompletionRequest, ChatMessage,
                                      CompletionRequest, SamplingFields, invalid)
from pagedmoe.chat_template import check_template_kwargs, request_chat_template
from pagedmoe.structured_outputs import StructuredOutputsParams


def _lp(value: float) -> float:
    return max(float(value), -9999.0)  # JSON has no -inf


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_utf8(text: str, what: str, param: Optional[str]) -> None:
    """JSON can carry a lone surrogate ("\\ud800"), which no tokenizer takes: refuse it by name and place."""
    at = lone_surrogate(text)
    if at is not None:
        raise invalid(f"{what} contains a lone surrogate U+{ord(text[at]):04X} at position {at}, not valid UTF-8",
                      param)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class _ChoiceState:
    """What one choice has already streamed."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    done: bool = False


@dataclass
class Prepared:
    prompts: list[tuple[Optional[str], list[int]]]
    params: SamplingParams
    echo: list[str] = field(default_factory=list)
    tools: Optional[tool_calls.ToolMode] = None   # chat with tools (tools.py)
    reasoning: Optional[reasoning_parsers.ReasoningMode] = None   # chat under --reasoning-parser (reasoning.py)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_choices(self) -> int:
        """Choices in the response: n per prompt, prompt-major (choice i is sample i % n of prompt i // n)."""
        return len(self.prompts) * self.params.n

    def engine_requests(self) -> tuple[list[tuple[Optional[str], list[int]]], list[SamplingParams]]:
        """One engine request per choice: the prompt and that sample's parameters (seed + j)."""
        prompts = [p for p in self.prompts for _ in range(self.n)]
        return prompts, [self.params.for_sample(j) for _ in self.prompts for j in range(self.n)]


def _compile_constraints(req: SamplingFields, tools: Optional[tool_calls.ToolMode]) -> None:
    """In a worker thread (compile_constraints): the outcomes are kept (made once), errors raised again later."""
    for make in (req.structured_outputs_params, tools.constraint if tools is not None else None):
        if make is not None:
            try:
                make()
            except Exception:  # noqa: BLE001, S110 - kept by req / tools, raised in its place in the checks
                pass


class OpenAIServing:
    def __init__(self, bridge: AsyncEngine, tokenizer, served_model_name: str, max_model_len: int,
                 vocab_size: int, tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 defaults: Optional[dict] = None, trust_request_chat_template: bool = False) -> None:
        self.bridge, self.tokenizer = bridge, tokenizer
        # the model's default sampling parameters (generation_config.py): for the fields a request leaves out
        self.defaults = dict(defaults or {})
        self.tool_parser = tool_parser   # "auto" tool choice: --tool-call-parser (with --enable-auto-tool-choice)
        self.reasoning_parser = reasoning_parser   # --reasoning-parser
        self.trust_request_chat_template = trust_request_chat_template   # a request may send its own template
        self.served_model_name, self.max_model_len, self.vocab_size = served_model_name, max_model_len, vocab_size
        self.max_prompt_chars = self._max_prompt_chars()

    def _max_prompt_chars(self) -> Optional[int]:
        """Text longer than this cannot fit the context whatever it says: a token's text is at most as
        long as the longest vocabulary entry (byte-level or byte-fallback spellings only make entries
        longer). Checked before tokenizing, which runs on the event loop and would stall every stream."""
        if self.tokenizer is None:
            return None
        try:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=0)
        except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: no shortcut
            return None
        return (self.max_model_len - 1) * longest if longest else None

    def encode(self, text: str, param: str, add_special_tokens: bool = True, what: Optional[str] = None) -> list[int]:
        """`what` names the text in errors (default: `param`), e.g. prompt[2] of a list."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise invalid(f"the prompt has {len(text)} characters; no text longer than {self.max_prompt_chars} "
                          f"characters fits this model's maximum context length of {self.max_model_len} "
                          f"tokens", param)
        check_utf8(text, what or param, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # -- validation and prompts ------------------------------------------------------------------
    @staticmethod
    async def compile_constraints(req: SamplingFields, tools: Optional[tool_calls.ToolMode] = None) -> None:
        """Compile the request's constraint (response_format / structured_outputs, a named or required tool_choice's
        schema) in a worker thread: the first compile of a schema, choice list or grammar takes ~0.1-1 s for a large
        one (llguidance lets the GIL go meanwhile), which on the event loop would stall every stream and /health.
        Nothing is raised here: the parameters, or the error (a 400 naming the field), are kept on the request and
        the tool mode and given where sampling_params asks for them, so the checks keep their order."""
        structured = req.structured_outputs is not None or (
            req.response_format is not None and req.response_format.get("type") not in (None, "text"))
        constrained_tools = tools is not None and tools.choice in ("named", "required")
        if structured or constrained_tools:
            await asyncio.to_thread(_compile_constraints, req, tools if constrained_tools else None)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model[:200]}` does not exist.", 404, "invalid_request_error", "model",
                           "model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: Optional[int], param: str,
                     max_tokens_param: str = "max_tokens") -> None:
        if not ids:
            raise invalid("the prompt is empty", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param)
        err = context_length_error(self.max_model_len, len(ids), max_tokens)
        if err is not None:
            raise invalid(err[0], param if err[1] == "prompt" else max_tokens_param)

    def sampling_params(self, req: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                        longest_prompt: int, prompt_logprobs: Optional[int] = None,
                        constraint: Optional[StructuredOutputsParams] = None,
                        keep_special_tokens: bool = False) -> SamplingParams:
        """constraint: a tool_choice's (named, required), which response_format / structured_outputs may not join.
        keep_special_tokens: skip_special_tokens off whatever the request says (a tool parser needs them)."""
        if max_tokens is None:  # none given: the model's max_new_tokens (the engine caps it at the context)
            max_tokens = self.defaults.get("max_tokens")
        # vLLM computes an omitted max_tokens (the rest of the context) and refuses a larger min_tokens.
        room = self.max_model_len - longest_prompt
        limit = room if max_tokens is None else min(max_tokens, room)
        if req.min_tokens > limit:
            raise invalid(f"min_tokens must be less than or equal to max_tokens={limit}, got {req.min_tokens}.",
                          "min_tokens")
        bias = req.token_biases()
        structured = req.structured_outputs_params()
        if constraint is not None:
            if structured is not None:
                raise invalid("tool_choice 'required' or a named function constrains the output itself; leave out "
                              "response_format and structured_outputs", "tool_choice")
            structured = constraint
        if structured is not None:
            self.need_tokenizer("structured_outputs" if req.structured_outputs is not None else "response_format",
                                "structured outputs mask tokens by their text")
        if bias and max(bias) >= self.vocab_size:
            raise invalid(f"logit_bias token ids must be in [0, {self.vocab_size}); got {max(bias)}", "logit_bias")
        try:
            return SamplingParams(
                temperature=self.field(req, "temperature", 1.0), top_p=self.field(req, "top_p", 1.0),
                top_k=self.field(req, "top_k", -1) or -1,  # vLLM: 0 and -1 both disable
                min_p=self.field(req, "min_p", 0.0), seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                n=req.n, presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=self.field(req, "repetition_penalty", 1.0),
                logit_bias=bias,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=structured)
        except (ValueError, TypeError) as e:
            first = str(e).split(" ", 1)[0]
            raise invalid(str(e), first if first in type(req).model_fields else None) from None

    def field(self, req: SamplingFields, name: str, fallback):
        """The request's value of a sampling field; left out (or null, as vLLM reads it): the model's default
        (generation_config.json), else `fallback`, OpenAI's and vLLM's."""
        value = getattr(req, name)
        return self.defaults.get(name, fallback) if value is None else value

    def completion_prompts(self, req: CompletionRequest) -> Prepared:
        p = req.prompt
        if isinstance(p, str):
            raw = [p]
        elif not p:
            raise invalid("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):
            raw = [p]
        else:
            raw = list(p)
        if len(raw) > MAX_PROMPTS_PER_REQUEST:
            raise invalid(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request", "prompt")
        max_tokens = req.max_tokens
        if "max_tokens" not in req.model_fields_set and "max_tokens" in self.defaults:
            max_tokens = None   # left out: the model's default (sampling_params), not OpenAI's 16
        prompts, echo = [], []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                self.need_tokenizer("prompt", "send the prompt as token ids")
                ids = self.encode(item, "prompt", what=f"prompt[{i}]" if isinstance(p, list) else "prompt")
                text = item
            else:
                ids, text = list(item), None
            self.check_prompt(ids, max_tokens, "prompt")
            prompts.append((text, ids))
            if req.echo:
                self.need_tokenizer("echo")
                echo.append(text if text is not None else self.tokenizer.decode(ids))
        # echo with logprobs: the prompt's too (vLLM's); echo without generation samples one token, left out
        params = self.sampling_params(req, 1 if req.echo_only else max_tokens, req.logprobs,
                                      max(len(ids) for _, ids in prompts), req.logprobs if req.echo else None)
        return Prepared(prompts, params, echo)

    def need_tokenizer(self, param: Optional[str], hint: str = "") -> None:
        if self.tokenizer is None:
            raise invalid("this model was loaded without a tokenizer" + (f": {hint}" if hint else ""), param)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
                    tools: Optional[list[dict]] = None, template: Optional[str] = None) -> str:
        """template: the request's own chat_template (its text), only with --trust-request-chat-template."""
        self.need_tokenizer("messages", "use /v1/completions with token ids")
        kwargs = dict(template_kwargs or {})
        try:
            check_template_kwargs(kwargs)
        except ValueError as e:
            raise invalid(str(e), "chat_template_kwargs") from None
        if template is not None:
            if not self.trust_request_chat_template:
                raise invalid("a chat_template in the request needs the server's --trust-request-chat-template "
                              "(or give the server one with --chat-template)", "chat_template")
            try:
                kwargs["chat_template"] = request_chat_template(template)
            except ValueError as e:
                raise invalid(str(e), "chat_template") from None
        elif not getattr(self.tokenizer, "chat_template", None):
            raise invalid("this model's tokenizer has no chat template; use /v1/completions or start the server "
                          "with --chat-template", "messages")
        conversation = []
        for i, m in enumerate(messages):
            check_utf8(m.text(i), f"messages[{i}].content", "messages")
            turn = {"role": m.role, "content": m.text(i), **({"name": m.name} if m.name else {})}
            if m.tool_calls is not None:
                turn["tool_calls"] = tool_calls.template_messages_tool_calls(m.tool_calls, i)
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            conversation.append(turn)
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except Exception as e:  # noqa: BLE001 - templates raise anything (jinja errors, raise_exception)
            raise invalid(f"the chat template failed on these messages: {e}", "messages") from None

    def chat_tools(self, req: ChatCompletionRequest) -> Optional[tool_calls.ToolMode]:
        """The request's tool mode (a 400 for bad tools or tool_choice); None without tools."""
        return tool_calls.resolve(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)

    def chat_prompt(self, req: ChatCompletionRequest, tools: Optional[tool_calls.ToolMode] = None) -> Prepared:
        """tools: chat_tools(req), made already (compile_constraints compiled its constraint); made here if None."""
        if tools is None:
            tools = self.chat_tools(req)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template_kwargs, tools.tools if tools else None, req.chat_template)
        ids = self.encode(text, "messages", add_special_tokens=req.add_special_tokens)
        self.check_prompt(ids, req.max_output_tokens, "messages", req.max_output_tokens_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        last_input = next((m.text(i) for i, m in reversed(list(enumerate(req.messages))) if m.role != "assistant"),
                          None)
        reasoning = reasoning_parsers.resolve(self.reasoning_parser, text, req.chat_template_kwargs,
                                              req.include_reasoning, last_input)
        auto = tools is not None and tools.choice == "auto"
        keep_special = (tools is not None and tools.keeps_special_tokens) or (
            reasoning is not None and reasoning.keeps_special_tokens(self.special_tokens))
        params = self.sampling_params(req, req.max_output_tokens, logprobs, len(ids),
                                      constraint=tools.constraint() if tools else None,
                                      keep_special_tokens=keep_special)
        if keep_special and req.skip_special_tokens:   # the text as skip_special_tokens would have left it
            if auto:
                tools.drop = self.special_tokens
            if reasoning is not None:
                reasoning.drop, reasoning.drop_in_content = self.special_tokens, not auto
        if reasoning is not None and reasoning.constraint_waits and params.structured_outputs is not None:
            # vLLM's: the constraint applies after the reasoning (the engine's matcher waits for </think>)
            params = dataclasses.replace(params, reasoning_end_token_id=self.think_end_token_id(req, tools))
        return Prepared([(text, ids)], params, tools=tools, reasoning=reasoning)

    def think_end_token_id(self, req: ChatCompletionRequest, tools: Optional[tool_calls.ToolMode]) -> int:
        """`</think>`'s token id, for a constraint that starts after the reasoning; a 400 where it is not one token."""
        ids = self.tokenizer.encode(reasoning_parsers.END_THINK, add_special_tokens=False)
        if len(ids) != 1:
            param = ("tool_choice" if tools is not None and tools.constraint() is not None
                     else "structured_outputs" if req.structured_outputs is not None else "response_format")
            raise invalid(f"{param} with --reasoning-parser {self.reasoning_parser}: the constraint starts after the "
                          f"reasoning's end, {reasoning_parsers.END_THINK}, which this model's tokenizer writes as "
                          f"{len(ids)} tokens, not one", param)
        return ids[0]

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The texts of the tokenizer's special tokens: what skip_special_tokens leaves out of a decoded text (EOS
        too, whose text a stop leaves out anyway unless include_stop_str_in_output)."""
        if self.tokenizer is None:
            return ()
        texts = set(getattr(self.tokenizer, "all_special_tokens", ()))
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        texts.update(t.content for t in added.values() if getattr(t, "special", False))
        return tuple(sorted(t for t in texts if isinstance(t, str) and t))

    # -- running ---------------------------------------------------------------------------------
    def submit(self, prefix: str, prepared: Prepared, arrival: float) -> tuple[str, RequestHandle]:
        limit = self.bridge.max_waiting_requests
        if limit is not None and prepared.num_choices > limit:  # never admitted: a 503 would say "retry"
            raise invalid(f"this request needs {prepared.num_choices} sequences ({len(prepared.prompts)} prompts x "
                          f"n={prepared.n}), more than the server queues (--max-waiting-requests {limit})", "n")
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        prompts, params = prepared.engine_requests()
        return response_id, self.bridge.submit(response_id, prompts, params, arrival)

    @staticmethod
    async def final_outputs(handle: RequestHandle, n: int) -> list[RequestOutput]:
        last: list[Optional[RequestOutput]] = [None] * n
        async for i, out in handle.outputs():
            last[i] = out
        return last  # type: ignore[return-value]

    @staticmethod
    def usage(outputs: list[Optional[RequestOutput]], n: int = 1, generated: bool = True) -> dict:
        """outputs: one per choice (None: nothing yet); a prompt's tokens count once for its n samples; generated
        False: echo without generation, no completion tokens."""
        prompt = sum(len(o.prompt_token_ids) for i, o in enumerate(outputs) if o is not None and i % n == 0)
        completion = sum(len(o.outputs[0].token_ids) for o in outputs if o is not None) if generated else 0
        return _usage(prompt, completion)

    @staticmethod
    def choice_usage(prompt_ids: list[int], out: Optional[RequestOutput]) -> dict:
        """continuous_usage_stats, as vLLM sends it: one choice's prompt and its tokens so far."""
        return _usage(len(prompt_ids), len(out.outputs[0].token_ids) if out is not None else 0)

    @staticmethod
    def holdback(params: SamplingParams) -> int:
        """Characters kept back while streaming, so text a stop string will cut off is never sent."""
        return max((len(s) for s in params.stop), default=1) - 1

    @staticmethod
    def advance(out: RequestOutput, state: _ChoiceState, holdback: int) -> tuple[str, int, int]:
        """The text not yet streamed and the token range [start, end) it covers; updates `state`."""
        c = out.outputs[0]
        text = c.text
        end = len(text)
        if not out.finished:
            end -= holdback
            if text.endswith("\ufffd"):
                end = min(end, len(text) - 1)  # an incomplete UTF-8 character: wait for its next bytes
        end = max(end, state.num_chars)
        delta = text[state.num_chars:end]
        state.num_chars = end
        start, state.num_tokens = state.num_tokens, len(c.token_ids)
        state.done = out.finished
        return delta, start, state.num_tokens

    def worth_a_chunk(self, new, out: RequestOutput, start: int, end: int, logprobs: bool,
                      continuous_usage: bool) -> bool:
        """Send a chunk for something new (`new`: text, or a chat delta), the end, or new tokens whose text is held
        back or absent when the client counts tokens (logprobs, continuous usage) or there is no tokenizer to make
        text."""
        if new or out.finished:
            return True
        return start < end and (logprobs or continuous_usage or self.tokenizer is None)

    # -- logprobs --------------------------------------------------------------------------------
    def completion_logprobs(self, out: RequestOutput, start: int, end: int, state: _ChoiceState,
                            echo: bool = False) -> dict:
        """Tokens [start, end) of the output; echo: the prompt's tokens go first (the first one's logprob null)."""
        c = out.outputs[0]
        pairs = list(zip(out.prompt_token_ids, out.prompt_logprobs)) if echo else []
        pairs += [(c.token_ids[pos], c.logprobs[pos]) for pos in range(start, end)]
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in pairs:
            tok = self.tokenizer.decode([tid]) if entry is None else entry[tid].decoded_token or ""
            tokens.append(tok)
            token_lps.append(None if entry is None else _lp(entry[tid].logprob))
            tops.append(None if entry is None else {(lp.decoded_token or ""): _lp(lp.logprob) for lp in entry.values()})
            offsets.append(state.text_offset)
            state.text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def chat_logprobs(out: RequestOutput, start: int, end: int, num_top: int) -> dict:
        c = out.outputs[0]
        content = []
        for pos in range(start, end):
            entry = c.logprobs[pos]
            sampled = entry[c.token_ids[pos]]
            tok = sampled.decoded_token or ""
            top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)[:num_top]
            content.append({"token": tok, "logprob": _lp(sampled.logprob), "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": [{"token": lp.decoded_token or "", "logprob": _lp(lp.logprob),
                                              "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                                             for lp in top]})
        return {"content": content}

    # -- /v1/completions -------------------------------------------------------------------------
    def completion_response(self, response_id: str, req: CompletionRequest, prepared: Prepared,
                            outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            prefix = prepared.echo[i // prepared.n] if req.echo else ""
            text, end, finish, stop = prefix + c.text, len(c.token_ids), c.finish_reason, c.stop_reason
            if req.echo_only:  # the one token sampled is left out (vLLM's echo without generation)
                text, end, finish, stop = prefix, 0, "length", None
            logprobs = None
            if req.logprobs is not None:
                # echoed, the prompt's tokens come first (vLLM's), the offsets counted from theirs
                logprobs = self.completion_logprobs(out, 0, end, _ChoiceState(), echo=req.echo)
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish,
                            "stop_reason": stop})
        return {"id": response_id, "object": "text_completion", "created": int(time.time()),
                "model": self.served_model_name, "choices": choices,
                "usage": self.usage(outputs, prepared.n, generated=not req.echo_only), "system_fingerprint": None}

    async def completion_stream(self, response_id: str, req: CompletionRequest, prepared: Prepared,
                                handle: RequestHandle) -> AsyncIterator[str]:
        created, n = int(time.time()), prepared.num_choices
        states = [_ChoiceState() for _ in range(n)]
        last: list[Optional[RequestOutput]] = [None] * n
        holdback = self.holdback(prepared.params)
        base = {"id": response_id, "object": "text_completion", "created": created, "model": self.served_model_name}
        usage_field = {"usage": None} if req.include_usage else {}
        # echo with logprobs: the prompt goes with the choice's first chunk, once its logprobs are in (vLLM's)
        echo_later = [req.echo and req.logprobs is not None] * n
        if req.echo and not echo_later[0]:
            for i in range(n):
                text = prepared.echo[i // prepared.n]
                states[i].text_offset = len(text)
                chunk = {**base, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}],
                         **usage_field}
                if req.continuous_usage:
                    chunk["usage"] = self.choice_usage(prepared.prompts[i // prepared.n][1], None)
                yield sse(chunk)
        async for i, out in handle.outputs():
            last[i] = out
            delta, start, end = self.advance(out, states[i], holdback)
            if not self.worth_a_chunk(delta, out, start, end, req.logprobs is not None, req.continuous_usage):
                continue
            logprobs = (self.completion_logprobs(out, start, end, states[i], echo=echo_later[i])
                        if req.logprobs is not None else None)
            if echo_later[i]:
                delta, echo_later[i] = prepared.echo[i // prepared.n] + delta, False
            c = out.outputs[0]
            choice = {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            chunk = {**base, "choices": [choice], **usage_field}
            if req.continuous_usage:
                chunk["usage"] = self.choice_usage(out.prompt_token_ids, out)
            yield sse(chunk)
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": self.usage(last, prepared.n)})
        yield SSE_DONE

    # -- /v1/chat/completions --------------------------------------------------------------------
    def chat_response(self, response_id: str, req: ChatCompletionRequest, prepared: Prepared,
                      outputs: list[RequestOutput]) -> dict:
        choices, echo, tools = [], req.echo_text(), prepared.tools
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            logprobs = self.chat_logprobs(out, 0, len(c.token_ids), req.top_logprobs or 0) if req.logprobs else None
            content, calls, finish, extra = c.text, [], c.finish_reason, {}
            if prepared.reasoning is not None:   # the reasoning first; tool calls are parsed from the content only
                thought, content = prepared.reasoning.message(c.text)
                extra = reasoning_parsers.fields(thought)
            if tools is not None and tools.parses:
                content, calls, stream = tools.message(content or "")
                finish = tools.finish_reason(stream, finish)
            if echo:
                content = echo + (content or "")
            message = {"role": req.reply_role, "content": content, **extra, "tool_calls": calls}
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.served_model_name, "choices": choices, "usage": self.usage(outputs, len(outputs)),
                "system_fingerprint": None}

    async def chat_stream(self, response_id: str, req: ChatCompletionRequest, prepared: Prepared,
                          handle: RequestHandle) -> AsyncIterator[str]:
        base = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.served_model_name}
        usage_field = {"usage": None} if req.include_usage else {}
        n = prepared.num_choices
        states, last = [_ChoiceState() for _ in range(n)], [None] * n
        holdback = self.holdback(prepared.params)
        tools = prepared.tools if prepared.tools is not None and prepared.tools.parses else None
        streams = [tools.stream() for _ in range(n)] if tools else None
        thinking = [prepared.reasoning.stream() for _ in range(n)] if prepared.reasoning is not None else None
        for i in range(n):
            chunk = {**base, "choices": [{"index": i, "delta": {"role": req.reply_role, "content": ""},
                                          "logprobs": None, "finish_reason": None}], **usage_field}
            if req.continuous_usage:
                chunk["usage"] = self.choice_usage(prepared.prompts[0][1], None)
            yield sse(chunk)
        echo = req.echo_text()
        for i in range(n if echo else 0):  # vLLM: one chunk per choice after the role chunks
            chunk = {**base, "choices": [{"index": i, "delta": {"content": echo}, "logprobs": None,
                                          "finish_reason": None}], **usage_field}
            if req.continuous_usage:
                chunk["usage"] = self.choice_usage(prepared.prompts[0][1], None)
            yield sse(chunk)
        async for i, out in handle.outputs():
            last[i] = out
            delta, start, end = self.advance(out, states[i], holdback)
            c = out.outputs[0]
            thought, content, calls, finish = "", delta, [], c.finish_reason
            if thinking is not None:   # reasoning parser: the text becomes reasoning and content deltas (reasoning.py)
                thought, content = thinking[i].feed(delta, out.finished)
            if streams is not None:   # tool calls: the content becomes content and tool call deltas (tools.py)
                content, calls = streams[i].feed(content, out.finished)
                calls = tools.keep(calls)
                finish = tools.finish_reason(streams[i], finish)
            message = {**({"content": content} if content else {}),
                       **(reasoning_parsers.fields(thought) if thought else {}),
                       **({"tool_calls": calls} if calls else {})}
            if not self.worth_a_chunk(message, out, start, end, req.logprobs, req.continuous_usage):
                continue
            logprobs = self.chat_logprobs(out, start, end, req.top_logprobs or 0) if req.logprobs else None
            chunk = {**base, "choices": [{"index": i, "delta": message, "logprobs": logprobs,
                                          "finish_reason": finish, "stop_reason": c.stop_reason}], **usage_field}
            if req.continuous_usage:
                chunk["usage"] = self.choice_usage(out.prompt_token_ids, out)
            yield sse(chunk)
        if req.include_usage and any(o is not None for o in last):
            yield sse({**base, "choices": [], "usage": self.usage(last, n)})
        yield SSE_DONE
