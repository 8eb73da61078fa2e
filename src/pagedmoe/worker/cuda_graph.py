"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket; short prefill steps too, one graph per
token bucket (PrefillCudaGraphs, below).

A decode step launches a few hundred small kernels; on the H200 their launch gaps are a large part
of a step at small batch. Each bucket's graph reads its inputs from static buffers; a step of B
sequences copies its inputs into the first B rows of the smallest bucket >= B and pads the rest
(slot -1: no KV write; context length 1 over block 0: harmless, discarded). A graph ends at the final-normed
hidden states [bucket, H]; the lm_head runs after the replay on the real rows (MoEForCausalLM.compute_logits),
as vLLM does: float32 logits are a step's transient, not graph memory. Graphs that wrote their logits held
0.71 GiB for Qwen3-30B-A3B's 15 buckets up to 256 each keeping its own, then 0.22 GiB with one shared float32
buffer [256, V] and the largest bucket's bf16 logits in the pool.

# NOTE: the attention grid is sized by max_model_len (an upper bound of every context) so one
# graph stays valid as contexts grow; the MoE path must be free of host syncs (grouped_mm).
"""
from __future__ import annotations

import contextlib

import logging

import torch

from pagedmoe.experts.activity import padding_excluded
from pagedmoe.planning.kv_sizing import PREFILL_GRAPH_SEQS, decode_buckets, prefill_buckets
from pagedmoe.models.layers.attention import AttentionMetadata
from pagedmoe.models.moe_decoder import MoEForCausalLM
from pagedmoe.worker.device_memory import polling_paused

logger = logging.getLogger(__name__)


def replay(graph: torch.cuda.CUDAGraph, model: MoEForCausalLM, rows: int, bucket: int) -> None:
    """Replay a bucket's graph for a step of `rows` real tokens: the padding's routed experts are not counted in
    the activity table (experts/activity.py)."""
    if rows == bucket:
        graph.replay()
        return
    with padding_excluded(getattr(model.experts, "activity", None), rows):
        graph.replay()


class DecodeCudaGraphs:
    def __init__(self, model: MoEForCausalLM, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        B = self.buckets[-1]
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(B, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}   # each graph's output: [bucket, H] in the pool
        self.pool = None

    def _meta(self, B: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:B], query_start_loc=self.query_start_loc[:B + 1],
            seq_lens=self.seq_lens[:B], block_tables=self.block_tables[:B], max_query_len=1,
            max_seq_len=self.max_model_len, is_decode_only=True,
            query_start_loc_cpu=None, seq_lens_cpu=None)

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so the smaller graphs reuse its memory pool.
        for B in reversed(self.buckets):
            meta = self._meta(B)
            pager = getattr(self.model, "pager", None)
            with pager.no_host_copies() if pager is not None else contextlib.nullcontext():
                for _ in range(2):  # compile kernels and settle the allocator outside capture
                    self.model(self.input_ids[:B], self.positions[:B], meta, hidden_only=True)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with polling_paused(), torch.cuda.graph(graph, pool=self.pool):
                self.hidden[B] = self.model(self.input_ids[:B], self.positions[:B], meta, hidden_only=True)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[B] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Decode-only step of B sequences -> float32 logits [B, V], or of the rows logits_indices names (the
        lm_head after the replay, on those rows only)."""
        B = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= B)
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.slot_mapping[:B].copy_(meta.slot_mapping)
        self.seq_lens[:B].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:B, :width].copy_(meta.block_tables)
        if bucket > B:
            self.slot_mapping[B:bucket].fill_(-1)
            self.seq_lens[B:bucket].fill_(1)
            self.block_tables[B:bucket, 0].fill_(0)
        replay(self.graphs[bucket], self.model, B, bucket)
        hidden = self.hidden[bucket][:B]
        return self.model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])


