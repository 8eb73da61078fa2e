"""Token sampling: penalties and logit bias (penalties.py), greedy, temperature, top-k, top-p, min-p,
per-request seeds, logprobs.

Filters act on rows of float32 logits [N, V]; a filtered-out token gets -inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedmoe.sampling_params import Logprob, SamplingParams
from pagedmoe.worker.host_copy import to_device_async
from pagedmoe.worker.penalties import apply_penalties


# The filters work on at most this many rows at a time, all of them in one pass, into one new [N, V] tensor: a sort
# of [N, V] float32 logits holds its values and int64 indices (12 bytes a logit) beside the softmax and its running
# sum, and each filter made its own copy: 1.17 GB above the logits at 256 rows of Qwen3's 151,936 tokens (top-k,
# top-p and logprobs asked; 0.31 GB by row chunks, measured on the CPU). Start-up's profile step measures the sampler
# at its largest and keeps that out of the KV cache (engine/profile_run.py): the 60.87 GiB Qwen3-30B-A3B run of
# 2026-12-07 had 0.57 GiB of KV cache. Row by row the result is the same.
FILTER_ROWS = 32
# top-k by torch.topk (the k largest, no full sort) while the largest k asked is at most this
TOPK_MAX = 1024


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: Optional[int] = None) -> torch.Tensor:
    """Keep the top_k[i] largest logits of row i (top_k <= 0 or >= V keeps all). Ties at the k-th value stay.
    k_max: the largest top_k in [1, V) of any row, known on the host (else read from top_k: a device sync)."""
    V = logits.shape[-1]
    if k_max is None:
        inside = top_k[(top_k > 0) & (top_k < V)]
        k_max = int(inside.max()) if inside.numel() else 0
    if k_max == 0:
        return logits
    keep_all = (top_k <= 0) | (top_k >= V)
    largest = logits.topk(k_max, dim=-1).values if k_max <= TOPK_MAX else logits.sort(dim=-1, descending=True).values
    k = torch.where(keep_all, torch.ones_like(top_k), top_k.clamp(max=k_max))
    kth = largest.gather(-1, (k - 1).unsqueeze(-1).long())
    kth = kth.masked_fill(keep_all.unsqueeze(-1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to at least top_p[i]."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop_sorted[..., 0] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[i] times the row's largest probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def to_device(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A host list as a device tensor without waiting for the GPU: torch.tensor(..., device=cuda) copies
    and then synchronises the stream, which under --async-scheduling would wait for the step in flight."""
    return to_device_async(torch.tensor(values, dtype=dtype), torch.device(device))


