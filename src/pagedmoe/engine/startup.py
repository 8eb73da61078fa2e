"""Start-up in one place: EngineConfig + the model's config + the device -> one frozen ExpertPlan -> the
model built with its experts -> the KV sizing -> the KV cache, the model runner and dynamic precision.

    config ──> device, dtype, max_model_len
           ──> resolve_expert_plan (planning/resolve.py; `pagedmoe plan` and `bench sweep` read the same
               flags through it) ──> ExpertPlan (frozen)
           ──> build_experts (experts/build.py): table, store, buffers, and the experts object
           ──> build_model(experts=...) ──> weights loaded into the store's tiers ──> finalize
           ──> size_kv_cache (planning/kv_sizing.py): the budget less what was loaded
           ──> KV cache (lendable under dynamic precision) ──> ModelRunner ──> dynamic precision

LLMEngine (engine/llm_engine.py) keeps the serving loop and calls `start_engine` once.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pagedmoe import cuda_vmm
from pagedmoe.config import EngineConfig, resolve_model
from pagedmoe.experts.activity import ActivityTable
from pagedmoe.experts.build import build_experts, settle_buffers
from pagedmoe.experts.dynamic.start import load_expert_stats, prepare_expert_stats_path, start_dynamic_precision
from pagedmoe.extras import require
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.kvcache.kv_cache import LendableKVCache, kv_bytes_per_block, kv_cache_bytes
from pagedmoe.kvcache.swap import HostKVSwap, SwapSpace, auto_swap_blocks
from pagedmoe.models.loader import (CheckpointError, build_model, init_dummy_weights, load_hf_config, load_weights,
                                    resolve_dtype)
from pagedmoe.models.registry import rank_arch, spec_builder
from pagedmoe.oom import naming_oom
from pagedmoe.parallel.launch import abandon_group, finish_start, setup_parallel
from pagedmoe.parallel.sharding import shard_arch
from pagedmoe.parallel.state import all_reduce_min
from pagedmoe.planning.kv_sizing import (GiB, KVSizing, detect_host_budget_bytes, estimate_activation_bytes,
                                         size_kv_cache, start_up_reserve_bytes)
from pagedmoe.planning.fetch_cost import FetchTiers, settle_expert_fetch, settle_fetch_path, settle_stream_steps
from pagedmoe.planning.resolve import ExpertPlan, rank_shape, resolve_expert_plan
from pagedmoe.worker.device_memory import process_monitor
from pagedmoe.worker.model_runner import ModelRunner
from pagedmoe.engine.profile_run import profile_step_bytes

logger = logging.getLogger("pagedmoe")
# The last device memory a budget of the whole device cannot have: the driver keeps some for itself.
DEVICE_HEADROOM = 256 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class EngineParts:
    """Everything start-up made, handed to LLMEngine."""
    model_path: str
    hf_config: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    served_model_name: str
    expert_plan: ExpertPlan
    model: Any
    activity: ActivityTable
    plan: KVSizing
    kv: KVCacheManager
    runner: ModelRunner
    precision: Any            # DynamicPrecisionManager under --expert-precision dynamic, else None
    memory: Any               # DeviceMemoryMonitor (worker/device_memory.py) on CUDA, else None
    swap: Optional[SwapSpace] = None  # --swap-space: the host blocks of preempted requests' KV


def start_engine(config: EngineConfig) -> EngineParts:
    prepare_expert_stats_path(config.expert_stats)
    model_path = resolve_model(config.model)
    hf_config = load_hf_config(model_path)
    # --tensor-parallel-size: this process's rank (parallel/launch.py); a split the model cannot take is
    # refused before any worker starts
    check_split(hf_config, config)
    parallel = setup_parallel(config)
    try:
        return _start(config, model_path, hf_config, parallel)
    except BaseException:
        abandon_group(parallel)  # the workers' pending collectives fail and they exit
        raise


def check_split(hf_config, config) -> None:
    """ValueError when the model cannot be split over --tensor-parallel-size ranks as asked."""
    dims, spec = spec_builder(hf_config)(hf_config)
    rank_dims, _ = shard_arch(dims, spec, config.tensor_parallel_size, config.enable_expert_parallel)
    n, comp = config.experts.num_gpu_experts or 0, config.experts.num_compressed_experts or 0
    if rank_dims.num_experts < dims.num_experts and n + comp > rank_dims.num_experts:
        flags = f"--num-gpu-experts {n}" + (f" + --num-compressed-experts {comp}" if comp else "")
        raise ValueError(f"{flags} exceeds the {rank_dims.num_experts} experts per layer a rank holds (they count "
                         f"one rank's: --enable-expert-parallel splits the model's {dims.num_experts} over "
                         f"{config.tensor_parallel_size} ranks)")


def _start(config: EngineConfig, model_path: str, hf_config, parallel) -> EngineParts:
    tokenizer = load_tokenizer(config.tokenizer or model_path, config.load_format)
    device = pick_device(config.device)
    check_gpu_packages(device)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    max_model_len = resolve_max_model_len(config, hf_config)
    check_num_kv_blocks(config.num_kv_blocks, config.block_size, max_model_len)
    name = config.served_model_name or model_path.rstrip("/").split("/")[-1]

    # The process's device memory as the driver counts it (context, torch's pool, VMM mappings): what
    # --gpu-memory-gb bounds. Its peak is reset here: this engine's start-up and run are one window.
    memory = process_monitor(device)
    if memory is not None:
        memory.reset_peak()
        memory.mark("engine_start")

    t0 = time.perf_counter()
    dims, spec = rank_arch(hf_config)
    dynamic = config.expert_precision == "dynamic"
    # MLA runs a PyTorch path that reads host copies of the sequence lengths: not capturable in a CUDA
    # graph; under dynamic precision graphs would bake old expert versions.
    # Tensor parallel: eager for now (capturing the all-reduces in the decode graphs is a GPU follow-up).
    eager = config.enforce_eager or dynamic or dims.mla is not None or parallel.enabled
    expert_plan = settle_expert_plan(config, hf_config, device, dtype, max_model_len, memory, eager)
    eager_by = ("--expert-precision dynamic" if dynamic else "MLA attention" if dims.mla is not None
                else "--tensor-parallel-size > 1" if parallel.enabled else None)
    check_prefill_graph_tokens(config.prefill_graph_tokens, device, eager_by, expert_plan.paged)
    activity = ActivityTable(dims.num_layers - len(spec.dense_layers), dims.num_experts, device)
    if device.type == "cuda":
        _expandable_segments()  # before loading: what is freed goes back (see its docstring)
    model = load_model(model_path, hf_config, config.load_format, max_model_len, device, dtype, config.seed,
                       expert_plan, activity)
    if config.expert_prefetch:
        if expert_plan.fetch != "routed":
            raise ValueError("--expert-prefetch prefetches into routed fetching's expert cache: it needs "
                             f"--expert-fetch routed (this engine fetches by {expert_plan.fetch})")
        model.pager.set_routers([moe.route for moe in model.moe_layers()])   # prefetch by prediction
    store = model.expert_store
    _mark(memory, "model")
    if expert_plan.dynamic_min_precision is not None:  # before sizing the KV cache: sized around the floor
        # the lossless rung is decoded by the buffer fill, which --quantized-gemm direct skips
        store.enable_dynamic(expert_plan.dynamic_min_precision, lossless=expert_plan.quantized_gemm != "direct")
    plan = plan_kv_cache(config, model, device, dtype, max_model_len, memory, eager)
    if parallel.enabled:  # one block table serves every rank: the fewest blocks any rank can hold
        plan = dataclasses.replace(plan, num_kv_blocks=all_reduce_min(plan.num_kv_blocks))
    logger.info("loaded %s (%s, %s) in %.1f s; %s", name, device, dtype, time.perf_counter() - t0, plan.summary())
    logger.info("experts: %s placement, %.2f GiB resident, %.2f GiB compressed (GPU), %.2f GiB quantized "
                "(GPU, %s), %.2f GiB host tier, %.2f GiB expert buffers", expert_plan.mode,
                store.resident_bytes / GiB, store.compressed_bytes / GiB, store.quantized_bytes / GiB,
                config.expert_precision, store.host_bytes / GiB, store.buffer_bytes / GiB)
    if expert_plan.fetch == "routed":
        top, big = expert_plan.sync_free_max_seqs, expert_plan.stream_min_tokens
        logger.info("routed expert fetching: %s%s", f"forwards of up to {top} tokens by the sync-free UVA gather (CUDA "
                    "graphs for those decode buckets), larger ones by the copy engine after a host sync per layer"
                    if top else "the copy engine after a host sync per MoE layer (eager steps)", f"; forwards of "
                    f"{big} tokens or more prefetch every expert a layer ahead (stream steps)" if big else "")
    # dynamic precision on CUDA: the pool's withheld tail gives its memory back to the device
    backing = None
    if dynamic and cuda_vmm.available(device):
        with naming_oom(f"allocating the KV cache ({plan.num_kv_blocks} blocks)",
                        kv_cache_bytes(dims, plan.num_kv_blocks, config.block_size, dtype)):
            backing = LendableKVCache(dims.num_layers, plan.num_kv_blocks, config.block_size, dims.num_kv_heads,
                                      dims.head_dim, dtype, device)
    elif dynamic and device.type == "cuda":
        logger.warning("dynamic precision without CUDA VMM (cuda-python): KV blocks lent to experts keep "
                       "their memory, so the GPU holds up to the budget plus the experts' bytes above "
                       "--min-expert-precision")
    kv = KVCacheManager(plan.num_kv_blocks, config.block_size, config.enable_prefix_caching, backing=backing)
    logger.info("prefix caching %s", "on" if config.enable_prefix_caching else "off (--no-enable-prefix-caching)")
    runner = ModelRunner(model, plan.num_kv_blocks, config.block_size, device, dtype, config.attention_backend,
                         config.moe_backend, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                         enforce_eager=eager, kv_backing=backing, memory=memory, fused_ops=config.fused_ops,
                         backbone_gemm=config.backbone_gemm, prefill_graph_tokens=config.prefill_graph_tokens,
                         max_num_batched_tokens=config.max_num_batched_tokens)
    if backing is not None and memory is not None and config.num_kv_blocks is None:
        # lent blocks come back only while the process stays within the budget with room for a step's
        # activations and the next build (not whenever the device has memory free)
        limit = plan.budget_bytes - plan.activation_bytes - store.dynamic_build_bytes
        backing.room = lambda: limit - memory.used_bytes()
    swap = start_swap_space(config, runner, plan.num_kv_blocks, max_model_len, device, parallel.enabled)
    activity.reset()  # CUDA-graph capture warm-ups routed tokens too
    precision = None
    stats = load_expert_stats(config.expert_stats, activity)
    if store.dynamic is not None:
        precision = start_dynamic_precision(config, model_path, store, kv, plan.kv_bytes_per_block,
                                            -(-max_model_len // config.block_size), activity, stats)
    _mark(memory, "ready")
    if memory is not None:
        logger.info("device memory after start-up: %.2f GiB (process, as the driver counts it; peak %.2f GiB %s)%s",
                    memory.stages["ready"] / GiB, memory.peak_bytes / GiB, memory.peak_summary(),
                    f" of the {plan.budget_bytes / GiB:.2f} GiB budget" if config.gpu_memory_gb else "")
    parts = EngineParts(model_path, hf_config, tokenizer, device, dtype, max_model_len, name, expert_plan, model,
                        activity, plan, kv, runner, precision, memory, swap)
    finish_start(parts)  # rank 0 broadcasts its steps; a torchrun worker serves them here
    return parts


def check_num_kv_blocks(num_kv_blocks: Optional[int], block_size: int, max_model_len: int) -> None:
    """--num-kv-blocks N (which replaces the budget's sizing) must hold one sequence of max_model_len tokens:
    refused before the model loads, naming the flag and the blocks one sequence needs."""
    need = -(-max_model_len // block_size)
    if num_kv_blocks is not None and num_kv_blocks < need:
        raise ValueError(f"--num-kv-blocks {num_kv_blocks} cannot hold one sequence of max_model_len={max_model_len} "
                         f"tokens: that needs {need} blocks of {block_size} tokens; give at least {need} (or lower "
                         "--max-model-len)")


def check_prefill_graph_tokens(tokens: Optional[int], device: torch.device, eager_by: Optional[str],
                               paged: bool) -> None:
    """--prefill-graph-tokens N > 0, given (by the flag or PAGEDMOE_PREFILL_GRAPH_TOKENS; its default is None),
    fails loudly before the model loads where no prefill graph would be captured; 0 (eager) is accepted
    everywhere. `eager_by`: what makes this engine run without CUDA graphs (--enforce-eager is refused by
    config.py)."""
    if not tokens:
        return
    why = (f"this engine runs on {device.type}" if device.type != "cuda" else
           f"{eager_by} runs without CUDA graphs" if eager_by else
           "paged experts prefill eager" if paged else None)
    if why is not None:
        raise ValueError(f"--prefill-graph-tokens {tokens} replays prefill steps from CUDA graphs, which need a "
                         f"CUDA device and resident experts: {why}; leave the flag out (or pass 0)")


def start_swap_space(config: EngineConfig, runner: ModelRunner, num_kv_blocks: int, max_model_len: int,
                     device: torch.device, parallel: bool) -> Optional[SwapSpace]:
    """--swap-space (GiB; unset: kvcache/swap.py's auto_swap_blocks): the pinned host blocks preempted requests'
    KV goes to, attached to the runner; None when there are none (preemption recomputes). Under tensor
    parallelism every rank holds as many host blocks (the fewest any rank can) over its own KV shard: rank 0's
    scheduler names them for all."""
    block_bytes = HostKVSwap.block_bytes(runner.kv_caches)
    host = detect_host_budget_bytes()
    if config.swap_space is None:
        n = auto_swap_blocks(device, num_kv_blocks, config.block_size, config.max_num_seqs, max_model_len,
                             block_bytes, None if host is None else host // config.tensor_parallel_size)
    else:
        n = int(config.swap_space * GiB) // block_bytes
        if config.swap_space and n == 0:
            raise ValueError(f"--swap-space {config.swap_space} GiB is less than one KV block "
                             f"({block_bytes / 2**20:.2f} MiB of host memory); give at least that, or 0")
        if host is not None and n * block_bytes * config.tensor_parallel_size > host:
            raise ValueError(f"--swap-space {config.swap_space} GiB is more than the host has to pin "
                             f"({host / GiB:.2f} GiB: MemAvailable less a reserve)")
    if parallel:
        n = all_reduce_min(n)
    if n == 0:
        return None
    runner.kv_swap = HostKVSwap(runner.kv_caches, n)
    return SwapSpace(n)


def _mark(memory, stage: str) -> None:
    if memory is not None:
        memory.mark(stage)


def _expandable_segments() -> None:
    """Dynamic precision frees expert versions of every size between steps, and encoding a lossless tier at
    load frees temporaries of every size; in fixed segments torch cannot hand the freed parts back while a live
    tensor shares the segment (measured on the H200: 4.8 GiB stuck in Mixtral's pool under dynamic precision;
    15.2 GiB counted as reserve after loading Mixtral's compressed tier at weights + 4 GiB, which cut its KV
    cache from the planned 21.8 to 7.9 GiB). Expandable segments unmap freed pages. Resident engines too: with
    fixed segments Qwen3-30B-A3B's resident run at weights + 4 GiB peaked at 100.2% of the budget on the H100,
    0.76 GiB of torch's reservation unallocated at its peak, against 0.19-0.33 GiB for the paged runs beside it
    (expandable; benchmarks/results/session34). CUDA-graph pools take expandable segments (pytorch#128068). A
    PYTORCH_CUDA_ALLOC_CONF the user set wins."""
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    setter("expandable_segments:True")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def check_gpu_packages(device: torch.device) -> None:
    """The gpu extra, checked before any weight is read: pagedmoe's CUDA kernels are Triton kernels."""
    if device.type == "cuda":
        require("triton", "gpu", "running on a CUDA device")


def sliding_window_of(hf_config) -> Optional[int]:
    """The attention window transformers gives some layer of this config (the tokens a query sees, itself
    included), or None. Mixtral's applies whenever set; Qwen's only with use_sliding_window (and layer_types)."""
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(hf_config, "layer_types", None)
    if kinds is not None and "sliding_attention" not in kinds:
        return None
    return int(getattr(hf_config, "sliding_window", None) or 0) or None


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if config.max_model_len is not None and max_pos and config.max_model_len > max_pos:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}")
    # The engine attends to the whole context: the model's sliding-window attention only up to the window.
    window = sliding_window_of(hf_config)
    if window is not None and config.max_model_len is not None and config.max_model_len > window:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's sliding_window {window}: "
                         f"pagedmoe has no sliding-window attention, so longer sequences would not get the "
                         f"model's outputs (--max-model-len {window} or less)")
    max_model_len = config.max_model_len or max_pos
    if not max_model_len:
        raise ValueError("the config has no max_position_embeddings; pass max_model_len")
    if window is not None and max_model_len > window:
        logger.info("max_model_len %d: the model's sliding_window (pagedmoe has no sliding-window attention; "
                    "max_position_embeddings is %d)", window, max_pos)
        max_model_len = window
    return max_model_len


def load_tokenizer(path: str, load_format: str):
    from transformers import AutoTokenizer  # heavy: only when an engine starts

    has_files = any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)
    try:
        if not has_files:
            # transformers may build an empty tokenizer from config.json alone: treat it as none.
            raise FileNotFoundError("no tokenizer files")
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        if load_format == "dummy":
            # Shape-only benchmark folders (a config.json) need no tokenizer: prompts are token ids.
            logger.warning("no tokenizer in %s: prompts must be token ids and outputs carry no text", path)
            return None
        raise CheckpointError(f"{path}: cannot load the tokenizer ({e})") from e