class PrefillCudaGraphs:
    """Steps that are not decode-only (a prompt or a chunk of one, decode rows beside it) of at most `max_tokens`
    tokens and PREFILL_GRAPH_SEQS sequences, replayed from one CUDA graph per token bucket (16, 32, ..., 512).

    Eager, such a step is host-bound: a 512-token prefill of Qwen3-30B-A3B launched ~430 Triton kernels and as many
    torch ops for 16.8 ms of kernels in a 46.6 ms step on the H200 (benchmarks/results/session26). vLLM captures
    these sizes in graphs too. A step of T tokens and B sequences fills the first T rows and B sequences of the
    smallest bucket >= T; the rest is padding that writes nothing and is discarded:
      - sequences B .. S-1 are empty (query length 0: the attention's programs for them return at once);
      - the padding tokens T .. bucket-1 form sequence S, a fresh prompt of their own (positions 0.., context 0,
        slot -1: no KV write) over block 0, as the decode graphs' padding rows read block 0: finite values (the
        cache starts zeroed and holds only what real steps wrote), so their routing stays in range.
    The attention grid is sized by the bucket (max_query_len = bucket) and S + 1 sequences; a graph ends at the
    hidden states of the sampling rows (at most S), the lm_head runs after it. Captured in the decode graphs' pool,
    after them (worker/model_runner.py), with resident experts only: a pager's copies are planned per forward.
    """

    def __init__(self, model: MoEForCausalLM, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.buckets = prefill_buckets(max_tokens)
        self.max_model_len = max_model_len
        self.max_seqs = S = min(PREFILL_GRAPH_SEQS, max_seqs)
        T = self.buckets[-1]
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.pad_positions = torch.arange(T, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(S + 2, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(S + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(S + 1, max_blocks_per_seq, dtype=torch.int32, device=device)  # row S: 0s
        self.logits_indices = torch.zeros(S, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}   # each graph's output: [S, H] in the pool
        self.replays = 0

    def _meta(self, T: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:T], query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, max_query_len=T, max_seq_len=self.max_model_len, is_decode_only=False,
            query_start_loc_cpu=None, seq_lens_cpu=None)

    def _set_sequences(self, T: int, bucket: int, qsl_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor) -> None:
        """query_start_loc and seq_lens of the step's B sequences, the empty ones and the padding's (host-built,
        one copy each)."""
        S, B = self.max_seqs, seq_lens_cpu.shape[0]
        qsl = torch.full((S + 2,), T, dtype=torch.int32)
        qsl[:B + 1] = qsl_cpu
        qsl[S + 1] = bucket
        lens = torch.zeros(S + 1, dtype=torch.int32)
        lens[:B] = seq_lens_cpu
        lens[S] = bucket - T
        pinned = self.query_start_loc.is_cuda
        self.query_start_loc.copy_(qsl.pin_memory() if pinned else qsl, non_blocking=pinned)
        self.seq_lens.copy_(lens.pin_memory() if pinned else lens, non_blocking=pinned)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Largest bucket first, into `pool` (the decode graphs'); each graph's output is the hidden states of the
        S sampling rows."""
        one = torch.ones(1, dtype=torch.int32)
        for T in reversed(self.buckets):
            # one sequence of T - 1 tokens and one padding token: every program of the grid's shape runs once
            self._set_sequences(T - 1, T, torch.tensor([0, T - 1], dtype=torch.int32), one * (T - 1))
            meta = self._meta(T)
            for _ in range(2):  # compile kernels and settle the allocator outside capture
                self.model(self.input_ids[:T], self.positions[:T], meta, self.logits_indices, hidden_only=True)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with polling_paused(), torch.cuda.graph(graph, pool=pool):
                self.hidden[T] = self.model(self.input_ids[:T], self.positions[:T], meta, self.logits_indices,
                                            hidden_only=True)
            self.graphs[T] = graph
        torch.cuda.synchronize()
        logger.info("captured prefill CUDA graphs for steps of up to %d sequences and %s tokens", self.max_seqs,
                    self.buckets)

    def can_run(self, num_tokens: int, num_seqs: int, width: int) -> bool:
        return (bool(self.graphs) and num_tokens <= self.buckets[-1] and num_seqs <= self.max_seqs
                and width <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor:
        """A step of T tokens and B sequences (can_run) -> float32 logits [N, V] of its N sampling rows (the
        lm_head after the replay)."""
        bucket = self.fill(input_ids, positions, meta, logits_indices)
        replay(self.graphs[bucket], self.model, input_ids.shape[0], bucket)
        self.replays += 1
        return self.model.compute_logits(self.hidden[bucket][:logits_indices.shape[0]])

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             logits_indices: torch.Tensor) -> int:
        """The static inputs of the step's bucket, padded (the class's docstring); returns the bucket."""
        T, B, N = input_ids.shape[0], meta.seq_lens.shape[0], logits_indices.shape[0]
        bucket = next(b for b in self.buckets if b >= T)
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self.slot_mapping[:T].copy_(meta.slot_mapping)
        if bucket > T:
            self.input_ids[T:bucket].zero_()
            self.positions[T:bucket].copy_(self.pad_positions[:bucket - T])
            self.slot_mapping[T:bucket].fill_(-1)
        self._set_sequences(T, bucket, meta.query_start_loc_cpu, meta.seq_lens_cpu)
        self.block_tables[:B, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.logits_indices[:N].copy_(logits_indices)
        self.logits_indices[N:].zero_()   # rows of an earlier, larger bucket would index past this one
        return bucket
