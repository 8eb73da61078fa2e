"""The engine: requests in, one step at a time (schedule -> execute -> update), outputs out."""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Optional, Union

import torch

from pagedmoe.config import EngineConfig, resolve_model
from pagedmoe.engine.memory import (CUDA_CONTEXT_BYTES, GiB, detect_host_budget_bytes, dynamic_build_bytes,
                                    estimate_activation_bytes, plan_memory, start_up_reserve_bytes)
from pagedmoe.experts.activity import ActivityTable
from pagedmoe.experts.vmm import available as vmm_available
from pagedmoe.engine.output import OutputProcessor
from pagedmoe.engine.request import Request, RequestStatus
from pagedmoe.engine.scheduler import Scheduler
from pagedmoe.kvcache.block_pool import KVCacheManager
from pagedmoe.kvcache.kv_cache import kv_bytes_per_block
from pagedmoe.models.loader import CheckpointError, get_model, load_hf_config, resolve_dtype
from pagedmoe.oom import DeviceOutOfMemoryError, budget_text
from pagedmoe.sampling_params import RequestOutput, SamplingParams
from pagedmoe.worker.device_memory import process_monitor
from pagedmoe.worker.model_runner import ModelRunner
from pagedmoe.worker.profile_run import profile_step_bytes
from pagedmoe.worker.sampler import Sampler

logger = logging.getLogger("pagedmoe")
# The last device memory a budget of the whole device cannot have: the driver keeps some for itself.
DEVICE_HEADROOM = 256 << 20


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _check_gpu_packages(device: torch.device) -> None:
    """The gpu extra, checked before any weight is read: pagedmoe's CUDA kernels are Triton kernels."""
    if device.type == "cuda":
        from pagedmoe.extras import require

        require("triton", "gpu", "running on a CUDA device")


def _expandable_segments() -> None:
    """Dynamic precision frees expert versions of every size between steps; in fixed segments torch cannot
    hand the freed parts back while a live version shares the segment (measured on the H200: 4.8 GiB stuck
    in Mixtral's pool, so lent KV blocks could not come back within the budget). Expandable segments unmap
    freed pages. A PYTORCH_CUDA_ALLOC_CONF the user set wins."""
    import os

    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    setter("expandable_segments:True")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: str, load_format: str):
    from pathlib import Path

    from transformers import AutoTokenizer

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


def _name_oom_at_start(init):
    """LLMEngine.__init__: running out of device memory while starting says what was being built (the loader,
    the KV cache, graph capture name it: pagedmoe/oom.py) and the budget, never a corrupt checkpoint."""
    @functools.wraps(init)
    def wrapper(self, config: EngineConfig) -> None:
        try:
            init(self, config)
        except DeviceOutOfMemoryError as e:
            raise e.with_budget(budget_text(config.gpu_memory_gb, getattr(self, "device", _CPU))) from e
        except torch.OutOfMemoryError as e:
            raise DeviceOutOfMemoryError("starting the engine", None, budget_text(
                config.gpu_memory_gb, getattr(self, "device", _CPU))) from e
    return wrapper


_CPU = torch.device("cpu")


