"""The engine configuration nested by section: what the model is and where it runs, the scheduler's limits,
the KV cache and memory, the experts. EngineConfig (config.py) keeps the flat fields, which are the flag
names of the CLI, the environment (PAGEDMOE_*) and LLM(**kwargs), and builds these views from them on
construction; building ExpertConfig checks the expert flags' rules (their messages name the flags).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

# exact: experts keep their checkpoint values; static-*: every expert held on the device in one lossy
# format, dequantised into the paged compute buffers; dynamic: each expert at its own rung, moved down and up
# the ladder by the pressure controller (experts/dynamic/controller.py).
EXPERT_PRECISIONS = ("exact", "static-fp8", "static-int8", "static-int4", "dynamic")
MIN_EXPERT_PRECISIONS = ("fp8", "int8", "int4")
# --compressed-gemm values whose MoE GEMMs read the compressed GPU tier in place, and the format each holds it in
FUSED_FORMATS = {"fused": "tiled", "fused-hibyte": "hibyte", "fused-hibyte-exact": "hibyte"}
# and the kernel each runs on it: "exact" keeps the bf16 kernel's sums (logits equal to the decoding path's), "fast"
# (hibyte) decodes in the MMA operand registers, where the MMA groups K its own way (bf16 GEMM tolerance)
FUSED_KERNELS = {"fused": "exact", "fused-hibyte": "fast", "fused-hibyte-exact": "exact"}


def fused_format(compressed_gemm: str) -> Optional[str]:
    """"tiled" (format version 2), "hibyte" (version 3) or None (the tier is decoded)."""
    return FUSED_FORMATS.get(compressed_gemm)


def fused_kernel(compressed_gemm: str) -> Optional[str]:
    """"exact" or "fast" (the fused tier's GEMM, kernels/fused_moe_hibyte.TIER_KERNELS), None (decoded)."""
    return FUSED_KERNELS.get(compressed_gemm)


@dataclass(frozen=True)
class ModelConfig:
    path: Optional[str]
    tokenizer: Optional[str]
    dtype: str
    device: str
    max_model_len: Optional[int]
    seed: int
    load_format: str
    served_model_name: Optional[str]
    enforce_eager: bool
    prefill_graph_tokens: Optional[int]   # None: PREFILL_GRAPH_TOKENS where prefill graphs can be captured
    attention_backend: str
    moe_backend: str
    fused_ops: str
    backbone_gemm: str
    generation_config: str                    # auto | vllm | a folder (generation_config.py)
    override_generation_config: Optional[Union[str, dict]]
    chat_template: Optional[str]              # --chat-template (chat_template.py)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: Optional[bool]  # None: on where it can take effect (engine/async_step.py)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_kv_blocks: Optional[int]
    gpu_memory_gb: Optional[float]
    host_memory_gb: Optional[float]
    enable_prefix_caching: bool
    swap_space: Optional[float]   # None: sized where preemption can happen on CUDA (kvcache/swap.py)


@dataclass(frozen=True)
class ParallelConfig:
    """vLLM's names: the ranks the model is split over and whether the experts are split whole (parallel/)."""
    tensor_parallel_size: int
    enable_expert_parallel: bool


@dataclass(frozen=True)
class ExpertConfig:
    placement: str
    num_gpu_experts: Optional[int]
    cpu_moe: bool
    num_compressed_experts: Optional[int]
    compression: Optional[str]        # None: unset (the compressed tier only for routed placements)
    host_compression: Optional[str]   # None: unset (none; auto for routed placements)
    buffers: str
    fetch: str
    prefetch: bool
    fetch_path: str
    precision: str
    quantized_gemm: str
    compressed_gemm: str
    min_precision: Optional[str]
    kv_low_watermark: Optional[float]
    kv_high_watermark: Optional[float]
    stats: Optional[str]

    def __post_init__(self) -> None:
        """The expert flags' cross-flag rules, in the order they always ran."""
        self._check_placement()
        self._check_dynamic()
        self._check_static_precision()

    def _check_placement(self) -> None:
        if self.num_gpu_experts is not None and self.num_gpu_experts < 0:
            raise ValueError(f"num_gpu_experts must be >= 0, got {self.num_gpu_experts}")
        if self.placement == "resident" and (self.cpu_moe or self.num_gpu_experts is not None):
            flag = "--cpu-moe" if self.cpu_moe else "--num-gpu-experts"
            raise ValueError(f"{flag} pages experts and cannot take effect with --expert-placement resident")
        if self.cpu_moe and self.num_gpu_experts not in (None, 0):
            raise ValueError("--cpu-moe pages every expert; it contradicts --num-gpu-experts "
                             f"{self.num_gpu_experts}")
        if self.num_compressed_experts is not None:
            if self.num_compressed_experts < 0:
                raise ValueError(f"num_compressed_experts must be >= 0, got {self.num_compressed_experts}")
            if self.placement == "resident" and self.num_compressed_experts:
                raise ValueError("--num-compressed-experts pages experts and cannot take effect with "
                                 "--expert-placement resident")
        if self.compression == "lossless":
            if self.placement == "resident":
                raise ValueError(f"--expert-compression {self.compression} cannot take effect with "
                                 "--expert-placement resident")
            if (self.cpu_moe or self.num_gpu_experts is not None) and not self.num_compressed_experts:
                raise ValueError(f"--expert-compression {self.compression} lets the planner choose the "
                                 "compressed tier; --cpu-moe/--num-gpu-experts fix the placement: give "
                                 "--num-compressed-experts instead")
        if self.host_compression in ("lossless", "auto"):
            if self.placement == "resident":
                raise ValueError(f"--host-compression {self.host_compression} compresses the host tier and cannot "
                                 "take effect with --expert-placement resident")
            if self.precision != "exact":
                raise ValueError(f"--host-compression {self.host_compression} keeps exact experts; it contradicts "
                                 f"--expert-precision {self.precision}")

    def _check_static_precision(self) -> None:
        if self.quantized_precision() is not None:
            flag = self.precision
            if self.placement == "resident":
                raise ValueError(f"--expert-precision {flag} dequantises experts into paged buffers and cannot "
                                 "take effect with --expert-placement resident")
            for name, given in (("--cpu-moe", self.cpu_moe), ("--num-gpu-experts", self.num_gpu_experts is not None),
                                ("--num-compressed-experts", self.num_compressed_experts is not None),
                                ("--expert-compression", self.compression == "lossless")):
                if given:
                    raise ValueError(f"--expert-precision {flag} holds every expert in one lossy format; it "
                                     f"contradicts {name}")

    def _check_dynamic(self) -> None:
        dynamic = self.precision == "dynamic"
        for name, value in (("min_expert_precision", self.min_precision), ("kv_low_watermark", self.kv_low_watermark),
                            ("kv_high_watermark", self.kv_high_watermark)):
            if value is not None and not dynamic:
                raise ValueError(f"--{name.replace('_', '-')} only takes effect with --expert-precision dynamic")
        if self.min_precision is not None and self.min_precision not in MIN_EXPERT_PRECISIONS:
            raise ValueError(f"min_expert_precision must be one of {', '.join(MIN_EXPERT_PRECISIONS)}; got "
                             f"{self.min_precision!r}")
        if not dynamic:
            return
        low, high = self.watermarks()
        if not (0.0 <= low < high <= 1.0):
            raise ValueError(f"KV watermarks need 0 <= --kv-low-watermark < --kv-high-watermark <= 1 (fractions "
                             f"of the KV cache's blocks); got low={low}, high={high}")
        for name, given in (("--expert-placement resident", self.placement == "resident"),
                            ("--cpu-moe", self.cpu_moe), ("--num-gpu-experts", self.num_gpu_experts is not None),
                            ("--num-compressed-experts", self.num_compressed_experts is not None),
                            ("--expert-compression", self.compression == "lossless"),
                            ("--expert-buffers vmm", self.buffers in ("vmm", "vmm-ring"))):
            if given:
                raise ValueError(f"--expert-precision dynamic places every expert itself (paged, plain compute "
                                 f"buffers); it contradicts {name}")

    def watermarks(self) -> tuple[float, float]:
        """(low, high) KV watermarks of dynamic precision, as fractions of the KV cache's blocks."""
        low = 0.05 if self.kv_low_watermark is None else self.kv_low_watermark
        high = 0.25 if self.kv_high_watermark is None else self.kv_high_watermark
        return low, high

    def placement_mode(self) -> tuple[str, Optional[int]]:
        """(resident|paged|auto, resident experts per layer or None when not fixed by a flag)."""
        if self.cpu_moe or self.quantized_precision() is not None or self.precision == "dynamic":
            return "paged", 0
        if self.num_gpu_experts is not None:
            return "paged", self.num_gpu_experts
        if self.num_compressed_experts:  # a fixed compressed tier: nothing else resident
            return "paged", 0
        return self.placement, None

    def quantized_precision(self) -> Optional[str]:
        """The lossy format of a static --expert-precision ("fp8", "int8", "int4"), else None."""
        p = self.precision
        return p[len("static-"):] if p in EXPERT_PRECISIONS and p.startswith("static-") else None


# section attribute of EngineConfig -> (its class, {flat field name: name in the section}); every field is in one
SECTIONS = {
    "model_config": (ModelConfig, {"model": "path", "tokenizer": "tokenizer", "dtype": "dtype", "device": "device",
                                   "max_model_len": "max_model_len", "seed": "seed", "load_format": "load_format",
                                   "served_model_name": "served_model_name", "enforce_eager": "enforce_eager",
                                   "prefill_graph_tokens": "prefill_graph_tokens",
                                   "attention_backend": "attention_backend", "moe_backend": "moe_backend",
                                   "fused_ops": "fused_ops", "backbone_gemm": "backbone_gemm",
                                   "generation_config": "generation_config",
                                   "override_generation_config": "override_generation_config",
                                   "chat_template": "chat_template"}),
    "scheduler": (SchedulerConfig, {"max_num_seqs": "max_num_seqs",
                                    "max_num_batched_tokens": "max_num_batched_tokens",
                                    "async_scheduling": "async_scheduling"}),
    "cache": (CacheConfig, {"block_size": "block_size", "num_kv_blocks": "num_kv_blocks",
                            "gpu_memory_gb": "gpu_memory_gb", "host_memory_gb": "host_memory_gb",
                            "enable_prefix_caching": "enable_prefix_caching", "swap_space": "swap_space"}),
    "parallel": (ParallelConfig, {"tensor_parallel_size": "tensor_parallel_size",
                                  "enable_expert_parallel": "enable_expert_parallel"}),
    "experts": (ExpertConfig, {"expert_placement": "placement", "num_gpu_experts": "num_gpu_experts",
                               "cpu_moe": "cpu_moe", "num_compressed_experts": "num_compressed_experts",
                               "expert_compression": "compression", "host_compression": "host_compression",
                               "expert_buffers": "buffers", "expert_fetch": "fetch", "expert_prefetch": "prefetch",
                               "expert_fetch_path": "fetch_path", "expert_precision": "precision",
                               "quantized_gemm": "quantized_gemm", "compressed_gemm": "compressed_gemm",
                               "min_expert_precision": "min_precision",
                               "kv_low_watermark": "kv_low_watermark", "kv_high_watermark": "kv_high_watermark",
                               "expert_stats": "stats"}),
}