def processed_logits(logits: torch.Tensor, params: list[SamplingParams], probs: bool = False) -> torch.Tensor:
    """Temperature then top-k, top-p, min-p, for rows that sample (greedy rows are left as they are); with probs
    their softmax. FILTER_ROWS rows at a time into one new tensor (the input stays as it is: logprobs are of the
    raw logits); the logits themselves when nothing applies."""
    device, V = logits.device, logits.shape[-1]
    temps = [1.0 if p.greedy else p.temperature for p in params]
    k_max = max((p.top_k for p in params if 0 < p.top_k < V), default=0)
    # per-row values on the device only for the steps that use them (x / 1.0 is x: at temperature 1, vLLM's
    # default, no division and no host-to-device copy)
    temp = None if all(t == 1.0 for t in temps) else to_device(temps, device).unsqueeze(-1)
    # top_k >= V keeps every token: V itself says so and fits the tensor (a request may send 2**70)
    top_k = to_device([min(p.top_k, V) for p in params], device) if k_max else None
    top_p = to_device([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in params) else None
    min_p = to_device([p.min_p for p in params], device) if any(p.min_p > 0.0 for p in params) else None
    if temp is None and top_k is None and top_p is None and min_p is None:
        return torch.softmax(logits, dim=-1) if probs else logits   # one kernel, nothing beside its result

    def rows(i: int, j: int) -> torch.Tensor:
        x = logits[i:j] if temp is None else logits[i:j] / temp[i:j]
        if top_k is not None:
            x = apply_top_k(x, top_k[i:j], k_max)
        if top_p is not None:
            x = apply_top_p(x, top_p[i:j])
        if min_p is not None:
            x = apply_min_p(x, min_p[i:j])
        return x

    N = logits.shape[0]
    if N <= FILTER_ROWS:
        return torch.softmax(rows(0, N), dim=-1) if probs else rows(0, N)
    out = torch.empty_like(logits)
    for i in range(0, N, FILTER_ROWS):
        if probs:   # written in place: no copy of the chunk
            torch.softmax(rows(i, i + FILTER_ROWS), dim=-1, out=out[i:i + FILTER_ROWS])
        else:
            out[i:i + FILTER_ROWS] = rows(i, i + FILTER_ROWS)
    return out


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[Optional[dict[int, Logprob]]]
    sampled_logprob: list[Optional[float]]


class DeviceSample:
    """One step's sampled tokens (and logprob tensors) still on the device. ``start_copy()`` queues their
    copy into pinned host memory behind the step and records an event; ``result()`` waits for that event
    only (not for later steps queued since) and builds the SampleOutput: the one blocking readback of a
    step (``result`` counts them in ``readbacks``, for tests)."""

    readbacks = 0

    def __init__(self, tokens: torch.Tensor, params: list[SamplingParams], logprob_parts=None) -> None:
        self.params = params
        self.tokens = tokens  # [N] int64 on the device: the next step's inputs are gathered from it
        self._tensors = [tokens] + ([] if logprob_parts is None else list(logprob_parts))  # host copies, once made
        self._event = None

    def start_copy(self) -> None:
        if self._event is not None or self.tokens.device.type != "cuda":
            return
        host = []
        for t in self._tensors:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            host.append(pinned)
        # NOTE: dropping the device logprob tensors here is safe: the caching allocator hands their memory
        # only to work queued after the copy (one stream)
        self._tensors = host
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> SampleOutput:
        DeviceSample.readbacks += 1
        if self._event is not None:
            self._event.synchronize()
        tokens = self._tensors[0]
        token_list = tokens.tolist()
        if len(self._tensors) == 1:
            return SampleOutput(token_list, [None] * len(self.params), [None] * len(self.params))
        wants = [p.logprobs for p in self.params]
        return SampleOutput(token_list, *_host_logprobs(token_list, wants, *self._tensors[1:]))


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[Optional[torch.Generator]],
               histories: Optional[list[tuple[list[int], list[int]]]] = None) -> SampleOutput:
        """logits [N, V] float32 for N sequences; generators[i] is the request's own (seeded) or None;
        histories[i] = (prompt ids, output ids so far), needed when a row has penalties (penalties.py).
        Logprobs are of the raw logits, as vLLM returns them."""
        return self.sample_device(logits, params, generators, histories).result()

    def sample_device(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[Optional[torch.Generator]],
                      histories: Optional[list[tuple[list[int], list[int]]]] = None) -> DeviceSample:
        """As sample(), without reading anything back: the tokens and logprobs stay on the device."""
        N = logits.shape[0]
        greedy = [p.greedy for p in params]
        adjusted = apply_penalties(logits, params, histories)
        if all(greedy):
            tokens = adjusted.argmax(dim=-1)
        else:
            probs = processed_logits(adjusted, params, probs=True)
            shared_rows = [i for i in range(N) if not greedy[i] and generators[i] is None]
            if len(shared_rows) == N:   # every row from the engine's generator: the same draw, no gather/scatter
                tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
            else:
                tokens = adjusted.argmax(dim=-1)
                if shared_rows:
                    idx = to_device(shared_rows, logits.device)
                    tokens[idx] = torch.multinomial(probs[idx], 1, generator=self.generator).squeeze(-1)
                for i in range(N):
                    if not greedy[i] and generators[i] is not None:
                        tokens[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
            del probs   # not held while the logprobs are computed
        return DeviceSample(tokens, params, self._logprob_tensors(logits, tokens, params))

    @staticmethod
    def _logprob_tensors(logits, tokens, params):
        """(top values, top ids, the sampled token's logprob, its rank) on the device; None if none asked."""
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return None
        return _logprob_parts(logits, tokens, max(max(w or 0 for w in want), 1))


def prompt_logprobs(logits: torch.Tensor, targets: list[int], wants: list[int]) -> list[dict[int, Logprob]]:
    """SamplingParams.prompt_logprobs: raw logits [M, V] of prompt positions and the prompt token after each ->
    per row, that token's logprob and rank, then the wants[i] most likely tokens (vLLM's entries). Reads back."""
    parts = _logprob_parts(logits, to_device(targets, logits.device), max(max(wants), 1))
    return _host_logprobs(targets, wants, *(t.cpu() for t in parts))[0]


def _logprob_parts(logits, tokens, n_top):
    """(top n_top values, their ids, the logprob of tokens[i], its rank) of each row's log_softmax, on the device."""
    parts = []
    for i in range(0, logits.shape[0], FILTER_ROWS):   # FILTER_ROWS rows at a time: no [N, V] copy
        logprobs = torch.log_softmax(logits[i:i + FILTER_ROWS], dim=-1)
        top_vals, top_ids = logprobs.topk(n_top, dim=-1)
        chosen = logprobs.gather(-1, tokens[i:i + FILTER_ROWS].unsqueeze(-1)).squeeze(-1)
        ranks = (logprobs > chosen.unsqueeze(-1)).sum(-1) + 1
        parts.append((top_vals, top_ids, chosen, ranks))
    return tuple(torch.cat(p) for p in zip(*parts))


def _host_logprobs(token_list, wants, top_vals, top_ids, chosen, ranks):
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen, ranks = chosen.tolist(), ranks.tolist()
    out_lp, out_chosen = [], []
    for i, w in enumerate(wants):
        if w is None:
            out_lp.append(None)
            out_chosen.append(None)
            continue
        entry = {token_list[i]: Logprob(chosen[i], ranks[i])}
        for r in range(w):
            entry.setdefault(top_ids[i][r], Logprob(top_vals[i][r], r + 1))
        out_lp.append(entry)
        out_chosen.append(chosen[i])
    return out_lp, out_chosen
