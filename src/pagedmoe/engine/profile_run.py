"""One profiling step before the KV cache is sized: how much device memory the largest step needs.

Start-up runs the largest step the scheduler can build (max_num_batched_tokens prompt tokens over
max_num_seqs sequences, every one sampling) eagerly, on a temporary KV cache just large enough
for it, and measures what the step needed beyond what was allocated before it: torch's peak allocation
above the start, plus memory that grew outside torch's pool (cuBLAS / Triton modules loaded by the first
launches). The KV cache is then sized for the budget less this (vLLM profiles the same way).
"""
from __future__ import annotations

import logging

import torch

from pagedmoe.engine.request import Request
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.planning.kv_sizing import GiB
from pagedmoe.sampling_params import SamplingParams
from pagedmoe.scheduler_output import ScheduledRequest, SchedulerOutput
from pagedmoe.worker.model_runner import ModelRunner
from pagedmoe.worker.sampler import Sampler

logger = logging.getLogger("pagedmoe")


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the largest step: max_num_batched_tokens tokens over as many sequences as the
    scheduler may run (max_num_seqs: each samples, so the logits and the sampler's copies are largest), each
    at most max_model_len - 1 tokens (one must stay free for the sampled token)."""
    per_seq = max(1, max_model_len - 1)
    total = max_num_batched_tokens
    num = max(1, min(max_num_seqs, total))
    base, extra = divmod(total, num)
    return [min(per_seq, base + (i < extra)) for i in range(num)]


@torch.inference_mode()
def profile_step_bytes(model, block_size: int, device: torch.device, dtype: torch.dtype, attention_backend: str,
                       moe_backend: str, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                       memory=None, fused_ops: str = "auto", backbone_gemm: str = "auto") -> int:
    """Device bytes the largest step needs above what is allocated before it (its activations, the logits and
    the sampler's float32 working copy of them). On CUDA `memory` (worker/device_memory.py) counts the growth
    outside torch's pool; off CUDA the step runs (so the path is exercised) and 0 is returned."""
    lengths = profile_lengths(max_num_batched_tokens, max_num_seqs, max_model_len)
    num_blocks = sum(-(-n // block_size) for n in lengths)
    runner = ModelRunner(model, num_blocks, block_size, device, dtype, attention_backend, moe_backend,
                         max_num_seqs=max_num_seqs, max_model_len=max_model_len, enforce_eager=True,
                         fused_ops=fused_ops, backbone_gemm=backbone_gemm)
    kv = KVCacheManager(num_blocks, block_size)
    vocab = model.dims.vocab_size
    low = min(10, vocab - 1)   # no special ids, as bench's random prompts
    scheduled = []
    for i, n in enumerate(lengths):
        ids = [low + (131 * i + j) % (vocab - low) for j in range(n)]
        request = Request(f"__profile_{i}", ids, SamplingParams(max_tokens=1))
        if not kv.allocate(request.request_id, n):
            raise RuntimeError("profile step: its temporary KV cache is too small (a bug)")
        scheduled.append(ScheduledRequest(request, n, 0))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated0, reserved0 = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        used0 = memory.used_bytes() if memory is not None else 0
    logits, _ = runner.execute(SchedulerOutput(scheduled), kv)
    if cuda:
        torch.cuda.synchronize(device)
        forward_peak = torch.cuda.max_memory_allocated(device) - allocated0
    # the sampler's working copies at their largest: top-k and top-p filter the float32 logits, logprobs
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)] * logits.shape[0]
    Sampler(0, device).sample(logits, params, [None] * logits.shape[0])
    del logits
    if cuda:
        torch.cuda.synchronize(device)
        logger.info("profile step: torch's peak allocation %.2f GiB in the forward, %.2f GiB with the sampler",
                    forward_peak / GiB, (torch.cuda.max_memory_allocated(device) - allocated0) / GiB)
    if model.pager is not None:
        model.pager.end_step()     # every event of the step is done
        model.pager.reset_stats()  # not traffic of the workload
    for attn in model.attention_layers():   # the temporary KV cache goes with the runner
        attn.k_cache = attn.v_cache = None
    if not cuda:
        return 0
    peak = torch.cuda.max_memory_allocated(device) - allocated0
    outside = 0
    if memory is not None:  # growth the driver saw that torch's pool does not explain
        outside = max(0, (memory.used_bytes() - used0) - (torch.cuda.memory_reserved(device) - reserved0))
    del runner, kv
    torch.cuda.empty_cache()
    return int(peak + outside)
