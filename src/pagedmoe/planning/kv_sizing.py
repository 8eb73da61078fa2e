"""The KV sizing measured at start-up: how the device budget splits between the loaded weights, the
activation estimate and KV blocks; and the host-memory limit of the host tier. Pure Python.

The planner (planning/planner.py) *models* the same split from the config alone, before loading.
"""
from __future__ import annotations

import os
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
    # Device memory that is neither weights, activations nor KV: measured (CUDA context, torch's cache and
    # fragmentation, driver-side memory at start-up) plus what start-up reserves for what it cannot measure
    # yet (CUDA-graph pools, workspaces, a dynamic-precision build): `device_reserve_bytes`.
    reserve_bytes: int = 0

    def summary(self) -> str:
        reserve = f", reserved {self.reserve_bytes / GiB:.2f} GiB (context, graphs, workspaces)" \
            if self.reserve_bytes else ""
        return (f"budget {self.budget_bytes / GiB:.2f} GiB: weights {self.weight_bytes / GiB:.2f} GiB, "
                f"activations {self.activation_bytes / GiB:.2f} GiB{reserve}, KV cache {self.kv_bytes / GiB:.2f} "
                f"GiB ({self.num_kv_blocks} blocks, {self.kv_capacity_tokens} tokens)")


def size_kv_cache(budget_bytes: int, weight_bytes: int, activation_bytes: int, kv_bytes_per_block: int,
                  block_size: int, max_model_len: int, max_useful_blocks: int, reserve_bytes: int = 0) -> KVSizing:
    """Give the KV cache everything the weights, activations and the reserve leave, up to what can be used."""
    min_blocks = -(-max_model_len // block_size)
    free = budget_bytes - weight_bytes - activation_bytes - reserve_bytes
    num_blocks = min(free // kv_bytes_per_block if free > 0 else 0, max(max_useful_blocks, min_blocks))
    if num_blocks < min_blocks:
        need = weight_bytes + activation_bytes + reserve_bytes + min_blocks * kv_bytes_per_block
        reserve = f", the reserve ({reserve_bytes / GiB:.2f} GiB: context, graphs, workspaces)" if reserve_bytes else ""
        raise BudgetError(
            f"a budget of {budget_bytes / GiB:.2f} GiB cannot hold the weights ({weight_bytes / GiB:.2f} GiB), "
            f"activations ({activation_bytes / GiB:.2f} GiB){reserve} and one sequence of max_model_len="
            f"{max_model_len} tokens; the minimum is {need / GiB:.2f} GiB (or lower --max-model-len)")
    return KVSizing(budget_bytes, weight_bytes, activation_bytes, kv_bytes_per_block, int(num_blocks),
                    block_size, reserve_bytes)


# -- what --gpu-memory-gb must hold beyond weights, activations and KV ---------------------------------
# The budget is all device memory the process holds (as vLLM counts --gpu-memory-utilization). Start-up
# measures what exists before the KV cache is sized (context, weights, experts, buffers, torch's cache)
# and reserves what does not exist yet:
CUDA_CONTEXT_BYTES = 600 << 20      # the context with torch's handles, for `pagedmoe plan` (no device)
WORKSPACE_BYTES = 384 << 20         # cuBLAS / cuBLASLt workspaces per stream, Triton modules loaded later
FRAGMENTATION_FRACTION = 0.10       # torch's pool rounds blocks up and keeps freed ones split: a share of
                                    # what is allocated and freed while running (activations, graphs, builds)


# Prefill CUDA graphs (worker/cuda_graph.py::PrefillCudaGraphs): steps of up to this many tokens by default
# (--prefill-graph-tokens) and of up to PREFILL_GRAPH_SEQS sequences
PREFILL_GRAPH_TOKENS = 512
# PAGEDMOE_PREFILL_GRAPH_SEQS raises the sequence count for measurements (an 8 x 1024-token prefill step has 8)
PREFILL_GRAPH_SEQS = int(os.environ.get("PAGEDMOE_PREFILL_GRAPH_SEQS", "4"))


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes the decode CUDA graphs are captured for (worker/cuda_graph.py); here because their pool
    is part of the device budget."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    out = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts the prefill CUDA graphs are captured for (worker/cuda_graph.py::PrefillCudaGraphs): powers of
    two from 16 up to max_tokens, and max_tokens; none for 0."""
    if max_tokens <= 0:
        return []
    return sorted({b for b in (16 << i for i in range(16)) if b < max_tokens} | {max_tokens})


def graph_pool_bytes(buckets: list[int], hidden_size: int, moe_intermediate_size: int, top_k: int,
                     vocab_size: int, dtype_bytes: int, prefill_tokens: int = 0) -> int:
    """The CUDA graphs' memory: one step's activations at the largest decode bucket or the largest prefill graph's
    tokens (the graphs share the pool, largest first). The graphs end at the hidden states: the lm_head, the
    logits and the sampler run after the replay and are a step's transients, which the profile step measures
    (worker/cuda_graph.py). Measured on the H200 when each bucket kept its own float32 logits: 0.91 GiB for
    Qwen3-30B-A3B's 15 buckets up to 256, 0.71 GiB of it those logits (sum(buckets) x V x 4 bytes); until
    2026-12-07 one shared float32 buffer and the largest bucket's bf16 logits, 0.22 GiB."""
    if not buckets:
        return 0
    return estimate_activation_bytes(max(max(buckets), prefill_tokens), 0, hidden_size, moe_intermediate_size,
                                     top_k, vocab_size, dtype_bytes)


def start_up_reserve_bytes(activation_bytes: int, max_num_seqs: int, hidden_size: int, moe_intermediate_size: int,
                           top_k: int, vocab_size: int, dtype_bytes: int, cuda_graphs: bool = True,
                           build_bytes: int = 0, context_bytes: int = 0,
                           prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS) -> int:
    """device_reserve_bytes for an engine's flags: the graph pool of its decode buckets and prefill graphs when
    it captures graphs (the prefill graphs' tokens counted whether or not the placement lets them be captured: a
    few MiB). One formula for the engine, its placement search and `pagedmoe plan`."""
    graphs = (graph_pool_bytes(decode_buckets(max_num_seqs), hidden_size, moe_intermediate_size, top_k, vocab_size,
                               dtype_bytes, prefill_graph_tokens) if cuda_graphs else 0)
    return device_reserve_bytes(activation_bytes, graphs, build_bytes, context_bytes)


def device_reserve_bytes(activation_bytes: int, graph_bytes: int = 0, build_bytes: int = 0,
                         context_bytes: int = 0) -> int:
    """What start-up keeps out of the KV cache beyond the activations for memory it cannot measure before
    sizing it: `context_bytes` (0 when the measured figure holds it already), CUDA-graph pools, a dynamic-
    precision build's transient (`build_bytes`), workspaces, and allocator fragmentation (a share of what is
    allocated and freed while running)."""
    churn = activation_bytes + graph_bytes + build_bytes
    return context_bytes + graph_bytes + build_bytes + WORKSPACE_BYTES + int(FRAGMENTATION_FRACTION * churn)


def dynamic_build_bytes(num_experts: int, expert_bytes: int, expert_numel: int) -> int:
    """A dynamic-precision build's transient: built one layer at a time (experts/dynamic/manager.py), it holds one
    layer's new version beside the old one (at most every expert of the layer exact), plus the quantiser's
    float32 temporaries of one expert (its rows, their scaled copy and the rounding)."""
    return num_experts * expert_bytes + 3 * 4 * expert_numel


def process_device_bytes(total_bytes: int, free_bytes: int, others_bytes: int) -> int:
    """The process's device memory from the driver's free/total (torch.cuda.mem_get_info): the device's use
    less what other processes held when the count started."""
    return max(0, total_bytes - free_bytes - others_bytes)


def others_at_start(total_bytes: int, free_bytes: int, own_bytes: int) -> int:
    """What other processes hold at the first reading: the device's use less this process's own bytes then
    (its context, and whatever torch reserved already). Never negative."""
    return max(0, total_bytes - free_bytes - own_bytes)


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


# The expert GEMMs of a large forward (layers/moe.py::experts_grouped_mm) run a chunk of tokens at a time, each
# chunk's transients at most this many bytes: whole, those of 8192 tokens were the step's activation peak (1.88 GiB
# measured for Qwen3-30B-A3B, 2.25 GiB for Mixtral-8x7B on the H200, before the chunks). 512 MiB keeps each
# expert's GEMM several hundred rows deep (Mixtral: 3120 tokens a chunk, 780 rows an expert; Qwen3-30B-A3B: 9362,
# so 8192 in one piece).
GROUPED_MM_CHUNK_BYTES = 512 << 20


def grouped_mm_row_bytes(hidden: int, inter: int, elem: int) -> int:
    """Transient bytes per routed row at experts_grouped_mm's peak on CUDA (its Triton epilogues): the gathered
    row with the gate/up output, or the gate/up output with the activation made from it (the expert-ordered
    output and the activation, elem * (hidden + inter), is less than either)."""
    return elem * max(hidden + 2 * inter, 3 * inter)


def grouped_mm_chunk_tokens(top_k: int, hidden: int, inter: int, elem: int) -> int:
    """Tokens per experts_grouped_mm chunk."""
    return max(1, GROUPED_MM_CHUNK_BYTES // (top_k * grouped_mm_row_bytes(hidden, inter, elem)))


def estimate_activation_bytes(max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int,
                              moe_intermediate_size: int, top_k: int, vocab_size: int, dtype_bytes: int) -> int:
    """Peak transient memory of one step: hidden states and their copies, the routed-token buffers of the
    expert GEMMs (one chunk's, grouped_mm_chunk_tokens, and their output), and float32 logits with the sampler's
    working copies."""
    T = max_num_batched_tokens
    hidden = T * hidden_size * dtype_bytes * 8
    chunk = min(T, grouped_mm_chunk_tokens(top_k, hidden_size, moe_intermediate_size, dtype_bytes))
    routed = chunk * top_k * grouped_mm_row_bytes(hidden_size, moe_intermediate_size, dtype_bytes) \
        + T * hidden_size * dtype_bytes
    logits = min(max_num_seqs, T) * vocab_size * 4 * 4
    return int(hidden + routed + logits)