# -- the expert plan ------------------------------------------------------------------------------------
def settle_expert_plan(config: EngineConfig, hf_config, device: torch.device, dtype: torch.dtype,
                       max_model_len: int, memory=None, eager: bool = True) -> ExpertPlan:
    """The resolver's plan (planning/resolve.py) with what the device decides: the compute buffers, the
    static lossy format, the quantized GEMM path and the dynamic floor."""
    dims, spec = rank_arch(hf_config)
    plan = resolve_expert_plan(config, dims, spec, device_type=device.type, dtype=dtype,
                               max_model_len=max_model_len, budget=lambda: planning_budget(config, device, memory),
                               host_budget=lambda: host_budget(config), eager=eager)
    x, dynamic = config.experts, config.experts.precision == "dynamic"
    plan = plan.replace(fetch=settle_fetch(config, plan, dims, spec, device, dtype, max_model_len))
    # routed: the decode buckets that fetch by the sync-free path (b) and run in CUDA graphs, and stream steps
    shape, n = rank_shape(config, dims, spec, dtype.itemsize), _min_count(plan.num_gpu_experts)
    tiers = FetchTiers.of_plan(plan.num_compressed, plan.host_compression)
    plan = plan.replace(sync_free_max_seqs=settle_fetch_path(
        x.fetch_path, plan.fetch, shape, n, tiers, config.max_num_seqs, max_model_len / 2, device.type,
        graphs=not eager, interpreter=os.environ.get("TRITON_INTERPRET") == "1"))
    plan = plan.replace(stream_min_tokens=settle_stream_steps(
        plan.fetch, shape, n, tiers, config.max_num_batched_tokens, max_model_len / 2, device.type,
        plan.sync_free_max_seqs))
    buffers = "plain" if dynamic or plan.fetch == "routed" else x.buffers
    return plan.replace(buffers=settle_buffers(buffers, plan.paged, device),
                        quantized_precision=x.quantized_precision(),
                        quantized_gemm=config.resolved_quantized_gemm(device.type),
                        dynamic_min_precision=(x.min_precision or "int4") if dynamic else None)


