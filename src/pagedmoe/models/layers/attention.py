"""Self-attention over the paged KV cache, and the registry of attention backends.

Shapes: T tokens in the step, B sequences, Hq query heads, Hkv KV heads, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedmoe.kernels.attention_ref import paged_attention_ref, write_kv_ref
from pagedmoe.models.layers.linear import MAX_TOKENS, Linear
from pagedmoe.models.layers.norm import RMSNorm
from pagedmoe.models.layers.rotary import RotaryEmbedding
from pagedmoe.parallel.state import get_state


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer (layout in kernels/attention_ref.py)."""

    slot_mapping: torch.Tensor      # [T] int64, device
    query_start_loc: torch.Tensor   # [B + 1] int32, device
    seq_lens: torch.Tensor          # [B] int32, device
    block_tables: torch.Tensor      # [B, max_blocks] int32, device
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool
    query_start_loc_cpu: torch.Tensor  # host copies: the torch path reads them without a device sync
    seq_lens_cpu: torch.Tensor
    # every sequence is a whole prompt from position 0 (no cached context): a fresh prefill, whose keys are all
    # this step's own (kernels/paged_attention.py may then run torch's fused attention over them)
    fresh: bool = False


class TorchAttentionBackend:
    """Reference path: runs anywhere, one sequence at a time."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over caches that already hold this step's k, v (the fused q/k rope kernel wrote them)."""
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc_cpu,
                                   meta.seq_lens_cpu, scale)


def _triton_backend():
    from pagedmoe.kernels.paged_attention import TritonAttentionBackend
    return TritonAttentionBackend()


ATTENTION_BACKENDS: dict[str, Callable[[], object]] = {
    "torch": TorchAttentionBackend,
    "triton": _triton_backend,
}


def make_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
    if name == "triton" and device.type != "cuda":
        raise ValueError("attention backend 'triton' needs a CUDA device")
    return ATTENTION_BACKENDS[name]()


def _share_rows(layers, name: str) -> torch.Tensor:
    """Concatenate the layers' `name` parameters by rows into one tensor and make each parameter a view of
    its rows (same values, same names; the old storage is freed)."""
    with torch.no_grad():
        whole = torch.cat([getattr(layer, name) for layer in layers])
        start = 0
        for layer in layers:
            n = getattr(layer, name).shape[0]
            setattr(layer, name, nn.Parameter(whole[start:start + n], requires_grad=False))
            start += n
    return whole


class Attention(nn.Module):
    """q/k/v projections (optional bias), optional q/k RMSNorm (per head or over all heads), RoPE,
    KV-cache write and paged attention, output projection."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, qkv_bias: bool = False, qk_norm: Optional[str] = None,
                 rms_norm_eps: float = 1e-6, clip_qkv: Optional[float] = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # Linear: nn.Linear with --backbone-gemm's decode-size kernel (layers/linear.py)
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm == "head":    # Qwen3: over each head's D
            self.q_norm = RMSNorm(head_dim, rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        elif qk_norm == "full":  # OLMoE: over the whole projection (split over the tensor-parallel ranks)
            shards = get_state().world_size
            self.q_norm = RMSNorm(num_heads * head_dim, rms_norm_eps, shards)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, rms_norm_eps, shards)
        elif qk_norm is not None:
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")
        self.clip_qkv = clip_qkv
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        # Bound by the model runner once the cache exists.
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.backend = None
        # --fused-ops (layers/fused_ops.py): q/k norm + RoPE + KV write in one kernel
        self.fused_qk_rope = False
        # fuse_qkv (models/loader.py::build_model, before loading): the q/k/v weights' one buffer, one GEMM launch
        self.qkv_weight: Optional[torch.Tensor] = None
        self.qkv_bias: Optional[torch.Tensor] = None

    def fuse_qkv(self) -> None:
        """Make the q/k/v weights (and biases) row slices of one [Nq + 2 Nkv, H] buffer, so a step's three
        projections are one GEMM launch (two fewer per layer; the k and v ones alone are too small to fill the
        GPU: on the H200 at batch 1 cuBLAS takes 8.2 µs for Qwen3's fused [5120, 2048] against 18.2 for the
        three, benchmarks/bench_small_gemm.py). The parameters keep their names and values; idempotent."""
        if self.qkv_weight is not None:
            return
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _share_rows(projs, "weight")
        self.qkv_bias = _share_rows(projs, "bias") if self.q_proj.bias is not None else None

    def can_fuse_qk_rope(self) -> bool:
        """Whether kernels/qk_norm_rope.py computes exactly this layer's q/k path."""
        return self.qk_norm in (None, "head") and self.clip_qkv is None and not self.rotary.interleaved

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if self.qkv_weight is not None:
            if self.q_proj.small_gemm and 0 < T <= MAX_TOKENS:
                from pagedmoe.kernels.small_gemm import small_gemm

                qkv = small_gemm(x, self.qkv_weight, self.qkv_bias)
            else:
                qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
            # q, k, v: column slices of one [T, Nq + 2 Nkv] output (the kernels downstream take row strides)
            q, k, v = qkv.split([self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features],
                                dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.fused_qk_rope:
            from pagedmoe.kernels.qk_norm_rope import qk_norm_rope_kv

            head = self.qk_norm == "head"
            q = qk_norm_rope_kv(q, k, v, self.rotary.cos_sin, positions, self.q_norm.weight if head else None,
                                self.k_norm.weight if head else None, self.q_norm.eps if head else 0.0,
                                self.k_cache, self.v_cache, meta.slot_mapping, q_out=q)
            out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale)
            return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))
