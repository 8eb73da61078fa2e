"""Logit bias and the repetition / presence / frequency penalties, before temperature and filtering.

On rows of float32 logits [N, V] whose SamplingParams ask for them (`params.penalised`); other rows and
the input tensor are left as they are. Meanings (vLLM's, which follow OpenAI and HF transformers):
  - logit_bias: add bias[t] to token t's logit;
  - repetition_penalty r: for a token seen in the prompt or the output so far, logit / r if the logit
    is positive, logit * r otherwise;
  - frequency_penalty f, presence_penalty p: subtract f * count(t) + p * [count(t) > 0], counts over
    the output so far.

Shapes: R penalised rows, L longest history of those rows.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from pagedmoe.sampling_params import SamplingParams
from pagedmoe.worker.host_copy import to_device_async

MIN_REPETITION_PENALTY = 1e-6


def _counts(seqs: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[R, V] float32: how often each token occurs in each sequence (ids >= V are ignored)."""
    width = max(1, max(map(len, seqs)))
    ids = torch.full((len(seqs), width), vocab, dtype=torch.int64)
    for r, seq in enumerate(seqs):
        if seq:
            ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.int64).clamp(max=vocab)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return to_device_async(counts[:, :vocab], torch.device(device))


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: Optional[list[tuple[Sequence[int], Sequence[int]]]]) -> torch.Tensor:
    """histories[i] = (prompt token ids, output token ids so far) of row i."""
    rows = [i for i, p in enumerate(params) if p.penalised]
    if not rows:
        return logits
    V, dev = logits.shape[-1], logits.device
    ps = [params[i] for i in rows]
    idx = torch.tensor(rows, device=dev)
    sub = logits.index_select(0, idx)
    for r, p in enumerate(ps):
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < V]
            if ids:
                sub[r, ids] += torch.tensor([float(p.logit_bias[t]) for t in ids], device=dev)
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in ps):
        out_counts = _counts([histories[i][1] for i in rows], V, dev)
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = (_counts([histories[i][0] for i in rows], V, dev) > 0) | (out_counts > 0)
            # Below MIN_REPETITION_PENALTY a positive logit / r can overflow float32 (+inf, then a NaN softmax
            # that stops the step); at it, sampling already keeps only the largest penalised logits.
            rep = torch.tensor([max(p.repetition_penalty, MIN_REPETITION_PENALTY) for p in ps],
                               device=dev).unsqueeze(-1)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([p.frequency_penalty for p in ps], device=dev).unsqueeze(-1)
        pres = torch.tensor([p.presence_penalty for p in ps], device=dev).unsqueeze(-1)
        sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    out = logits.clone()
    out[idx] = sub
    return out