class LLMEngine:
    # Out of memory in a step fails that step's requests and the engine serves on (_fail_step); the benchmarks
    # turn this off: a run with failed requests measures nothing, so their OOM propagates.
    survive_step_oom = True

    @_name_oom_at_start
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model(config.model)
        self.hf_config = load_hf_config(self.model_path)
        self.tokenizer = _load_tokenizer(config.tokenizer or self.model_path, config.load_format)
        self.device = _pick_device(config.device)
        _check_gpu_packages(self.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 0) or 0)
        if config.max_model_len is not None and max_pos and config.max_model_len > max_pos:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_pos}")
        self.max_model_len = config.max_model_len or max_pos
        if not self.max_model_len:
            raise ValueError("the config has no max_position_embeddings; pass max_model_len")
        self.served_model_name = config.served_model_name or self.model_path.rstrip("/").split("/")[-1]
        self.placement_plan = None
        # The process's device memory as the driver counts it (context, torch's pool, VMM mappings): what
        # --gpu-memory-gb bounds. Its peak is reset here: this engine's start-up and run are one window.
        self.memory = process_monitor(self.device)
        if self.memory is not None:
            self.memory.reset_peak()
            self.memory.mark("engine_start")

        t0 = time.perf_counter()
        dynamic = config.expert_precision == "dynamic"
        # MLA runs a PyTorch path that reads host copies of the sequence lengths: not capturable in a CUDA
        # graph; under dynamic precision graphs would bake old expert versions.
        self._eager = config.enforce_eager or dynamic or self._is_mla()
        # --host-compression auto is settled by the planner in _resolve_placement
        self.host_compression = "none" if config.host_compression == "auto" else config.host_compression
        placement, num_gpu_experts, num_compressed = self._resolve_placement()
        self.quantized_gemm = config.resolved_quantized_gemm(self.device.type)
        self.model = get_model(self.model_path, self.hf_config, config.load_format, self.max_model_len,
                               self.device, self.dtype, config.seed, placement, num_gpu_experts,
                               "plain" if dynamic else config.expert_buffers, num_compressed,
                               quantized_precision=config.quantized_precision(),
                               host_compression=self.host_compression,
                               quantized_gemm=self.quantized_gemm)
        self.expert_store = self.model.expert_store
        self._mark("model")
        if dynamic and self.device.type == "cuda":
            _expandable_segments()
        if dynamic:  # before sizing the KV cache: it is sized around the experts' floor
            # the lossless rung is decoded by the buffer fill, which --quantized-gemm direct skips
            self.expert_store.enable_dynamic(config.min_expert_precision or "int4",
                                             lossless=self.quantized_gemm != "direct")
        self.pager = self.model.pager
        self.activity = ActivityTable(len(self.model.moe_layers()), self.model.dims.num_experts, self.device)
        self.activity.attach(self.model)
        self.plan = self._plan_memory()
        store = self.expert_store
        logger.info("loaded %s (%s, %s) in %.1f s; %s", self.served_model_name, self.device, self.dtype,
                    time.perf_counter() - t0, self.plan.summary())
        logger.info("experts: %s placement, %.2f GiB resident, %.2f GiB compressed (GPU), %.2f GiB quantized "
                    "(GPU, %s), %.2f GiB host tier, %.2f GiB expert buffers", placement, store.resident_bytes / GiB,
                    store.compressed_bytes / GiB, store.quantized_bytes / GiB, config.expert_precision,
                    store.host_bytes / GiB, store.buffer_bytes / GiB)
        self.kv = KVCacheManager(self.plan.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        logger.info("prefix caching %s", "on" if config.enable_prefix_caching else "off (--no-enable-prefix-caching)")
        self.runner = ModelRunner(self.model, self.plan.num_kv_blocks, config.block_size, self.device,
                                  self.dtype, config.attention_backend, config.moe_backend,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=self._eager, lendable_kv=dynamic and vmm_available(self.device),
                                  memory=self.memory, fused_ops=config.fused_ops)
        self.kv.backing = self.runner.kv_backing   # blocks lent to experts give their memory back
        if self.kv.backing is not None and self.memory is not None and config.num_kv_blocks is None:
            # lent blocks come back only while the process stays within the budget with room for a step's
            # activations and the next build (not whenever the device has memory free)
            mon = self.memory
            limit = self.plan.budget_bytes - self.plan.activation_bytes - self.expert_store.dynamic_build_bytes
            self.kv.backing.room = lambda: limit - mon.used_bytes()
        if dynamic and self.device.type == "cuda" and self.kv.backing is None:
            logger.warning("dynamic precision without CUDA VMM (cuda-python): KV blocks lent to experts keep "
                           "their memory, so the GPU holds up to the budget plus the experts' bytes above "
                           "--min-expert-precision")
        self.activity.reset()  # CUDA-graph capture warm-ups routed tokens too
        self._start_expert_precision(config)
        self._mark("ready")
        if self.memory is not None:
            logger.info("device memory after start-up: %.2f GiB (process, as the driver counts it; peak %.2f GiB)%s",
                        self.memory.stages["ready"] / GiB, self.memory.peak_bytes / GiB,
                        f" of the {self.plan.budget_bytes / GiB:.2f} GiB budget" if config.gpu_memory_gb else "")
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed, self.device)
        self.outputs = OutputProcessor(self.tokenizer, self.hf_config, self.model_path)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_steps = 0
        # Wall time of steps that carry prefill tokens vs decode-only steps (each step ends with a sync).
        self.step_time = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0, "decode_steps": 0,
                          "decode_tokens": 0, "prefill_tokens": 0}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _start_expert_precision(self, config) -> None:
        from pagedmoe.experts.manager import load_expert_stats, save_expert_stats, start_dynamic_precision

        stats = load_expert_stats(config.expert_stats, self.activity)
        self.precision = None
        if self.expert_store.dynamic is not None:
            self.precision = start_dynamic_precision(config, self.expert_store, self.kv, self.plan.kv_bytes_per_block,
                                                     -(-self.max_model_len // config.block_size), self.activity,
                                                     stats)
        if config.expert_stats:
            self._stats_saver = weakref.finalize(self, save_expert_stats, config.expert_stats, self.activity,
                                                 self.precision)

    # -- memory ----------------------------------------------------------------------------------
    def _is_mla(self) -> bool:
        from pagedmoe.models.registry import spec_builder

        return spec_builder(self.hf_config)(self.hf_config)[0].mla is not None

    def _mark(self, stage: str) -> None:
        if self.memory is not None:
            self.memory.mark(stage)

    def _reserve_bytes(self, dims, activation_bytes: int, build_bytes: int, context_bytes: int = 0) -> int:
        """Device memory start-up keeps out of the KV cache for what it cannot measure before sizing it
        (engine/memory.py::device_reserve_bytes): graph pools, a dynamic build, workspaces, fragmentation."""
        return start_up_reserve_bytes(activation_bytes, self.config.max_num_seqs, dims.hidden_size,
                                      dims.moe_intermediate_size, dims.top_k, dims.vocab_size, self.dtype.itemsize,
                                      cuda_graphs=not self._eager, build_bytes=build_bytes,
                                      context_bytes=context_bytes)

    def _resolve_placement(self) -> tuple[str, Optional[list[int]], Optional[list[int]]]:
        """(resident|paged, resident experts per MoE layer, compressed experts per MoE layer). Flags
        decide when they fix it (a static --expert-precision pages every expert: all quantized); otherwise
        the planner (experts/planner.py) picks the placement with the best modelled throughput (with the
        lossless compressed tier among its choices only under --expert-compression lossless)."""
        from pagedmoe.experts.manager import LOSSLESS_PLANNING_RATIO
        from pagedmoe.experts.model_shape import ModelShape
        from pagedmoe.experts.planner import plan_memory as plan_placement_memory
        from pagedmoe.models.registry import spec_builder

        c = self.config
        placement, n = c.placement()
        dims, spec = spec_builder(self.hf_config)(self.hf_config)
        num_moe = dims.num_layers - len(spec.dense_layers)
        lossless = c.expert_compression == "lossless" or bool(c.num_compressed_experts)
        if lossless and self.dtype != torch.bfloat16:
            raise ValueError(f"the lossless compressed tier holds bf16 weights; the model runs in {self.dtype} "
                             "(use --dtype bfloat16)")
        if n is not None:
            if n > dims.num_experts:
                raise ValueError(f"--num-gpu-experts {n} exceeds the model's {dims.num_experts} experts per layer")
            comp = c.num_compressed_experts or 0
            if n + comp > dims.num_experts:
                raise ValueError(f"--num-gpu-experts {n} + --num-compressed-experts {comp} exceeds the model's "
                                 f"{dims.num_experts} experts per layer")
            self._check_fixed_host_tier(dims, spec, n, comp)
            return "paged", [n] * num_moe, [comp] * num_moe
        if placement == "resident" and (c.gpu_memory_gb is None or self.device.type != "cuda"):
            return "resident", None, None
        budget = self._planning_budget(dims)
        if budget is None:  # CPU without a budget: nothing to trade
            if c.expert_compression != "none":
                raise ValueError(f"--expert-compression {c.expert_compression} lets the planner trade memory for "
                                 "a compressed tier; without --gpu-memory-gb on CPU it cannot take effect "
                                 "(give --num-compressed-experts)")
            return ("resident", None, None) if placement == "auto" else ("paged", [0] * num_moe, None)
        dtype_bytes = self.dtype.itemsize
        shape = ModelShape.from_model_dims(dims, spec, dtype_bytes)
        act = estimate_activation_bytes(c.max_num_batched_tokens, c.max_num_seqs, dims.hidden_size,
                                        dims.moe_intermediate_size, dims.top_k, dims.vocab_size, dtype_bytes)
        if self.device.type == "cuda":  # what start-up will keep out of the KV cache (engine/memory.py)
            build = (dynamic_build_bytes(shape.experts_per_gpu, shape.expert_bytes, shape.expert_bytes // dtype_bytes)
                     if c.expert_precision == "dynamic" else 0)
            act += self._reserve_bytes(dims, act, build, CUDA_CONTEXT_BYTES)
        buffers = ("plain" if self.device.type != "cuda" or c.expert_buffers == "plain"
                   else "vmm-ring" if c.expert_buffers == "vmm-ring" else "vmm")
        if placement == "resident":  # refused before loading when the budget cannot hold it (names the minimum)
            plan_placement_memory(shape, budget, act, "resident", max_model_len=self.max_model_len,
                                  block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                                  max_num_batched_tokens=c.max_num_batched_tokens, buffers=buffers)
            return "resident", None, None
        ratio = LOSSLESS_PLANNING_RATIO if c.expert_compression == "lossless" else None
        host_modes = (["none", "lossless"] if c.host_compression == "auto" and self.dtype == torch.bfloat16
                      else [self.host_compression])
        host_budget = self._host_budget()
        plans, errors = {}, []
        for mode in host_modes:
            try:
                plans[mode] = plan_placement_memory(
                    shape, budget, act, placement, None, max_model_len=self.max_model_len, block_size=c.block_size,
                    max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens, buffers=buffers,
                    compression_ratio=ratio,
                    host_compression_ratio=LOSSLESS_PLANNING_RATIO if mode == "lossless" else 0.0,
                    host_budget_bytes=host_budget)
            except ValueError as e:  # PlacementBudgetError: this mode does not fit
                errors.append(e)
        if not plans:
            raise errors[0]
        # auto: the compressed host tier only when it models faster (it only matters for paged plans)
        self.host_compression = max(plans, key=lambda m: (plans[m].estimate.output_throughput, m == "none"))
        plan = plans[self.host_compression]
        self.placement_plan = plan
        logger.info("placement plan: %s", plan.summary())
        per_layer = list(plan.placement.num_gpu_experts)
        comp = list(plan.placement.num_compressed_experts)
        if all(k == dims.num_experts for k in per_layer):
            if c.host_compression == "lossless":
                raise ValueError("--host-compression lossless cannot take effect: at this budget the planner "
                                 "keeps every expert resident, so nothing streams from the host (page anyway "
                                 "with --expert-placement paged, or use --host-compression auto)")
            self.host_compression = "none"
            return "resident", None, None
        return "paged", per_layer, comp if any(comp) else None

    def _check_fixed_host_tier(self, dims, spec, num_gpu: int, num_comp: int) -> None:
        """A placement fixed by the flags (--num-gpu-experts, --cpu-moe) skips the planner's search, not its
        host limit: refuse it before pinning more host memory than the machine has."""
        from pagedmoe.experts.manager import LOSSLESS_PLANNING_RATIO
        from pagedmoe.experts.model_shape import ModelShape
        from pagedmoe.experts.placement import Placement
        from pagedmoe.experts.planner import host_tier_bytes

        num_moe = dims.num_layers - len(spec.dense_layers)
        # NOTE: a static lossy precision holds every expert quantized on the device (experts/manager.py): its
        # host tier is empty, so no host limit can refuse it.
        lossy = self.config.quantized_precision() is not None
        num_host = 0 if lossy else (dims.num_experts - num_gpu - num_comp) * num_moe
        limit = self._host_budget() if num_host > 0 else None
        if limit is None:
            return
        shape = ModelShape.from_model_dims(dims, spec, self.dtype.itemsize)
        placement = Placement.uniform(num_moe, dims.num_experts, num_gpu, num_comp,
                                      LOSSLESS_PLANNING_RATIO if num_comp else 0.0)
        buffers = "plain" if self.device.type != "cuda" or self.config.expert_buffers == "plain" else "vmm"
        need = host_tier_bytes(shape, placement, buffers,
                               LOSSLESS_PLANNING_RATIO if self.host_compression == "lossless" else 0.0)
        if need > limit:
            raise ValueError(f"the host tier of this placement ({num_host} experts, {need / GiB:.2f} GiB) does not "
                             f"fit the host memory limit of {limit / GiB:.2f} GiB: keep more experts on the GPU "
                             "(--num-gpu-experts, --num-compressed-experts), hold the host tier compressed "
                             "(--host-compression lossless), or raise --host-memory-gb")

    def _host_budget(self) -> Optional[int]:
        """Pinned host memory the planner may give the host tier: --host-memory-gb, else what the machine has
        available at start-up less a reserve (engine/memory.py); None: unbounded."""
        if self.config.host_memory_gb is not None:
            return int(self.config.host_memory_gb * GiB)
        budget = detect_host_budget_bytes()
        if budget is None:
            logger.info("host memory unknown (no /proc/meminfo): the host tier is unbounded")
        else:
            logger.info("host tier limit %.2f GiB (MemAvailable less a reserve; --host-memory-gb overrides)",
                        budget / GiB)
        return budget

    def _planning_budget(self, dims) -> Optional[int]:
        if self.config.gpu_memory_gb is not None:
            return int(self.config.gpu_memory_gb * GiB)
        if self.device.type == "cuda":
            return self._default_budget()
        return None

    def _default_budget(self) -> int:
        """Without --gpu-memory-gb on CUDA: 0.9 of what the device has beside other processes (vLLM's default
        --gpu-memory-utilization)."""
        return int(0.9 * (self.memory.total_bytes - self.memory.others_bytes))

    def _plan_memory(self):
        c, dims = self.config, self.model.dims
        weight_bytes = (sum(p.numel() * p.element_size() for p in self.model.parameters())
                        + self.model.expert_store.device_bytes)
        per_block = kv_bytes_per_block(dims.num_layers, dims.num_kv_heads, dims.head_dim, c.block_size,
                                       self.dtype)
        blocks_per_seq = -(-self.max_model_len // c.block_size)
        useful = c.max_num_seqs * blocks_per_seq
        act = estimate_activation_bytes(c.max_num_batched_tokens, c.max_num_seqs, dims.hidden_size,
                                        dims.moe_intermediate_size, dims.top_k, dims.vocab_size,
                                        self.dtype.itemsize)
        if c.num_kv_blocks is not None:
            budget = weight_bytes + act + c.num_kv_blocks * per_block
            return plan_memory(budget, weight_bytes, act, per_block, c.block_size, self.max_model_len,
                               c.num_kv_blocks)
        if self.device.type == "cuda":
            budget = int(c.gpu_memory_gb * GiB) if c.gpu_memory_gb is not None else self._default_budget()
            budget = self._clamp_to_device(budget)
            # Measured: everything the process holds now (context, weights, experts, buffers, torch's cache
            # and fragmentation, VMM mappings) beyond the weights' own bytes; the dynamic experts' floor is
            # counted in weight_bytes but built only once the KV cache exists.
            pending = self.expert_store.dynamic_bytes
            if self.expert_store.dynamic is None:  # dynamic experts are built after the KV cache: estimated
                estimate, act = act, profile_step_bytes(
                    self.model, c.block_size, self.device, self.dtype, c.attention_backend, c.moe_backend,
                    c.max_num_seqs, self.max_model_len, c.max_num_batched_tokens, self.memory,
                    c.fused_ops)
                logger.info("profile step (%d tokens, %d sequences): %.2f GiB of activations (estimate %.2f GiB)",
                            c.max_num_batched_tokens, min(c.max_num_seqs, c.max_num_batched_tokens), act / GiB,
                            estimate / GiB)
            torch.cuda.empty_cache()  # loading's temporaries: what the run re-grows is the reserve's to hold
            measured = self.memory.mark("loaded")
            overhead = max(0, measured - (weight_bytes - pending))
            reserve = overhead + self._reserve_bytes(dims, act, self.expert_store.dynamic_build_bytes)
            return plan_memory(budget, weight_bytes, act, per_block, c.block_size, self.max_model_len, useful,
                               reserve)
        if c.gpu_memory_gb is not None:
            budget = int(c.gpu_memory_gb * GiB)
        else:
            # CPU without a budget: room for every sequence at full length, within 4 GiB of KV.
            useful = min(useful, max(blocks_per_seq, (4 * GiB) // per_block))
            budget = weight_bytes + act + useful * per_block
        return plan_memory(budget, weight_bytes, act, per_block, c.block_size, self.max_model_len, useful)

    def _clamp_to_device(self, budget: int) -> int:
        """A budget above the device's memory is refused. One above what it can give beside other processes
        (less DEVICE_HEADROOM, which the driver keeps) is lowered to that, with a warning."""
        total, others = self.memory.total_bytes, self.memory.others_bytes
        if budget > total:
            raise ValueError(f"--gpu-memory-gb {budget / GiB:.2f} exceeds this device's {total / GiB:.2f} GiB")
        available = total - others - DEVICE_HEADROOM
        if budget > available:
            logger.warning("--gpu-memory-gb %.2f is more than this device can give (%.2f GiB of %.2f, other "
                           "processes hold %.2f): planning for %.2f GiB", budget / GiB, available / GiB,
                           total / GiB, others / GiB, available / GiB)
            return available
        return budget

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int], None], params: SamplingParams,
                    prompt_token_ids: Optional[list[int]] = None) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError("the engine runs one sequence per request: give each of n samples its own request "
                             "(SamplingParams.for_sample; LLM.generate and the server do)")
        if params.logit_bias and max(params.logit_bias) >= self.model.dims.vocab_size:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.model.dims.vocab_size}")
        text = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass prompt token ids")
                text = prompt
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids = list(prompt)
            else:
                raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.dims.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_model_len={self.max_model_len} it "
                             f"must be at most {self.max_model_len - 1} to leave room for one new token")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, ids, params, prompt=text, max_tokens=max_tokens)
        if params.seed is not None:  # before storing anything: a seed torch refuses leaves no trace
            self._generators[request_id] = self.sampler.request_generator(params.seed)
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        self.prompt_tokens_total += len(ids)
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._generators.pop(request_id, None)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (vLLM's name): later requests compute every token again."""
        self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.precision is not None:
            self.precision.tick()  # publish / start precision moves between steps (lends KV blocks)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            logits, rows = self.runner.execute(sched, self.kv)
            try:
                return self._finish_step(sched, logits, rows)
            finally:
                self._record_step_time(sched, time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            if not self.survive_step_oom:
                raise
            # failed below, once the traceback (and the step's tensors it holds) is gone
        return self._fail_step(sched)

    def _fail_step(self, sched) -> list[RequestOutput]:
        """Out of device memory inside a step: the step's requests finish with status "error" and the reason,
        their KV blocks are freed, and the engine serves on (the next step allocates afresh; the memory the
        failed one held is back in torch's pool)."""
        n, tokens = len(sched.scheduled), sched.num_batched_tokens
        what = f"running a step of {n} request{'s' * (n != 1)} ({tokens} token{'s' * (tokens != 1)})"
        error = (f"{DeviceOutOfMemoryError(what)}, "
                 f"{budget_text(self.config.gpu_memory_gb, self.device)}: the step's requests failed (lower "
                 "--max-num-batched-tokens / --max-num-seqs, or raise --gpu-memory-gb)")
        logger.error("%s", error)
        if self.pager is not None:
            self.pager.abort_step()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        now, outputs = time.monotonic(), []
        for s in sched.scheduled:
            request = s.request
            request.error, request.finish_time = error, now
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            self.requests.pop(request.request_id, None)
            self._generators.pop(request.request_id, None)
            outputs.append(self.outputs.make_output(request))
        return outputs

    def _record_step_time(self, sched, seconds: float) -> None:
        st = self.step_time
        if all(s.num_new_tokens == 1 for s in sched.scheduled):
            st["decode_s"] += seconds
            st["decode_steps"] += 1
            st["decode_tokens"] += len(sched.scheduled)
        else:
            st["prefill_s"] += seconds
            st["prefill_steps"] += 1
            st["prefill_tokens"] += sched.num_batched_tokens

    def _finish_step(self, sched, logits, rows) -> list[RequestOutput]:
        self.scheduler.update(sched.scheduled)
        self.activity.end_step()
        self.num_steps += 1
        if not rows:
            return []
        sampling = [sched.scheduled[r].request for r in rows]
        logits = self.outputs.mask_min_tokens(logits, sampling)
        params = [r.params for r in sampling]
        histories = ([(r.prompt_token_ids, r.output_token_ids) for r in sampling]
                     if any(p.penalised for p in params) else None)
        sample = self.sampler.sample(logits, params, [self._generators.get(r.request_id) for r in sampling],
                                     histories)
        if self.pager is not None:
            self.pager.end_step()  # the sample reached the host: every event of the step is done
        results = []
        now = time.monotonic()
        for i, request in enumerate(sampling):
            self.generation_tokens_total += 1
            status = self.outputs.append_token(request, sample.token_ids[i], sample.logprobs[i],
                                               sample.sampled_logprob[i], now)
            if status is not None:
                self.scheduler.finish_request(request, status)
                self.requests.pop(request.request_id, None)
                self._generators.pop(request.request_id, None)
            elif request.params.output_kind == "final_only":
                continue
            results.append(self.outputs.make_output(request))
        return results

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [n, V] (float32, on the host) at every position of one sequence, for evaluation.
        Runs alone, outside the scheduler: call it only while no requests are running."""
        from pagedmoe.engine.request import Request
        from pagedmoe.engine.scheduler import ScheduledRequest, SchedulerOutput

        if self.has_unfinished_requests():
            raise RuntimeError("score() needs an idle engine")
        if not 0 < len(token_ids) <= self.max_model_len:
            raise ValueError(f"score() takes 1..{self.max_model_len} tokens, got {len(token_ids)}")
        req = Request("__score__", list(token_ids), SamplingParams(max_tokens=1))
        if not self.kv.allocate(req.request_id, len(token_ids)):
            raise MemoryError("not enough KV blocks to score this sequence")
        try:
            out = SchedulerOutput([ScheduledRequest(req, len(token_ids), 0)])
            inputs = self.runner.prepare(out, self.kv)
            positions = torch.arange(len(token_ids), device=self.device)
            logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, positions)
            self.activity.end_step()
            return logits.cpu()
        finally:
            self.kv.free(req.request_id)

    def get_stats(self) -> dict:
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": self.kv.usage(),
            "num_kv_blocks": self.kv.num_blocks,
            "num_free_kv_blocks": self.kv.num_free_blocks,
            "num_preemptions_total": self.scheduler.num_preemptions_total,
            "prefix_cache_queries_total": self.kv.prefix_cache_queries,
            "prefix_cache_hits_total": self.kv.prefix_cache_hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_steps": self.num_steps,
            **{f"step_{k}": v for k, v in self.step_time.items()},
            **self.expert_stats(),
            **self.device_memory_stats(),
        }

    def device_memory_stats(self) -> dict:
        """The process's device memory now and at its peak since start-up, beside the budget (bytes; the
        driver's count: worker/device_memory.py). Empty off CUDA."""
        if self.memory is None:
            return {}
        return {"device_memory_used_bytes": self.memory.used_bytes(),
                "device_memory_peak_bytes": self.memory.peak_bytes, "gpu_memory_budget_bytes": self.plan.budget_bytes}

    def expert_traffic_summary(self, since: Optional[dict] = None) -> Optional[str]:
        """One line on the pager's work (since the `expert_stats()` snapshot `since`): bytes host->device in
        all and per step, copy time, time compute waited for experts, the share of copying hidden behind
        compute. None when nothing is paged. Copy and wait times come from CUDA events of eager steps
        (graph replays are counted in bytes only)."""
        if self.pager is None:
            return None
        now = self.expert_stats()
        d = {k: now[k] - (since or {}).get(k, 0) for k in ("expert_bytes_h2d", "expert_bytes_decoded",
                                                            "expert_copy_s", "expert_wait_s", "expert_steps")}
        steps = max(1, d["expert_steps"])
        text = (f"expert paging: {d['expert_bytes_h2d'] / 1e9:.2f} GB host->device over {d['expert_steps']} steps "
                f"({d['expert_bytes_h2d'] / steps / 1e9:.3f} GB/step)")
        if d["expert_bytes_decoded"]:
            text += f", {d['expert_bytes_decoded'] / 1e9:.2f} GB decoded"
        if d["expert_copy_s"] > 0:
            hidden = 1.0 - d["expert_wait_s"] / d["expert_copy_s"]
            text += (f"; copy stream busy {d['expert_copy_s']:.2f} s "
                     f"({d['expert_bytes_h2d'] / d['expert_copy_s'] / 1e9:.1f} GB/s), compute waited "
                     f"{d['expert_wait_s']:.2f} s, {100 * max(0.0, hidden):.0f}% of copying hidden")
        elif self.device.type == "cuda":
            text += "; copy time not timed (CUDA-graph replays)"
        return text

    def expert_stats(self) -> dict:
        store = self.expert_store
        out = {"expert_placement": "paged" if store.paged else "resident",
               "experts": {f"{tier}/{prec}": n for (tier, prec), n in store.table.counts().items()},
               "expert_resident_bytes": store.resident_bytes, "expert_compressed_bytes": store.compressed_bytes,
               "expert_quantized_bytes": store.quantized_bytes, "expert_host_bytes": store.host_bytes,
               "expert_buffer_bytes": store.buffer_bytes}
        if self.pager is not None:
            out.update({f"expert_{k}": v for k, v in self.pager.stats.as_dict().items()})
        if self.precision is not None:
            out.update(self.precision.as_dict())
        return out
