"""The KV sizing measured at start-up: how the device budget splits between the loaded weights, the
activation estimate and KV blocks; and the host-memory limit of the host tier. Pure Python.

The planner (planning/planner.py) *models* the same split from the config alone, before loading.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GiB = 1024 ** 3


class BudgetError(ValueError):
    """The budget cannot hold the model plus one full-length sequence."""


class KVBlocks:
    """What a plan's KV share comes to; for dataclasses with num_kv_blocks, kv_bytes_per_block, block_size."""

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass(frozen=True)
class KVSizing(KVBlocks):
    """The measured split at start-up (after loading): the budget less the loaded weights and the
    activation estimate, given to KV blocks (planning/planner.py models the same split from the config)."""

    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_block: int
    num_kv_blocks: int
    block_size: int

    def summary(self) -> str:
        return (f"budget {self.budget_bytes / GiB:.2f} GiB: weights {self.weight_bytes / GiB:.2f} GiB, "
                f"activations {self.activation_bytes / GiB:.2f} GiB, KV cache {self.kv_bytes / GiB:.2f} GiB "
                f"({self.num_kv_blocks} blocks, {self.kv_capacity_tokens} tokens)")


def size_kv_cache(budget_bytes: int, weight_bytes: int, activation_bytes: int, kv_bytes_per_block: int,
                block_size: int, max_model_len: int, max_useful_blocks: int) -> KVSizing:
    """Give the KV cache everything the weights and activations leave, up to what can be used."""
    min_blocks = -(-max_model_len // block_size)
    free = budget_bytes - weight_bytes - activation_bytes
    num_blocks = min(free // kv_bytes_per_block if free > 0 else 0, max(max_useful_blocks, min_blocks))
    if num_blocks < min_blocks:
        need = weight_bytes + activation_bytes + min_blocks * kv_bytes_per_block
        raise BudgetError(
            f"a budget of {budget_bytes / GiB:.2f} GiB cannot hold the weights ({weight_bytes / GiB:.2f} GiB), "
            f"activations ({activation_bytes / GiB:.2f} GiB) and one sequence of max_model_len="
            f"{max_model_len} tokens; the minimum is {need / GiB:.2f} GiB (or lower --max-model-len)")
    return KVSizing(budget_bytes, weight_bytes, activation_bytes, kv_bytes_per_block, int(num_blocks),
                      block_size)


# Host memory the host tier leaves to everything else (the process, page cache, other tenants): a tenth
# of RAM, at least 4 GiB, but never more than a quarter of a small machine's RAM (an 8 GiB laptop keeps
# 2 GiB back, not half of it).
HOST_RESERVE_MIN = 4 * GiB
HOST_RESERVE_FRACTION = 0.10
HOST_RESERVE_SMALL_FRACTION = 0.25


def detect_host_budget_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """Pinned host memory the host tier may take: MemAvailable now, less the reserve (a tenth of MemTotal,
    at least min(4 GiB, a quarter of MemTotal)); None (unbounded) when `meminfo` cannot be read or lacks
    either line. Never negative."""
    try:
        with open(meminfo) as f:
            text = f.read()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    total = fields["MemTotal"]
    reserve = max(min(HOST_RESERVE_MIN, int(total * HOST_RESERVE_SMALL_FRACTION)), int(total * HOST_RESERVE_FRACTION))
    return max(0, fields["MemAvailable"] - reserve)


def estimate_activation_bytes(max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int,
                              moe_intermediate_size: int, top_k: int, vocab_size: int, dtype_bytes: int) -> int:
    """Peak transient memory of one step: hidden states and their copies, the routed-token buffers of the
    expert GEMMs, and float32 logits with the sampler's working copies."""
    T = max_num_batched_tokens
    hidden = T * hidden_size * dtype_bytes * 8
    routed = T * top_k * (hidden_size + 3 * moe_intermediate_size) * dtype_bytes + T * hidden_size * 4
    logits = min(max_num_seqs, T) * vocab_size * 4 * 4
    return int(hidden + routed + logits)
