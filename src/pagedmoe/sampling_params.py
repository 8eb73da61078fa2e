"""SamplingParams and the output types returned by LLM.generate (vLLM's names and meaning)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Union

from pagedmoe.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick the next tokens. temperature 0 means greedy.

    Order applied to the logits (as vLLM): logit_bias, then the penalties (repetition_penalty over the
    prompt and the output so far; presence_penalty and frequency_penalty over the output so far, as
    OpenAI defines them), then temperature, top_k, top_p and min_p filtering, then sampling (greedy
    takes the argmax of the penalised logits). logprobs=N returns, per generated token, the
    log-probabilities (of the raw model distribution) of the N most likely tokens and of the sampled one.
    prompt_logprobs=K returns, per prompt token after the first, the logprob and rank of that token and the
    K most likely ones at its position (RequestOutput.prompt_logprobs; the prompt is computed whole, no prefix
    cache hit). n > 1 returns n samples of the prompt (with a seed, sample j uses seed + j).
    structured_outputs constrains the output (a JSON schema, a regex, a choice, a grammar: structured_outputs.py):
    disallowed tokens get -inf before everything above, so logprobs are of the masked distribution (as vLLM's).
    reasoning_end_token_id (with structured_outputs): the constraint starts after this token has been sampled (the
    end of a thinking model's reasoning, `</think>`; the server's --reasoning-parser sets it, as vLLM constrains only
    the text after the reasoning); the tokens before it and the token itself are unconstrained.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None
    reasoning_end_token_id: Optional[int] = None
    # "cumulative": LLMEngine.step returns this request's output after every token (streaming);
    # "final_only": only once it finishes (LLM.generate and the offline benchmarks: no per-step copies).
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # a list or tuple is copied; anything else is left for validate() to name
        if self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        # Types first: a float top_k or a string temperature would otherwise pass and fail inside an engine step.
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is None and name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 1e6 or self.repetition_penalty != self.repetition_penalty:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias must map non-negative integer token ids to biases")
            if any(isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0
                   for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be numbers in [-100, 100]")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:  # vLLM (and llama.cpp's --top-k): 0 and -1 both disable
            raise ValueError(f"top_k must be 0 or -1 (disable) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.output_kind not in ("cumulative", "final_only"):
            raise ValueError(f"output_kind must be 'cumulative' or 'final_only', got {self.output_kind!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.compiled()  # a bad schema, regex or grammar fails here (made once)
        if self.reasoning_end_token_id is not None:
            token = self.reasoning_end_token_id
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"reasoning_end_token_id must be a non-negative token id, got {token!r}")
            if self.structured_outputs is None:
                raise ValueError("reasoning_end_token_id delays the structured_outputs constraint; it needs one")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalised(self) -> bool:
        """Whether the logits need the token history (penalties) or a bias before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def for_sample(self, j: int) -> "SamplingParams":
        """The parameters of sample j of n: one sequence each, seeds seed + j (vLLM's convention)."""
        import dataclasses

        seed = None if self.seed is None else self.seed + j
        if seed is not None and seed >= 2 ** 64:  # torch seeds are at most 2**64 - 1: wrap around
            seed -= 2 ** 64
        return dataclasses.replace(self, n=1, seed=seed)


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (vLLM's shape)
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None  # finish_reason "error": what failed (e.g. out of GPU memory in its step)