def _min_count(counts) -> int:
    """The fewest resident experts of any MoE layer (a per-layer tuple, or one count)."""
    if isinstance(counts, (tuple, list)):
        return min(counts, default=0)
    return counts or 0


def settle_fetch(config: EngineConfig, plan: ExpertPlan, dims, spec, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> str:
    """--expert-fetch settled by planning/fetch_cost.py (the host limit read only for routed fetching)."""
    shape = rank_shape(config, dims, spec, dtype.itemsize)
    return settle_expert_fetch(config.experts, plan, shape, config.max_num_seqs, device.type, max_model_len / 2,
                               lambda: host_budget(config))


def planning_budget(config: EngineConfig, device: torch.device, memory=None) -> Optional[int]:
    """Device bytes the planner splits: --gpu-memory-gb, else default_budget on CUDA; None on CPU."""
    if config.gpu_memory_gb is not None:
        return int(config.gpu_memory_gb * GiB)
    if device.type == "cuda":
        return default_budget(memory)
    return None


def default_budget(memory) -> int:
    """Without --gpu-memory-gb on CUDA: 0.9 of what the device has beside other processes (vLLM's default
    --gpu-memory-utilization)."""
    return int(0.9 * (memory.total_bytes - memory.others_bytes))


def host_budget(config: EngineConfig) -> Optional[int]:
    """Pinned host memory the planner may give the host tier: --host-memory-gb, else what the machine has
    available at start-up less a reserve (planning/kv_sizing.py); None: unbounded. Both are one rank's
    under --tensor-parallel-size: the machine's share is split evenly over its ranks."""
    if config.host_memory_gb is not None:
        return int(config.host_memory_gb * GiB)
    budget = detect_host_budget_bytes()
    ranks = config.tensor_parallel_size
    if budget is None:
        logger.info("host memory unknown (no /proc/meminfo): the host tier is unbounded")
    else:
        budget //= ranks  # every rank reads the same MemAvailable
        logger.info("host tier limit %.2f GiB (MemAvailable less a reserve%s; --host-memory-gb overrides)",
                    budget / GiB, f", over {ranks} ranks" if ranks > 1 else "")
    return budget


def load_model(path: str, hf_config, load_format: str, max_position: int, device: torch.device,
               dtype: torch.dtype, seed: int, plan: ExpertPlan, activity: Optional[ActivityTable] = None):
    """The model built with its experts object (laid out by `plan`), its weights loaded (or random for
    --load-format dummy) and its GPU tiers encoded."""
    dims, spec = rank_arch(hf_config)
    with naming_oom(f"allocating the experts ({plan.mode} placement)"):
        experts = build_experts(plan, dims.num_layers - len(spec.dense_layers), dims, device, dtype, activity)
    model = build_model(hf_config, max_position, device, dtype, experts)
    if load_format == "dummy":
        with naming_oom("generating random weights (--load-format dummy)"):
            init_dummy_weights(model, seed)
            experts.store.init_random(seed)
    else:
        load_weights(model, path, show_progress=os.environ.get("PAGEDMOE_NO_PROGRESS") is None)
    with naming_oom("encoding the compressed / quantized expert tiers"):
        experts.store.finalize()  # encode (quantise) the compressed (quantized) tier's staged rows
    if model.pager is not None:
        model.pager.refresh()  # finalize may have compressed the host tier
    return model


# -- the KV cache ---------------------------------------------------------------------------------------
def plan_kv_cache(config: EngineConfig, model, device: torch.device, dtype: torch.dtype, max_model_len: int,
                  memory=None, eager: bool = True) -> KVSizing:
    """The measured split: the budget less what was loaded, the activations and a reserve, in KV blocks."""
    c, dims, store = config, model.dims, model.expert_store
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + store.device_bytes
    per_block = kv_bytes_per_block(dims.num_layers, dims.num_kv_heads, dims.head_dim, c.block_size, dtype)
    blocks_per_seq = -(-max_model_len // c.block_size)
    useful = c.max_num_seqs * blocks_per_seq
    act = estimate_activation_bytes(c.max_num_batched_tokens, c.max_num_seqs, dims.hidden_size,
                                    dims.moe_intermediate_size, dims.top_k, dims.vocab_size, dtype.itemsize)
    if c.num_kv_blocks is not None:
        budget = weight_bytes + act + c.num_kv_blocks * per_block
        return size_kv_cache(budget, weight_bytes, act, per_block, c.block_size, max_model_len, c.num_kv_blocks)
    if device.type == "cuda":
        budget = int(c.gpu_memory_gb * GiB) if c.gpu_memory_gb is not None else default_budget(memory)
        budget = clamp_to_device(memory, budget)
        # Measured: everything the process holds now (context, weights, experts, buffers, torch's cache
        # and fragmentation, VMM mappings) beyond the weights' own bytes; the dynamic experts' floor is
        # counted in weight_bytes but built only once the KV cache exists.
        pending = store.dynamic_bytes
        if store.dynamic is None:  # dynamic experts are built after the KV cache: estimated
            estimate, act = act, profile_step_bytes(
                model, c.block_size, device, dtype, c.attention_backend, c.moe_backend,
                c.max_num_seqs, max_model_len, c.max_num_batched_tokens, memory, c.fused_ops, c.backbone_gemm)
            logger.info("profile step (%d tokens, %d sequences): %.2f GiB of activations (estimate %.2f GiB)",
                        c.max_num_batched_tokens, min(c.max_num_seqs, c.max_num_batched_tokens), act / GiB,
                        estimate / GiB)
        torch.cuda.empty_cache()  # loading's temporaries: what the run re-grows is the reserve's to hold
        measured = memory.mark("loaded")
        overhead = max(0, measured - (weight_bytes - pending))
        estimated = start_up_reserve_bytes(
            act, c.max_num_seqs, dims.hidden_size, dims.moe_intermediate_size, dims.top_k, dims.vocab_size,
            dtype.itemsize, cuda_graphs=not eager, build_bytes=store.dynamic_build_bytes)
        reserve = overhead + estimated
        logger.info("reserve %.2f GiB: %.2f GiB measured beyond the weights (context, modules, torch's cache), "
                    "%.2f GiB estimated (graph pool, workspaces, fragmentation, builds)", reserve / GiB,
                    overhead / GiB, estimated / GiB)
        return size_kv_cache(budget, weight_bytes, act, per_block, c.block_size, max_model_len, useful, reserve)
    if c.gpu_memory_gb is not None:
        budget = int(c.gpu_memory_gb * GiB)
    else:
        # CPU without a budget: room for every sequence at full length, within 4 GiB of KV.
        useful = min(useful, max(blocks_per_seq, (4 * GiB) // per_block))
        budget = weight_bytes + act + useful * per_block
    return size_kv_cache(budget, weight_bytes, act, per_block, c.block_size, max_model_len, useful)


def clamp_to_device(memory, budget: int) -> int:
    """A budget above the device's memory is refused. One above what it can give beside other processes
    (less DEVICE_HEADROOM, which the driver keeps) is lowered to that, with a warning. `memory`: the
    process's DeviceMemoryMonitor."""
    total, others = memory.total_bytes, memory.others_bytes
    if budget > total:
        raise ValueError(f"--gpu-memory-gb {budget / GiB:.2f} exceeds this device's {total / GiB:.2f} GiB")
    available = total - others - DEVICE_HEADROOM
    if budget > available:
        logger.warning("--gpu-memory-gb %.2f is more than this device can give (%.2f GiB of %.2f, other "
                       "processes hold %.2f): planning for %.2f GiB", budget / GiB, available / GiB,
                       total / GiB, others / GiB, available / GiB)
        return available
    return budget
