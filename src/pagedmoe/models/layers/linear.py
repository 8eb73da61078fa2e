"""The backbone's linear layers and their decode-size GEMM switch (``--backbone-gemm auto|triton|torch``).

`Linear` is nn.Linear (same parameters, same checkpoint names) whose forwards of at most MAX_TOKENS rows
can run kernels/small_gemm.py instead of cuBLAS: at decode sizes a linear layer is a read of its weight,
and cuBLAS's M=1 kernels read it at about 35% of the H200's HBM bandwidth (issue 25). The attention q/k/v/o
projections (MLA's too, but kv_b_proj, whose weight its decode reads directly), the softmax router's gate
and the lm_head are built from it; the float32 routers of layers/moe.py and the dense / shared-expert MLPs
stay nn.Linear. Larger forwards (prefill) keep F.linear. In every mode each attention layer's q/k/v weights
become row slices of one buffer (Attention.fuse_qkv): one launch, cuBLAS's or the kernel's, computes all three.

auto runs the kernel for the MoE routers' gates only, on CUDA with triton installed:
benchmarks/bench_small_gemm.py measured it faster than F.linear there at batch 1 on the H200 (CUDA-graph
replays: Qwen3-30B-A3B's [128, 2048] 4.44 against 5.36 us, Mixtral-8x7B's [8, 4096] 4.10 against 5.78), and
slower or even on the fused q/k/v, o and lm_head. triton runs it for every backbone linear and fails loudly
where Triton cannot run.
"""
from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedmoe.models.layers.fused_ops import require_triton

logger = logging.getLogger(__name__)

BACKBONE_GEMM_MODES = ("auto", "triton", "torch")
MAX_TOKENS = 16  # kernels/small_gemm.py's MAX_M (tests/models/test_backbone_gemm_model.py checks they agree)
GEMM_SCOPES = ("none", "routers", "all")  # which linears run the kernel (resolve_backbone_gemm)


class Linear(nn.Linear):
    """nn.Linear; with `small_gemm` set (apply_backbone_gemm), 1..MAX_TOKENS rows run the Triton kernel."""

    small_gemm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: x.shape is host metadata: choosing the path reads no device value (CUDA-graph safe)
        if self.small_gemm and x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS:
            from pagedmoe.kernels.small_gemm import small_gemm

            return small_gemm(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def resolve_backbone_gemm(mode: str, device: torch.device) -> str:
    """Which backbone linears' decode-size forwards run kernels/small_gemm.py: one of GEMM_SCOPES."""
    if mode not in BACKBONE_GEMM_MODES:
        raise ValueError(f"backbone_gemm must be one of {', '.join(BACKBONE_GEMM_MODES)}; got {mode!r}")
    if mode == "torch":
        return "none"
    if mode == "auto":
        return "routers" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "none"
    require_triton("--backbone-gemm triton", device)
    return "all"


def apply_backbone_gemm(model: nn.Module, scope: str) -> int:
    """Switch the backbone `Linear`s in scope (GEMM_SCOPES) to the kernel, the others to F.linear; the q/k/v
    weights are one buffer already (models/loader.py::build_model: Attention.fuse_qkv, one launch either way).
    Returns how many linears run the kernel."""
    if scope not in GEMM_SCOPES:
        raise ValueError(f"backbone GEMM scope must be one of {GEMM_SCOPES}, got {scope!r}")
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    routers = {id(moe.gate) for moe in model.moe_layers()} if scope == "routers" else set()
    for layer in layers:
        layer.small_gemm = scope == "all" or id(layer) in routers
    on = sum(layer.small_gemm for layer in layers)
    if on:
        logger.info("backbone GEMM: %d of %d linear layers run the Triton small-batch kernel at <= %d tokens",
                    on, len(layers), MAX_TOKENS)
    return on
