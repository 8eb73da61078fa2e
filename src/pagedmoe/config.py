"""Engine configuration: one frozen dataclass field per CLI flag, invariants checked on construction.

The flat fields are the flag surface; `config.model_config`, `.scheduler`, `.cache`, `.parallel` and `.experts`
are the same values nested by section (config_sections.py), checked on construction.

The same fields back `LLM(**flags)`, the CLI (`--max-model-len` etc., generated from the fields below)
and environment variables `PAGEDMOE_<FLAG_NAME>` (flags win over the environment).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedmoe.config_sections import (FUSED_FORMATS, SECTIONS, CacheConfig, ExpertConfig, ModelConfig, ParallelConfig,
                                      SchedulerConfig, EXPERT_PRECISIONS, MIN_EXPERT_PRECISIONS, fused_format)

__all__ = ["EngineConfig", "ModelConfig", "SchedulerConfig", "CacheConfig", "ExpertConfig", "add_engine_args",
           "engine_config_from_args", "engine_config_from_kwargs", "default_model_path", "resolve_model"]

_DTYPES = ("auto", "bfloat16", "float16", "float32")
_LOAD_FORMATS = ("auto", "dummy")
_DEVICES = ("auto", "cpu", "cuda")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
_MOE_BACKENDS = ("auto", "grouped_mm", "triton", "loop")
_FUSED_OPS = ("auto", "on", "off")  # layers/fused_ops.py
_BACKBONE_GEMMS = ("auto", "triton", "torch")  # layers/linear.py
_PLACEMENTS = ("resident", "paged", "auto")
_EXPERT_BUFFERS = ("auto", "plain", "vmm", "vmm-ring")
_EXPERT_FETCH = ("auto", "stream", "routed")
_EXPERT_FETCH_PATHS = ("auto", "copy", "uva")
_EXPERT_COMPRESSION = ("none", "lossless")
_HOST_COMPRESSION = ("none", "lossless", "auto")
_QUANTIZED_GEMMS = ("auto", "dequant", "direct")
_COMPRESSED_GEMMS = ("auto", "decode", *FUSED_FORMATS)


def _flag(default: Any, help: str, choices: tuple | None = None, type_: Any = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "type": type_})


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = _flag(None, "HF checkpoint folder; default: the embedded default model")
    tokenizer: Optional[str] = _flag(None, "tokenizer folder (default: the model folder)")
    dtype: str = _flag("auto", "weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU)",
                       _DTYPES)
    device: str = _flag("auto", "cpu or cuda (auto: cuda when available)", _DEVICES)
    max_model_len: Optional[int] = _flag(None, "longest prompt + output, in tokens "
                                               "(default: the model's max_position_embeddings)", type_=int)
    max_num_seqs: int = _flag(256, "most sequences in one step", type_=int)
    max_num_batched_tokens: int = _flag(8192, "most tokens in one step (prefill is chunked to fit)",
                                        type_=int)
    async_scheduling: Optional[bool] = _flag(None, "prepare the next step (schedule, inputs) and process the "
                                                   "previous one's tokens (detokenise, stop checks) while the GPU "
                                                   "runs a step, as vLLM's --async-scheduling; stops are seen one "
                                                   "step late (that step's token is dropped). Default: on where it "
                                                   "can take effect (CUDA, resident experts, one GPU, fixed "
                                                   "precision), as vLLM's default since 0.14; "
                                                   "--no-async-scheduling turns it off", type_=bool)
    gpu_memory_gb: Optional[float] = _flag(None, "whole device memory budget in GiB (weights + KV cache "
                                                 "+ activations); on CPU it bounds the simulated pool",
                                           type_=float)
    host_memory_gb: Optional[float] = _flag(None, "pinned host memory the host tier (paged experts) may take, in "
                                                  "GiB (a rank's, under --tensor-parallel-size); the planner keeps "
                                                  "more experts on the GPU to stay within it (default: MemAvailable at start-up less a tenth of RAM, at "
                                                  "least 4 GiB or a quarter of a smaller machine's; unbounded "
                                                  "without /proc/meminfo)", type_=float)
    block_size: int = _flag(16, "tokens per KV cache block", type_=int)
    num_kv_blocks: Optional[int] = _flag(None, "force the number of KV cache blocks (overrides the budget)",
                                         type_=int)
    seed: int = _flag(0, "random seed for weights of --load-format dummy and unseeded sampling", type_=int)
    load_format: str = _flag("auto", "auto: read safetensors; dummy: random weights of the right shapes",
                             _LOAD_FORMATS)
    enforce_eager: bool = _flag(False, "disable CUDA graphs", type_=bool)
    prefill_graph_tokens: Optional[int] = _flag(None, "steps that are not decode-only (prefill, chunks, decode rows "
                                                      "beside them) of at most this many tokens and 4 sequences "
                                                      "replay CUDA graphs, one per token bucket (16, 32, ..): an "
                                                      "eager 512-token prefill is host-bound; default 512 (at most "
                                                      "--max-num-batched-tokens and --max-model-len) with resident experts, where "
                                                      "decode graphs are captured; 0: eager", type_=int)
    enable_prefix_caching: bool = _flag(True, "automatic prefix caching: requests whose tokens start alike share "
                                              "the KV blocks of that start, computed once (vLLM's default)",
                                        type_=bool)
    swap_space: Optional[float] = _flag(None, "pinned host memory in GiB for the KV of preempted requests (vLLM's "
                                              "--swap-space): swapped out and back in instead of recomputed; 0: "
                                              "recompute. Default: on CUDA, what max_num_seqs sequences of max_model_len "
                                              "tokens can need beyond the KV cache, at most 16 GiB and half the host "
                                              "memory available (a rank's share of it under tensor parallelism); "
                                              "0 on CPU",
                                        type_=float)
    served_model_name: Optional[str] = _flag(None, "model name reported by the API")
    generation_config: str = _flag("auto", "where the default sampling parameters of requests that leave them out "
                                           "come from (temperature, top_p, top_k, min_p, repetition_penalty, and "
                                           "max_new_tokens as max_tokens): auto: the model folder's "
                                           "generation_config.json; vllm: none, pagedmoe's own defaults; or a "
                                           "folder holding a generation_config.json")
    chat_template: Optional[str] = _flag(None, "a Jinja chat template (a file holding it, or the template itself) "
                                               "in place of the tokenizer's own, for every chat request")
    override_generation_config: Optional[Union[str, dict]] = _flag(
        None, "a JSON object of those sampling keys that replaces or adds to the defaults --generation-config "
              "gives (with vllm: these alone; null drops one), e.g. '{\"temperature\": 0.5}'")
    attention_backend: str = _flag("auto", "attention implementation", _ATTENTION_BACKENDS)
    moe_backend: str = _flag("auto", "expert GEMM implementation", _MOE_BACKENDS)
    fused_ops: str = _flag("auto", "fused Triton kernels for the decode step's small ops (residual add + RMSNorm; "
                                   "q/k norm + RoPE + KV write; router top-k): on, off, or auto (on on CUDA "
                                   "with triton installed: faster at every measured batch)", _FUSED_OPS)
    backbone_gemm: str = _flag("auto", "GEMM of the backbone linears (attention q/k/v/o, router gate, lm_head) in "
                                       "steps of at most 16 tokens: triton (kernels/small_gemm.py, needs CUDA), "
                                       "torch (cuBLAS), or auto (triton for the routers' gates on CUDA, where "
                                       "it measured faster on the H200; torch for the rest)", _BACKBONE_GEMMS)
    expert_placement: str = _flag("auto", "resident: every expert in GPU memory; paged: experts stream "
                                              "from pinned host memory one layer ahead (with "
                                              "--num-gpu-experts resident per layer); auto: the planner picks",
                                  _PLACEMENTS)
    num_gpu_experts: Optional[int] = _flag(None, "experts per layer kept resident when paged", type_=int)
    cpu_moe: bool = _flag(False, "page every expert from host memory (llama.cpp's --cpu-moe)", type_=bool)
    num_compressed_experts: Optional[int] = _flag(None, "experts per layer kept losslessly compressed in GPU "
                                                        "memory and decoded each step (paged placement; "
                                                        "with --num-gpu-experts resident, else 0; bf16 only)", type_=int)
    expert_compression: Optional[str] = _flag(None, "lossless: let the planner (--expert-placement auto/paged) "
                                                    "also choose a lossless compressed GPU tier (bf16 only); none: "
                                                    "never; default: only for placements chosen for routed "
                                                    "fetching (--expert-fetch auto/routed)", _EXPERT_COMPRESSION)
    host_compression: Optional[str] = _flag(None, "lossless: hold the host tier's experts losslessly compressed "
                                                  "in pinned memory (~0.68x the bytes over PCIe), decoded on the "
                                                  "GPU after the copy (bf16, paged placement); auto: when the "
                                                  "planner models it faster; none: never; default: none, but "
                                                  "auto for placements chosen for routed fetching",
                                            _HOST_COMPRESSION)
    expert_buffers: str = _flag("auto", "paged compute buffers: vmm (CUDA virtual memory, resident experts "
                                        "mapped in place, streamed ones copied one layer ahead), vmm-ring (the "
                                        "same memory as one ring of rows: copies start as soon as a row is free, "
                                        "many layers ahead), plain (double buffer), auto (vmm on CUDA)",
                                _EXPERT_BUFFERS)
    expert_fetch: str = _flag("auto", "how paged experts reach the GPU: stream (every host expert of every layer, "
                                      "one layer ahead), routed (only the experts the router picks, into a GPU "
                                      "expert cache with LRU eviction), auto (the cost model picks per batch)",
                              _EXPERT_FETCH)
    expert_prefetch: bool = _flag(False, "--expert-fetch routed: also prefetch, on the copy stream, the experts layer "
                                         "l+1's router picks for layer l's input (hides copies behind compute, "
                                         "moves the mispredicted ones too)", type_=bool)
    expert_fetch_path: str = _flag("auto", "--expert-fetch routed: how a layer's routed misses arrive: copy (the "
                                           "copy engine, after a host sync per MoE layer: steps run eager), uva "
                                           "(a GPU kernel reads them from mapped pinned host memory, a compressed "
                                           "host tier decoded as it is read, the compressed GPU tier's decoded on "
                                           "the device, no sync: decode steps run in CUDA graphs), auto (the cost "
                                           "model picks per "
                                           "CUDA-graph batch bucket)", _EXPERT_FETCH_PATHS)
    expert_precision: str = _flag("exact", "exact: experts keep their checkpoint values; static-fp8/int8/int4: "
                                           "every expert held in GPU memory in that lossy format and "
                                           "dequantised each step (paged); dynamic: each expert at its own "
                                           "precision, demoted under KV-cache pressure and promoted back",
                                  EXPERT_PRECISIONS)
    quantized_gemm: str = _flag("auto", "lossy experts (--expert-precision static-* or dynamic): dequant (each "
                                        "step write every expert into the compute buffer, then bf16 GEMMs), "
                                        "direct (steps of up to 512 tokens multiply the experts where they are, "
                                        "dequantising tiles in registers; longer prefill chunks dequantise) or "
                                        "auto (direct for static fp8/int8/int4 on CUDA, where it measured 1.1-2.5x "
                                        "faster per MoE layer; dequant otherwise)",
                                _QUANTIZED_GEMMS)
    compressed_gemm: str = _flag("auto", "lossless compressed GPU tier (--num-compressed-experts, --expert-compression "
                                         "lossless): decode (experts kept in the Huffman format, version 1, "
                                         "decoded into the compute buffer each step, then bf16 GEMMs) or fused "
                                         "(kept in the tiled format, version 2, ~0.75x of bf16: the MoE GEMMs read "
                                         "them and decode weight tiles in registers, no bf16 copy written; same "
                                         "logits bit for bit; 1.9-3.9x bf16's MoE time on the H200) or "
                                         "fused-hibyte (format version 3, ~0.77x, held tile-major, decoded four "
                                         "weights a word straight into the MMA operands: outputs within bf16 GEMM "
                                         "tolerance of the decode path, not bit-equal; one MoE layer on the H100: "
                                         "0.73-0.85x bf16's time at Mixtral 1-64 and Qwen3 16-256 tokens, 1.3x at "
                                         "Mixtral 256, 1.6x at Qwen3 1; hidden and expert sizes multiples of 64) or "
                                         "fused-hibyte-exact (the same bytes, the bf16 kernel's sums: logits bit "
                                         "for bit; 0.81-0.93x bf16's time at Mixtral 16-64 and Qwen3 16-256, "
                                         "1.1-1.6x at the other sizes) or auto (fused-hibyte where its kernel can "
                                         "run: CUDA, exact bf16 experts fetched by stream steps, the Triton MoE "
                                         "kernels, one rank, sizes multiples of 64, and the placement search "
                                         "keeps a stream-fetched compressed tier; decode otherwise)",
                                 _COMPRESSED_GEMMS)
    min_expert_precision: Optional[str] = _flag(None, "lowest rung dynamic precision may demote an expert to "
                                                      "(default int4; dynamic only)", MIN_EXPERT_PRECISIONS)
    kv_low_watermark: Optional[float] = _flag(None, "dynamic: demote experts while free KV blocks are below this "
                                                    "fraction of the KV cache (default 0.05)", type_=float)
    kv_high_watermark: Optional[float] = _flag(None, "dynamic: promote experts while free KV blocks are above this "
                                                     "fraction (default 0.25; 1.0 never promotes)", type_=float)
    tensor_parallel_size: int = _flag(1, "ranks (one process and GPU each) the model is split over: attention "
                                         "heads, MLPs and each expert's intermediate dim; the process started "
                                         "spawns the others (or run under torchrun)", type_=int)
    enable_expert_parallel: bool = _flag(False, "split the experts over the tensor-parallel ranks (E/N whole "
                                                "experts each, each rank paging its share under its own "
                                                "budget) instead of splitting every expert", type_=bool)
    expert_stats: Optional[str] = _flag(None, "JSON file of expert activity (and the dynamic precision map): "
                                              "loaded at start when it exists, saved at exit")

    def __post_init__(self) -> None:
        """Every cross-flag rule, once, in this order: sizes and limits, placement, dynamic and static precision,
        choices, the quantized GEMM path."""
        self._check_limits()
        for name in SECTIONS:  # the nested views (config_sections.py); ExpertConfig checks the expert flags
            self.section(name)
        self._check_choices()
        self._check_quantized_gemm()
        self._check_compressed_gemm()

    def _check_limits(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.prefill_graph_tokens is not None and self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0 (0: eager prefill), got {self.prefill_graph_tokens}")
        if self.prefill_graph_tokens and self.enforce_eager:
            raise ValueError("--prefill-graph-tokens captures CUDA graphs, which --enforce-eager turns off")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-expert-parallel needs --tensor-parallel-size > 1 (the experts are split "
                             "over the tensor-parallel ranks)")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("--async-scheduling does not support --tensor-parallel-size > 1 yet (the workers get "
                             "host inputs only)")
        if self.tensor_parallel_size > 1 and self.expert_precision == "dynamic":
            raise ValueError("--expert-precision dynamic does not support --tensor-parallel-size > 1 yet (each "
                             "rank would demote and promote its experts on its own)")
        if self.enable_expert_parallel and self.expert_stats:
            raise ValueError("--expert-stats does not support --enable-expert-parallel yet (each rank's experts "
                             "are its own share)")
        if self.gpu_memory_gb is not None and not 0 < self.gpu_memory_gb < math.inf:  # nan, inf: no budget
            raise ValueError(f"gpu_memory_gb must be > 0 and finite, got {self.gpu_memory_gb}")
        if self.swap_space is not None and not 0 <= self.swap_space < math.inf:
            raise ValueError(f"swap_space must be >= 0 (GiB of host memory for preempted requests' KV), got "
                             f"{self.swap_space}")
        if self.host_memory_gb is not None and not self.host_memory_gb > 0:
            raise ValueError(f"host_memory_gb must be > 0 (GiB of host memory for the pinned host tier), got "
                             f"{self.host_memory_gb}")

    def _check_choices(self) -> None:
        for name, choices in (("dtype", _DTYPES), ("load_format", _LOAD_FORMATS), ("device", _DEVICES),
                              ("attention_backend", _ATTENTION_BACKENDS), ("moe_backend", _MOE_BACKENDS),
                              ("fused_ops", _FUSED_OPS), ("backbone_gemm", _BACKBONE_GEMMS),
                              ("expert_placement", _PLACEMENTS), ("expert_buffers", _EXPERT_BUFFERS),
                              ("expert_fetch", _EXPERT_FETCH), ("expert_fetch_path", _EXPERT_FETCH_PATHS),
                              ("expert_compression", _EXPERT_COMPRESSION),
                              ("host_compression", _HOST_COMPRESSION),
                              ("expert_precision", EXPERT_PRECISIONS), ("quantized_gemm", _QUANTIZED_GEMMS),
                              ("compressed_gemm", _COMPRESSED_GEMMS)):
            unset = getattr(self, name) is None and name in ("expert_compression", "host_compression")
            if getattr(self, name) not in choices and not unset:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")

    def _check_quantized_gemm(self) -> None:
        if self.quantized_gemm == "direct":
            if not (self.expert_precision.startswith("static-") or self.expert_precision == "dynamic"):
                raise ValueError("--quantized-gemm direct multiplies lossy experts; it needs --expert-precision "
                                 f"static-fp8/int8/int4 or dynamic (got {self.expert_precision})")
            if self.moe_backend not in ("auto", "triton"):
                raise ValueError(f"--quantized-gemm direct runs the Triton MoE kernels; --moe-backend "
                                 f"{self.moe_backend} cannot use it")

    def _check_compressed_gemm(self) -> None:
        if fused_format(self.compressed_gemm) is not None:
            flag = f"--compressed-gemm {self.compressed_gemm}"
            if self.expert_compression != "lossless" and not self.num_compressed_experts:
                raise ValueError(f"{flag} reads the lossless compressed GPU tier; it needs "
                                 "--num-compressed-experts N or --expert-compression lossless")
            if self.moe_backend not in ("auto", "triton"):
                raise ValueError(f"{flag} runs the Triton MoE kernels; --moe-backend "
                                 f"{self.moe_backend} cannot use it")

    def resolved_quantized_gemm(self, device_type: str) -> str:
        """--quantized-gemm with auto settled: direct where benchmarks/bench_dequant.py measured it faster at
        every batch from 1 to 256 tokens (static fp8 / int8 / int4 on CUDA with the Triton MoE kernels; at
        58408ed 2.0-2.5x, 1.4-2.5x and 1.1-1.45x per MoE layer), dequant elsewhere (dynamic layers: the
        burst ran slower with direct, benchmarks/bench_dynamic.py)."""
        if self.quantized_gemm != "auto":
            return self.quantized_gemm
        fast = self.expert_precision.startswith("static-") and self.moe_backend in ("auto", "triton")
        return "direct" if fast and device_type == "cuda" else "dequant"

    # -- the nested view: built from the flat fields on each access (they are the flag surface, and
    # `vars(config)` stays the flags alone)
    def section(self, name: str):
        cls, names = SECTIONS[name]
        return cls(**{nested: getattr(self, flat) for flat, nested in names.items()})

    @property
    def model_config(self) -> ModelConfig:
        return self.section("model_config")

    @property
    def scheduler(self) -> SchedulerConfig:
        return self.section("scheduler")

    @property
    def cache(self) -> CacheConfig:
        return self.section("cache")

    @property
    def experts(self) -> ExpertConfig:
        return self.section("experts")

    @property
    def parallel(self) -> ParallelConfig:
        return self.section("parallel")

    # the expert flags' derived values live with them (ExpertConfig); kept here under their old names
    def watermarks(self) -> tuple[float, float]:
        return self.experts.watermarks()

    def placement(self) -> tuple[str, Optional[int]]:
        return self.experts.placement_mode()

    def quantized_precision(self) -> Optional[str]:
        return self.experts.quantized_precision()

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _env_name(flag_name: str) -> str:
    return "PAGEDMOE_" + flag_name.upper()


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


class EnvVarError(ValueError):
    """A PAGEDMOE_* variable whose value its flag cannot take (raised while the parser is built, so even
    `--help` reports it, in one line: cli.py)."""


_EXPECTED = {int: "an integer", float: "a number", parse_bool: "a boolean (1/0, true/false, yes/no, on/off)"}


def env_default(flag_name: str, conv: Any = str, default: Any = None, choices: Optional[tuple] = None,
                expected: Optional[str] = None) -> Any:
    """The default of `--flag-name` from PAGEDMOE_<FLAG_NAME> (empty or unset: `default`), converted by `conv`;
    a value it refuses, or one outside `choices`, is an EnvVarError naming the variable and the expected type."""
    var = _env_name(flag_name)
    text = os.environ.get(var)
    if text is None or text == "":
        return default
    try:
        value = conv(text)
    except (ValueError, TypeError):
        raise EnvVarError(f"environment variable {var}={text!r}: expected "
                          f"{expected or _EXPECTED.get(conv, getattr(conv, '__name__', 'another value'))}") from None
    if choices and value not in choices:
        raise EnvVarError(f"environment variable {var}={text!r}: expected one of {', '.join(map(str, choices))}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """Add one `--flag-name` per EngineConfig field (defaults from PAGEDMOE_* env vars, then the field)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if meta.get("type") is bool:
            default = env_default(f.name, parse_bool, f.default)
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=meta["help"])
            continue
        conv = meta.get("type") or str
        default = env_default(f.name, conv, f.default, meta.get("choices"))
        group.add_argument(flag, type=conv, default=default, choices=meta.get("choices"),
                           help=f"{meta['help']} (env {_env_name(f.name)})")


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return EngineConfig(**values)


def engine_config_from_kwargs(model: Optional[str], **kwargs: Any) -> EngineConfig:
    """For `LLM(model, **flags)`: unknown keywords are an error that lists the known ones."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(names)}")
    return EngineConfig(model=model, **kwargs)


def default_model_path() -> str:
    """The trained default model shipped inside the package (found from the installed package)."""
    from pathlib import Path

    return str(Path(__file__).resolve().parent / "default_model")


def resolve_model(model: Optional[str]) -> str:
    return model if model else default_model_path()
