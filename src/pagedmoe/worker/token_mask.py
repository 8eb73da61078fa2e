"""Token bitmasks (structured outputs): bit t of row j says whether token t is allowed in sampling row rows[j].

The bitmask is int32 [R, W] on the host, 32 tokens a word, token t at bit t % 32 of word t // 32 (llguidance's
layout). It is copied to the device as it is (V / 8 bytes a row) and unpacked there a byte at a time: on a
little-endian int32, token t is bit t % 8 of byte t // 8, so the unpacked rows are [R, 8 * 4W] uint8.
"""
from __future__ import annotations

import torch

from pagedmoe.worker.host_copy import to_device_async


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [R, W] bitmask (any device) -> bool [R, vocab]: token t of row j allowed. Columns past the bitmask's
    tokens (W * 32) are not allowed."""
    R, W = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8)                                  # [R, 4W]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = ((as_bytes.unsqueeze(-1) >> shifts) & 1).view(R, 32 * W).bool()             # [R, 32W]
    if vocab <= 32 * W:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(R, vocab - 32 * W)], dim=1)


def _allowed_rows(bitmask: torch.Tensor, rows: list[int], num_tokens: int, V: int, device) -> tuple:
    """(allowed bool [R, V] on `device`, rows as an index tensor there): bitmask[j]'s tokens below `num_tokens`."""
    allowed = allowed_tokens(to_device_async(bitmask, device), V)
    if num_tokens < V:
        allowed[:, num_tokens:] = False
    return allowed, to_device_async(torch.tensor(rows, dtype=torch.int64), device)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """logits [N, V] -> a copy whose rows[j] keep only the tokens bitmask[j] allows (others -inf). `num_tokens`:
    the tokenizer's vocabulary, which the bitmask covers; logits columns at or past it (the embedding's padding
    rows) are never allowed, and bits past V are ignored."""
    allowed, idx = _allowed_rows(bitmask, rows, num_tokens, logits.shape[-1], logits.device)
    out = logits.clone()
    out[idx] = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    return out


def keep_grammar_when_empty(masked: torch.Tensor, unbanned: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
                            num_tokens: int) -> torch.Tensor:
    """masked [N, V] (`apply_token_bitmask`'s output, in place): each row rows[j] that allows no token at all takes
    instead `unbanned`'s row with only the tokens bitmask[j] allows (the grammar alone, before another mask, such as
    min_tokens', banned its only tokens). On the device, without a sync."""
    allowed, idx = _allowed_rows(bitmask, rows, num_tokens, masked.shape[-1], masked.device)
    current = masked.index_select(0, idx)
    grammar_only = unbanned.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    empty = (current == float("-inf")).all(dim=-1, keepdim=True)
    masked[idx] = torch.where(empty, grammar_only, current)
    return masked
