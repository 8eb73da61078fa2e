"""Offline API: LLM(model, **engine_flags).generate(...) / .chat(...)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedmoe.chat_template import check_template_kwargs, load_chat_template
from pagedmoe.config import engine_config_from_kwargs
from pagedmoe.engine.limits import lone_surrogate
from pagedmoe.engine.llm_engine import LLMEngine
from pagedmoe.sampling_params import RequestOutput, SamplingParams

logger = logging.getLogger("pagedmoe")

PromptType = Union[str, list[int], dict]


class GenerationError(RuntimeError):
    """Requests of one generate() / chat() call failed (out of GPU memory in their step); the others ran to the
    end. `outputs` holds every output in prompt order, the failed ones with finish_reason "error". The LLM
    serves on."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLM:
    """`LLM("path/to/model", gpu_memory_gb=48)`; no model means the embedded default model."""

    def __init__(self, model: Optional[str] = None, **engine_flags) -> None:
        self.engine = LLMEngine(engine_config_from_kwargs(model, **engine_flags))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: SamplingParams' defaults, with the model's
        generation_config.json (--generation-config, --override-generation-config) over them."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is a string, a list (or tuple) of token ids, or
        {"prompt": str} / {"prompt_token_ids": [...]}; a list or tuple of ints alone is one prompt. A prompt of
        another kind is a ValueError naming it, before any request is queued."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        for p in params:
            p.validate()
        split = [_split_prompt(prompt, i) for i, prompt in enumerate(prompts)]
        groups: list[list[str]] = []  # the engine requests of each prompt: one per sample (n)
        try:
            for (text, token_ids), p in zip(split, params):
                rid = f"gen-{next(self._ids)}"
                groups.append([])
                for j in range(p.n):
                    # Only the final output is returned: skip the per-step outputs streaming needs.
                    child = dataclasses.replace(p.for_sample(j), output_kind="final_only")
                    self.engine.add_request(f"{rid}-{j}", text, child, prompt_token_ids=token_ids)
                    groups[-1].append(f"{rid}-{j}")
        except Exception:
            for rid in (r for g in groups for r in g):
                self.engine.abort_request(rid)
            raise
        return self._run(groups, use_tqdm)

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: Optional[list[dict]] = None,
             chat_template: Optional[str] = None,
             chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of conversations. tools: OpenAI
        function tools ({"type": "function", "function": {"name", "description", "parameters"}}), given to the chat
        template as vLLM's LLM.chat does; the calls are in the output's text, in the model's own format.
        chat_template: a Jinja template (or a file holding one) for this call, in place of the tokenizer's (or
        --chat-template's); chat_template_kwargs: more variables for the template (e.g. enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        template = load_chat_template(chat_template, "chat_template")
        if template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template or use generate()")
        extra = dict(chat_template_kwargs or {})
        check_template_kwargs(extra)
        if tools:
            extra["tools"] = tools
        if template is not None:
            extra["chat_template"] = template
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **extra))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = {rid for g in groups for rid in g}
        bar = tqdm(total=len(wanted), desc="Processed prompts", disable=not use_tqdm)
        before = self.engine.expert_stats()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:  # an error or Ctrl-C mid-run: leave none of this call's requests queued
            for rid in wanted - finished.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        summary = self.engine.expert_traffic_summary(before)
        if summary:
            logger.info(summary)
        samples = [finished[rid] for g in groups for rid in g]
        merged = [_merge([finished[rid] for rid in g]) for g in groups]
        check_failed(samples, merged)
        return merged


def check_failed(samples: list[RequestOutput], outputs: list[RequestOutput]) -> None:
    """GenerationError (carrying `outputs`) if any of the requests `samples` failed in its step."""
    failed = [o for o in samples if o.error is not None]
    if failed:
        raise GenerationError(f"{len(failed)} of {len(samples)} requests failed: {failed[0].error}", outputs)


def _merge(samples: list[RequestOutput]) -> RequestOutput:
    """One prompt's n samples as one RequestOutput (outputs[j].index == j), its id without the suffix."""
    first = samples[0]
    outputs = [dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)]
    error = next((s.error for s in samples if s.error is not None), None)
    return dataclasses.replace(first, request_id=first.request_id.rsplit("-", 1)[0], outputs=outputs, error=error)


def _split_prompt(prompt: PromptType, index: int) -> tuple[Optional[str], Optional[list[int]]]:
    """(text, token ids) of prompt number `index`; a ValueError naming it for anything generate() cannot run."""
    text, ids = prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt and "prompt" not in prompt:
            raise ValueError(f"prompt {index}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if ids is None and text is None:
            raise ValueError(f"prompt {index}: 'prompt' must be a string, got None")
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, prompt
    elif not isinstance(prompt, str):
        raise ValueError(f"prompt {index} must be a string, a list of token ids or a dict, got "
                         f"{type(prompt).__name__}")
    if text is not None:
        if not isinstance(text, str):
            raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(text).__name__}")
        at = lone_surrogate(text)
        if at is not None:
            raise ValueError(f"prompt {index} is not valid text: it holds a lone surrogate "
                             f"(U+{ord(text[at]):04X} at index {at}), which UTF-8 cannot encode")
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError(f"prompt {index}: token ids must be a list of integers, got {ids!r:.80}")
        ids = list(ids)
    return text, ids
