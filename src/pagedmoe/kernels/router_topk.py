"""Triton router: scores, top-k and renormalisation of one token's experts in one kernel.

Unfused (layers/moe.py) this is softmax, topk, sum, divide: four to six launches per MoE layer. Two
scorings, both in float64 over the router logits of any float dtype (as layers/moe.py scores them: a
float32 sum of exps depends on its order and a float32 exp differs between devices; float64 exps and
sums, rounded to float32 at the end, give the same float32 everywhere but for odds of about 2^-28 a
weight, and the same choice of experts):
  softmax  Mixtral / Qwen / OLMoE (route_softmax_topk): weights = the top-k probabilities, optionally
           divided by their sum;
  sigmoid  GLM-4.5 with n_group == 1 (route_sigmoid_grouped): experts chosen by sigmoid + correction
           bias, weights = the plain sigmoid scores, optionally divided by (their sum + 1e-20), then in
           float32 times the routed scaling factor.
Ids come out in descending order of the choice score, ties the lower id first (layers/moe.py's
topk_lower_id_first). With `counts` (the activity table's row of this layer, experts/activity.py) the kernel
also adds 1 per routed (token, expert) there (float32 atomics of whole numbers: exact in any order), in place
of the index_add launch per MoE layer that would count them. Every op is correctly rounded (float64 division is div.rn.f64 on the GPU) except
exp, which is libdevice's __nv_exp there, the function torch's CUDA exp calls. Reference: the functions in layers/moe.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._attention_checks import next_pow2
from .pdl import launch_args, pdl_enter

MAX_EXPERTS = 256
MAX_TOP_K = 8


@triton.jit
def router_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr, count_rows_ptr,
    num_experts, stride_l, scaling,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, COUNT_ROWS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    mask = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float64)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        choice = scores + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        choice = tl.where(mask, choice, float("-inf"))
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        scores = e / tl.sum(e, axis=0)
        choice = tl.where(mask, scores, float("-inf"))
    offs_k = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], dtype=tl.float64)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        # the lowest id among the maxima (tl.argmax's tie-break is not specified across backends)
        idx = tl.min(tl.where(choice == best, offs, E_PAD), axis=0)
        hit = offs == idx
        w = tl.where(offs_k == i, tl.sum(tl.where(hit, scores, 0.0), axis=0), w)
        ids = tl.where(offs_k == i, idx, ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        total = tl.sum(w, axis=0)
        if SIGMOID:
            total += tl.full([], 1e-20, tl.float64)
        w = w / total
    w = w.to(tl.float32)
    if SIGMOID:
        w = w * scaling
    kmask = offs_k < TOP_K
    tl.store(weights_ptr + t * TOP_K + offs_k, w, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids.to(tl.int64), mask=kmask)
    if COUNT:
        if COUNT_ROWS:  # rows from count_rows[0] on are a CUDA graph's padding: routed, not counted
            kmask = kmask & ((tl.zeros([K_PAD], tl.int64) + t) < tl.load(count_rows_ptr))
        tl.atomic_add(counts_ptr + ids, tl.full([K_PAD], 1.0, tl.float32), mask=kmask)


def router_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax",
    correction_bias: Optional[torch.Tensor] = None, routed_scaling_factor: float = 1.0,
    counts: Optional[torch.Tensor] = None, count_rows: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, top_k], ids int64 [T, top_k]); E <= 256, top_k <= 8.

    scoring "softmax" (no bias, no scaling) or "sigmoid" (correction_bias [E], routed_scaling_factor).
    counts: a contiguous float32 [E] tensor on the logits' device that each routed id adds 1 to; count_rows (an int64
    [1] tensor there): only rows below count_rows[0] are counted (experts/activity.py: a CUDA graph's padding)."""
    if router_logits.dim() != 2 or router_logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"router_logits must be a float [T, E] tensor, got {tuple(router_logits.shape)} "
                         f"{router_logits.dtype}")
    if router_logits.numel() and router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be contiguous in its last dim, got strides {router_logits.stride()}")
    T, E = router_logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"the router kernel takes 1..{MAX_EXPERTS} experts, got {E}")
    if not 1 <= top_k <= min(MAX_TOP_K, E):
        raise ValueError(f"top_k must be in 1..{min(MAX_TOP_K, E)}, got {top_k}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    sigmoid = scoring == "sigmoid"
    if sigmoid:
        if (correction_bias is None or correction_bias.shape != (E,) or correction_bias.dtype != torch.float32
                or not correction_bias.is_contiguous() or correction_bias.device != router_logits.device):
            raise ValueError(f"sigmoid scoring needs a contiguous float32 correction_bias [{E}] on "
                             f"{router_logits.device}")
    elif correction_bias is not None or routed_scaling_factor != 1.0:
        raise ValueError("softmax scoring takes no correction_bias and no routed_scaling_factor")
    if counts is not None and (counts.shape != (E,) or counts.dtype != torch.float32 or not counts.is_contiguous()
                               or counts.device != router_logits.device):
        raise ValueError(f"counts must be a contiguous float32 [{E}] tensor on {router_logits.device}, got "
                         f"{tuple(counts.shape)} {counts.dtype} on {counts.device}")
    if count_rows is not None and (counts is None or count_rows.shape != (1,) or count_rows.dtype != torch.int64
                                   or count_rows.device != router_logits.device):
        raise ValueError("count_rows must be an int64 [1] tensor on the logits' device, beside counts")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    router_topk_kernel[(T,)](
        router_logits, correction_bias if sigmoid else router_logits, weights, ids,
        counts if counts is not None else weights, count_rows if count_rows is not None else ids,
        E, router_logits.stride(0), float(routed_scaling_factor),
        TOP_K=top_k, K_PAD=next_pow2(top_k), E_PAD=max(16, next_pow2(E)),
        SIGMOID=sigmoid, RENORMALIZE=bool(renormalize), COUNT=counts is not None, COUNT_ROWS=count_rows is not None,
        num_warps=1 if E <= 64 else 2, enable_fp_fusion=False, **launch_args(router_logits.device),
    )
    return weights, ids
