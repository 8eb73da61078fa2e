"""Floors of a decode step: the bytes it must move over the HBM bandwidth, and FLOPs over the GEMM rate.

Defaults are the H200 ceilings measured in shared/H200.md; the benchmarks re-measure HBM bandwidth on
the machine they run on and pass it in.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedmoe.planning.cost_model import H200, expected_distinct_experts

H200_HBM_BYTES_PER_S = H200.hbm_bytes_per_s   # device-to-device copy, bytes read + written


@dataclass(frozen=True)
class DecodeStepBytes:
    expert_bytes: float
    backbone_bytes: float
    kv_bytes: float

    @property
    def total(self) -> float:
        return self.expert_bytes + self.backbone_bytes + self.kv_bytes


def decode_step_bytes(dims, dtype_bytes: int, batch: int, context: int, num_moe_layers: int,
                      num_dense_layers: int = 0, shared_intermediate: int = 0) -> DecodeStepBytes:
    """Bytes one decode step of `batch` sequences at `context` tokens must read from HBM."""
    H, I, E = dims.hidden_size, dims.moe_intermediate_size, dims.num_experts
    per_expert = 3 * H * I * dtype_bytes
    experts = num_moe_layers * expected_distinct_experts(E, dims.top_k, batch) * per_expert
    attn = H * dims.head_dim * (2 * dims.num_heads + 2 * dims.num_kv_heads) * dtype_bytes
    router = E * H * dtype_bytes
    shared = 3 * H * shared_intermediate * dtype_bytes
    dense = 3 * H * dims.dense_intermediate_size * dtype_bytes
    backbone = (dims.num_layers * attn + num_moe_layers * (router + shared) + num_dense_layers * dense
                + dims.vocab_size * H * dtype_bytes)   # lm_head; embeddings read only B rows
    kv = batch * context * 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * dtype_bytes
    return DecodeStepBytes(experts, backbone, kv)


def measure_hbm_bandwidth(num_bytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of `iters`."""
    import torch

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times = sorted(times[3:])
    del src, dst
    return 2 * num_bytes / times[len(times) // 2]
