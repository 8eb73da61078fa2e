"""The registry switch of the decode step's fused small ops (``--fused-ops auto|on|off``).

Three Triton kernels replace chains of small torch ops in every layer:
  residual_norm  residual add + RMSNorm (kernels/fused_norm.py): every decoder layer, the final norm
  qk_rope_kv     per-head q/k RMSNorm + RoPE + paged KV write (kernels/qk_norm_rope.py): attention
                 layers with no q/k norm or a per-head one, half-split rope (full or partial), no qkv
                 clipping (not MLA, not OLMoE's whole-projection norm)
  router         softmax or sigmoid scores + top-k + renormalisation (kernels/router_topk.py): the
                 "softmax" router, and "sigmoid_grouped" with n_group == 1 (GLM-4.5), E <= 256, top_k <= 8
Outputs equal the unfused path's bit for bit: the kernels round where the torch ops round, and the
norm's mean of squares and the router's scores are float64 in both paths (layers/norm.py, layers/moe.py
say why). Layers a kernel cannot take keep the torch path.

auto is on on CUDA with triton installed (off elsewhere): measured on the H200 (Qwen3-30B-A3B shape, resident,
dummy bf16, profile_step.py at 449de78) the decode step is 6.19 ms at batch 1 with them against 14.36 ms without
(2033 small elementwise launches per step fewer), and 29.5 against 41.6 ms at batch 256 (docs/benchmarks.md).
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

FUSED_OPS_MODES = ("auto", "on", "off")


def resolve_fused_ops(mode: str, device: torch.device) -> bool:
    """Whether the fused kernels run. `on` fails loudly where Triton cannot run."""
    if mode not in FUSED_OPS_MODES:
        raise ValueError(f"fused_ops must be one of {', '.join(FUSED_OPS_MODES)}; got {mode!r}")
    if mode == "off":
        return False
    if mode == "auto":  # on where they were measured faster: CUDA, with triton installed
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    require_triton("--fused-ops on", device)
    return True


def require_triton(flag: str, device: torch.device) -> None:
    """A flag that runs Triton kernels fails loudly where they cannot run (also --backbone-gemm triton)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{flag} runs Triton kernels: it needs a CUDA device (or TRITON_INTERPRET=1, "
                         "the interpreter the CPU tests use)")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{flag} needs triton installed") from e


def apply_fused_ops(model, enabled: bool) -> list[str]:
    """Switch the model's layers to the fused kernels (or back). Returns what is fused, for the log."""
    model.fused_residual_norm = enabled
    fused = ["residual_norm"] if enabled else []
    attn_layers = [a for a in model.attention_layers() if hasattr(a, "can_fuse_qk_rope")]
    for attn in attn_layers:
        attn.fused_qk_rope = enabled and attn.can_fuse_qk_rope()
    if any(a.fused_qk_rope for a in attn_layers):
        fused.append("qk_rope_kv")
    moes = model.moe_layers()
    if enabled:  # the kernels' module imports triton, which the base install (CPU, no GPU extra) lacks
        from pagedmoe.kernels.router_topk import MAX_EXPERTS, MAX_TOP_K
    for moe in moes:
        router_ok = moe.router == "softmax" or (moe.router == "sigmoid_grouped" and moe.n_group == 1)
        moe.fused_router = (enabled and router_ok and moe.num_experts <= MAX_EXPERTS
                            and moe.top_k <= MAX_TOP_K)
    if any(m.fused_router for m in moes):
        fused.append("router")
    if enabled:
        logger.info("fused ops on: %s", ", ".join(fused))
    return fused
