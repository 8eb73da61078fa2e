"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels; on the H200 their launch gaps are a large part
of a step at small batch. Each bucket's graph reads its inputs from static buffers; a step of B
sequences copies its inputs into the first B rows of the smallest bucket >= B and pads the rest
(slot -1: no KV write; context length 1 over block 0: harmless, discarded). Every graph writes its float32
logits into the first rows of one buffer [largest bucket, V] (allocated outside the graphs' pool): one
bucket's logits at a time, read (gathered by the runner) before the next replay on the same stream. Each
graph keeping its own, as the graphs' outputs, held 0.71 GiB for Qwen3-30B-A3B's 15 buckets up to 256.

# NOTE: the attention grid is sized by max_model_len (an upper bound of every context) so one
# graph stays valid as contexts grow; the MoE path must be free of host syncs (grouped_mm).
"""
from __future__ import annotations

import contextlib

import logging

import torch

from pagedmoe.planning.kv_sizing import decode_buckets
from pagedmoe.models.layers.attention import AttentionMetadata
from pagedmoe.models.moe_decoder import MoEForCausalLM
from pagedmoe.worker.device_memory import polling_paused

logger = logging.getLogger(__name__)


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
        self.logits: dict[int, torch.Tensor] = {}
        self.logits_buf: torch.Tensor | None = None   # [largest bucket, V] float32, every graph's output
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
                    out = self.model(self.input_ids[:B], self.positions[:B], meta)
            if self.logits_buf is None:   # the largest bucket comes first
                self.logits_buf = torch.empty_like(out)
            del out
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with polling_paused(), torch.cuda.graph(graph, pool=self.pool):
                self.logits[B] = self.model(self.input_ids[:B], self.positions[:B], meta,
                                            logits_out=self.logits_buf[:B])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[B] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode-only step of B sequences -> logits [B, V] (a view into the graph's output)."""
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
        self.graphs[bucket].replay()
        return self.logits[bucket][:B]
