"""Scheduler output -> input tensors -> model -> logits of the rows that sample.

Shapes: T tokens in the step, B scheduled sequences, N sequences that sample a token this step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pagedmoe.scheduler_output import SchedulerOutput
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.kvcache.kv_cache import LendableKVCache, allocate_kv_cache, kv_cache_bytes
from pagedmoe.models.layers.attention import AttentionMetadata, make_attention_backend
from pagedmoe.models.layers.fused_ops import apply_fused_ops, require_triton, resolve_fused_ops
from pagedmoe.models.layers.linear import apply_backbone_gemm, resolve_backbone_gemm
from pagedmoe.models.layers.moe import MOE_BACKENDS, sync_free
from pagedmoe.models.moe_decoder import MoEForCausalLM
from pagedmoe.oom import naming_oom
from pagedmoe.worker.block_tables import BlockTables
from pagedmoe.planning.kv_sizing import PREFILL_GRAPH_TOKENS
from pagedmoe.worker.cuda_graph import DecodeCudaGraphs, PrefillCudaGraphs
from pagedmoe.worker.host_copy import to_device_async

logger = logging.getLogger(__name__)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts end to end, int64 (no copy for one part)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_rows: list[int]  # index into scheduled of each logits row


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, num_kv_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto", moe_backend: str = "auto",
                 max_num_seqs: int = 256, max_model_len: int = 4096, enforce_eager: bool = True,
                 kv_backing: Optional[LendableKVCache] = None, memory=None,
                 fused_ops: str = "auto", backbone_gemm: str = "auto", prefill_graph_tokens: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None) -> None:
        """`kv_backing`: KV tensors lent to dynamic precision (kvcache/kv_cache.py), else plain ones are
        allocated; `memory`: the engine's DeviceMemoryMonitor (worker/device_memory.py), told the KV cache's and
        the CUDA graphs' stages; None off CUDA. `prefill_graph_tokens` (--prefill-graph-tokens; None: the default
        where it can take effect): the largest step that is not decode-only replayed from a CUDA graph, at most
        max_num_batched_tokens."""
        self.model, self.device, self.dtype, self.block_size = model, device, dtype, block_size
        self.control = None  # rank 0 under tensor parallelism: parallel/launch.py's StepBroadcast
        self.kv_swap = None  # --swap-space: kvcache/swap.py's HostKVSwap over these KV tensors (start-up sets it)
        self.block_tables = BlockTables(-(-max_model_len // block_size), rows=max(64, max_num_seqs))
        dims = model.dims
        # kv_backing (dynamic precision on CUDA): KV tensors whose withheld tail gives its memory back; it is
        # allocated by start-up (under the same out-of-memory naming: engine/startup.py)
        self.kv_backing = kv_backing
        if kv_backing is not None:
            self.kv_caches = kv_backing.caches
        else:
            with naming_oom(f"allocating the KV cache ({num_kv_blocks} blocks)", kv_cache_bytes(dims, num_kv_blocks,
                                                                                                 block_size, dtype)):
                self.kv_caches = allocate_kv_cache(dims.num_layers, num_kv_blocks, block_size, dims.num_kv_heads,
                                                   dims.head_dim, dtype, device)
        if memory is not None:
            memory.mark("kv_cache")
        backend = make_attention_backend(attention_backend, device)
        for attn, (k_cache, v_cache) in zip(model.attention_layers(), self.kv_caches):
            attn.k_cache, attn.v_cache, attn.backend = k_cache, v_cache, backend
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {moe_backend!r}; known: {sorted(MOE_BACKENDS)}")
        if moe_backend == "triton":  # at start-up, not in the first request's step
            require_triton("--moe-backend triton", device)
        for moe in model.moe_layers():
            moe.experts_fn = MOE_BACKENDS[moe_backend]
        apply_fused_ops(model, resolve_fused_ops(fused_ops, device))  # before the graphs capture the kernels
        apply_backbone_gemm(model, resolve_backbone_gemm(backbone_gemm, device))
        self.graphs = None
        self.prefill_graphs = None
        if device.type == "cuda" and not enforce_eager:
            moes = model.moe_layers()
            probe = torch.empty(1, model.dims.hidden_size, dtype=dtype, device=device)
            w13, w2 = model.expert_store.views(0) if moes else (None, None)
            # --expert-fetch routed: path (a) syncs with the host in every MoE layer; the decode buckets up to
            # graph_max_seqs fetch by path (b) (no sync) and run in CUDA graphs, larger batches eager
            graph_seqs = min(max_num_seqs, getattr(model.pager, "graph_max_seqs", max_num_seqs))
            if getattr(model.pager, "syncs_host", False) and graph_seqs <= 0:
                logger.warning("CUDA graphs off: routed expert fetching syncs with the host in every MoE layer")
            elif moes and not sync_free(moes[0].experts_fn, probe, w13, w2):
                if prefill_graph_tokens:
                    raise ValueError(f"--prefill-graph-tokens {prefill_graph_tokens} replays CUDA graphs, which the "
                                     f"{moe_backend} expert path cannot run in (it syncs with the host; use bfloat16)")
                logger.warning("CUDA graphs off: the %s expert path syncs with the host (use bfloat16)",
                               moe_backend)
            else:
                self.graphs = DecodeCudaGraphs(model, graph_seqs, -(-max_model_len // block_size),
                                               max_model_len, device)
                with naming_oom("capturing CUDA graphs (--enforce-eager runs without them)"):
                    self.graphs.capture()
                    self._capture_prefill_graphs(prefill_graph_tokens, max_num_batched_tokens, graph_seqs,
                                                 max_model_len)
                if memory is not None:
                    memory.mark("cuda_graphs")
                if model.pager is not None:
                    model.pager.reset_stats()  # capture warm-ups are not traffic of the workload

    def _capture_prefill_graphs(self, tokens: Optional[int], max_num_batched_tokens: Optional[int], max_seqs: int,
                                max_model_len: int) -> None:
        """Prefill CUDA graphs (worker/cuda_graph.py::PrefillCudaGraphs) after the decode graphs, in their pool:
        with resident experts (a pager plans its copies per forward, on the host)."""
        if tokens == 0:
            return
        if self.model.pager is not None:  # an explicit N was refused at start-up (engine/startup.py)
            return
        # at most max_model_len: the padding sequence's positions and blocks stay inside the rotary table and
        # a block-table row
        limit = min(PREFILL_GRAPH_TOKENS if tokens is None else tokens, max_model_len)
        if max_num_batched_tokens is not None:
            limit = min(limit, max_num_batched_tokens)
        self.prefill_graphs = PrefillCudaGraphs(self.model, limit, max_seqs, self.graphs.block_tables.shape[1],
                                                max_model_len, self.device)
        self.prefill_graphs.capture(self.graphs.pool)

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        return self.to_device(self.host_inputs(out, kv))

    def host_inputs(self, out: SchedulerOutput, kv: KVCacheManager) -> dict:
        """The step's inputs as host tensors and numbers: what rank 0 broadcasts under tensor parallelism
        (the workers have no scheduler and no block tables of their own)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []   # the current run of decode rows (lists: one value a row is cheapest)
        slots: list[int] = []
        pos_parts: list[torch.Tensor] = []   # in row order: runs of decode rows, then each chunk row's tensor
        slot_parts: list[torch.Tensor] = []

        def flush() -> None:
            if positions:
                pos_parts.append(torch.tensor(positions, dtype=torch.int64))
                slot_parts.append(torch.tensor(slots, dtype=torch.int64))
                positions.clear()
                slots.clear()

        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling_rows: list[int] = []
        # --async-scheduling: a decode row whose input is the token the step in flight samples gets a
        # placeholder here; execute() fills it on the device from that step's tokens (pending_ids: its
        # index in input_ids -> the request)
        pending_ids: dict[int, str] = {}
        prompt_rows: list[torch.Tensor] = []  # SamplingParams.prompt_logprobs (none: the step as is)
        for row, s in enumerate(out.scheduled):
            req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            table = kv.block_table(req.request_id)
            if n == 1:  # decode: one token, one slot
                if start >= req.num_tokens - req.num_pending_tokens:
                    pending_ids[len(input_ids)] = req.request_id
                    input_ids.append(0)
                else:
                    input_ids.append(req.token_ids(start, start + 1)[0])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:  # a prompt or a chunk of one: its positions and slots as tensor ops, not per token in Python
                # (host_inputs of 8 prompts x 1024 tokens: 7.6 ms per token, 2.3 ms this way, on the CPU machine)
                input_ids.extend(req.token_ids(start, start + n))
                flush()
                pos = torch.arange(start, start + n, dtype=torch.int64)
                first = start // bs
                blocks = torch.tensor(table[first:(start + n - 1) // bs + 1], dtype=torch.int64)
                pos_parts.append(pos)
                slot_parts.append(blocks[pos // bs - first] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(table)
            if s.samples:
                logits_indices.append(qsl[-1] - 1)
                sampling_rows.append(row)
            if req.params.prompt_logprobs is not None and s.prompt_logprob_positions:
                # the rows of out.prompt_logprob_spans(), in that order, go after the sampling rows (from the
                # request's first row of the step: its positions start at num_computed_tokens)
                prompt_rows.append(torch.arange(len(s.prompt_logprob_positions)) + qsl[-2])
        block_tables = self.block_tables.gather([s.request.request_id for s in out.scheduled], tables,
                                                max(map(len, tables)), kv.has)
        flush()
        return dict(input_ids=torch.tensor(input_ids, dtype=torch.int64),
                    positions=_cat(pos_parts), slots=_cat(slot_parts), qsl=torch.tensor(qsl, dtype=torch.int32),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
                    logits_indices=_cat([torch.tensor(logits_indices, dtype=torch.int64)] + prompt_rows),
                    num_prompt_rows=sum(map(len, prompt_rows)), sampling_rows=sampling_rows,
                    max_query_len=max(s.num_new_tokens for s in out.scheduled), max_seq_len=max(seq_lens),
                    is_decode_only=all(s.num_new_tokens == 1 for s in out.scheduled), pending_ids=pending_ids,
                    swap_out=out.swap_out, swap_in=out.swap_in)

    def to_device(self, host: dict) -> StepInputs:
        dev = self.device
        qsl_cpu, seq_lens_cpu = host["qsl"], host["seq_lens"]
        meta = AttentionMetadata(
            slot_mapping=to_device_async(host["slots"], dev),
            query_start_loc=to_device_async(qsl_cpu, dev),
            seq_lens=to_device_async(seq_lens_cpu, dev),
            block_tables=to_device_async(host["block_tables"], dev),
            max_query_len=host["max_query_len"],
            max_seq_len=host["max_seq_len"],
            is_decode_only=host["is_decode_only"],
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            fresh=not host["is_decode_only"] and torch.equal(seq_lens_cpu, qsl_cpu[1:] - qsl_cpu[:-1]),
        )
        return StepInputs(
            input_ids=to_device_async(host["input_ids"], dev),
            positions=to_device_async(host["positions"], dev),
            meta=meta,
            logits_indices=to_device_async(host["logits_indices"], dev),
            sampling_rows=host["sampling_rows"],
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager,
                pending: Optional[tuple[torch.Tensor, dict[str, int]]] = None) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns (logits [N, V] float32, rows of out.scheduled that sample); a step with prompt
        logprobs has the rows of out.prompt_logprob_spans() after the N sampling rows, and runs eager.

        pending (--async-scheduling): (tokens [M] on the device, request id -> index) of the step still in
        flight, whose tokens are the inputs of this step's rows that decode after it."""
        host = self.host_inputs(out, kv)
        if self.control is not None:  # rank 0 of a tensor-parallel group: the workers run the same step
            if host["pending_ids"]:
                raise RuntimeError("a step with device-side input tokens cannot be broadcast to the workers")
            self.control.send(host)
        return self.execute_host(host, pending)

    @torch.inference_mode()
    def execute_host(self, host: dict, pending=None) -> tuple[torch.Tensor, list[int]]:
        """One step from its host inputs (a worker rank runs the steps rank 0 broadcasts through this)."""
        if host.get("swap_out") or host.get("swap_in"):  # --swap-space: before the forward, on its stream, no sync
            self.kv_swap.run(host["swap_out"], host["swap_in"])
        inputs = self.to_device(host)
        placeholders = host.get("pending_ids")
        if placeholders:
            tokens, index_of = pending
            dst = to_device_async(torch.tensor(list(placeholders), dtype=torch.int64), self.device)
            src = torch.tensor([index_of[r] for r in placeholders.values()], dtype=torch.int64)
            # NOTE: queued behind the step that sampled `tokens` (one stream): no host sync
            inputs.input_ids.index_copy_(0, dst, tokens.index_select(0, to_device_async(src, self.device)))
        if host.get("num_prompt_rows"):  # prompt logprobs: eager (the graphs end at the sampling rows)
            logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
            return logits, inputs.sampling_rows
        if inputs.meta.is_decode_only and self.graphs is not None and self.graphs.can_run(len(host["seq_lens"])):
            logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
            if self.model.pager is not None:
                self.model.pager.account_replay()
            return logits, inputs.sampling_rows
        graphs, meta = self.prefill_graphs, inputs.meta
        if (graphs is not None and not meta.is_decode_only
                and graphs.can_run(inputs.input_ids.shape[0], meta.seq_lens.shape[0], meta.block_tables.shape[1])):
            return graphs.run(inputs.input_ids, inputs.positions, meta, inputs.logits_indices), inputs.sampling_rows
        logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        return logits, inputs.sampling_rows
