"""Offline API: LLM(model, **engine_flags).generate(...) / .chat(...)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from pagedmoe.config import engine_config_from_kwargs
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

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is a string, a list of token ids, or
        {"prompt": str} / {"prompt_token_ids": [...]}; a list of ints alone is one prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        for p in params:
            p.validate()
        groups: list[list[str]] = []  # the engine requests of each prompt: one per sample (n)
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{next(self._ids)}"
                text, token_ids = _split_prompt(prompt)
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
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() instead")
        prompts = [{"prompt_token_ids": list(tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False))}
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


def _split_prompt(prompt: PromptType):
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")
