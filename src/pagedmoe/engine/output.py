"""After sampling: append the token, detokenize, check stop conditions, build RequestOutput."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from pagedmoe.engine.request import Request, RequestStatus
from pagedmoe.engine.structured import advance
from pagedmoe.sampling_params import CompletionOutput, Logprob, RequestOutput
from pagedmoe.worker.sampler import to_device


def _eos_token_ids(tokenizer, hf_config, model_path: str) -> set[int]:
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    gen_cfg = Path(model_path) / "generation_config.json"
    if gen_cfg.is_file():
        try:
            add(json.loads(gen_cfg.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            pass
    add(getattr(tokenizer, "eos_token_id", None))
    if not ids:
        add(getattr(hf_config, "eos_token_id", None))
    return ids


def _fast_decode(tokenizer):
    """decode(ids, skip_special_tokens) -> str, as `tokenizer.decode` gives it. For a fast tokenizer that
    does not clean up spaces this calls its Rust backend directly: transformers' wrapper costs ~6x the
    decode itself, and streaming detokenizes every sequence every step (bench_host_overhead.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids, skip_special_tokens=False: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode


class OutputProcessor:
    def __init__(self, tokenizer, hf_config, model_path: str) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_token_ids(tokenizer, hf_config, model_path)
        self.decode = _fast_decode(tokenizer) if tokenizer is not None else None

    def mask_min_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Forbid EOS and stop tokens for requests that have not reached min_tokens yet."""
        rows = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i, r in rows:
            banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else self.eos_token_ids)
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:  # indices copied without a stream sync (--async-scheduling: a step may be in flight)
                logits[i, to_device(sorted(banned), logits.device)] = float("-inf")
        return logits

    def append_token(self, request: Request, token: int, logprobs: Optional[dict[int, Logprob]],
                     sampled_logprob: Optional[float], now: float) -> Optional[RequestStatus]:
        """Add the token; return the finishing status if the request is done, else None."""
        p = request.params
        request.output_token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None:
            for t, lp in logprobs.items():
                lp.decoded_token = self.decode([t]) if self.tokenizer is not None else None
            request.output_logprobs.append(logprobs)
            request.cumulative_logprob += sampled_logprob
        n_out = len(request.output_token_ids)
        # structured outputs: the grammar complete (nothing but EOS allowed) ends the request, its last token kept
        grammar_done = request.matcher is not None and advance(request, token)
        status = None
        # under min_tokens, EOS or a stop token ends the request only when the grammar allowed nothing else
        # (StructuredOutputs.mask) and is complete with it
        if n_out >= p.min_tokens or grammar_done:
            if not p.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        # vLLM: the text of a stop token (EOS or stop_token_ids) is left out unless include_stop_str_in_output
        text_end = n_out - 1 if status is not None and not p.include_stop_str_in_output else n_out
        old_len = len(request.output_text)
        if self.tokenizer is not None and (p.stop or p.output_kind == "cumulative") and text_end == n_out:
            self._detokenize(request)  # final_only without stop strings: decoded once, at the end
        if status is None and p.stop and n_out >= p.min_tokens:
            status = self._check_stop_strings(request, old_len)
        if status is None and grammar_done:
            status = RequestStatus.FINISHED_STOPPED
        if status is None and n_out >= request.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if self.tokenizer is not None and not isinstance(request.stop_reason, str):
                self._flush_text(request, text_end)  # a stop string already cut the text where it matched
            request.status = status
            request.finish_time = now
        return status

    def append_prompt_logprobs(self, request: Request, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Prompt logprob entries of prompt tokens first, first + 1, ...; those it already has (a prompt computed
        again after preemption) are left as they are."""
        have = request.prompt_logprobs
        assert first <= len(have), "prompt logprobs arrive in prompt order"
        for entry in entries[len(have) - first:]:
            for t, lp in entry.items():
                lp.decoded_token = self.decode([t]) if self.tokenizer is not None else None
            have.append(entry)

    def _detokenize(self, request: Request) -> None:
        """Extend output_text by the newest token's text, decoding a few tokens instead of the whole output
        (a full decode per token costs O(length) per step). Tokens [detok_prefix, detok_read) are decoded as
        context: a token's text can depend on its neighbours (leading spaces, bytes of one UTF-8 character
        split over tokens). While the decoded tail ends in U+FFFD (an incomplete character) nothing is added
        and the next token is decoded with it. Equal to decoding the whole output (tests/unit/test_detokenize.py)."""
        ids, skip = request.output_token_ids, request.params.skip_special_tokens
        prefix, read = request.detok_prefix, request.detok_read
        decode = self.decode
        prefix_text = decode(ids[prefix:read], skip_special_tokens=skip) if read > prefix else ""
        new_text = decode(ids[prefix:], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            request.output_text += new_text[len(prefix_text):]
            request.detok_prefix, request.detok_read = read, len(ids)

    def _flush_text(self, request: Request, end: int) -> None:
        """At the end, the text of tokens [.., end) held back (an output ending inside a character) as the
        full decode has it."""
        ids, skip = request.output_token_ids, request.params.skip_special_tokens
        prefix, read = request.detok_prefix, request.detok_read
        if read < end:
            prefix_text = self.decode(ids[prefix:read], skip_special_tokens=skip) if read > prefix else ""
            request.output_text += self.decode(ids[prefix:end], skip_special_tokens=skip)[len(prefix_text):]
            request.detok_prefix, request.detok_read = read, end

    @staticmethod
    def _check_stop_strings(request: Request, new_from: int) -> Optional[RequestStatus]:
        """Only a match that ends in the text added by this token (from `new_from` on) counts (vLLM's rule):
        earlier steps searched the older text, or skipped it while under min_tokens."""
        text = request.output_text
        best = None
        for stop in request.params.stop:
            idx = text.find(stop, max(0, new_from - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        request.output_text = text[: idx + len(stop)] if request.params.include_stop_str_in_output else text[:idx]
        request.stop_reason = stop
        return RequestStatus.FINISHED_STOPPED

    @staticmethod
    def make_output(request: Request) -> RequestOutput:
        p = request.params
        completion = CompletionOutput(
            index=0,
            text=request.output_text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if p.logprobs is not None else None,
            logprobs=list(request.output_logprobs) if p.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            prompt_logprobs=list(request.prompt_logprobs) if p.prompt_logprobs is not None else None,
            metrics={"arrival_time": request.arrival_time, "first_token_time": request.first_token_time,
                     "finish_time": request.finish_time, "num_preemptions": request.num_preemptions},
            error=request.error,
        )
