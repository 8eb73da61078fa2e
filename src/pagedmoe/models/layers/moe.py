"""Mixture-of-Experts block: router, stacked expert weights, expert GEMMs.

Shapes: T tokens, E experts, A active experts per token, H hidden, I expert intermediate size.
Expert weights are stacked per layer so that one expert is an addressable unit for paging:
  w13 [E, 2I, H]  (gate rows then up rows),   w2 [E, H, I].
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedmoe.experts.interface import TRITON_MAX_TOKENS, ExpertOperand, ExpertsProvider
from pagedmoe.models.layers.linear import Linear
from pagedmoe.models.layers.mlp import GatedMLP
from pagedmoe.planning.kv_sizing import grouped_mm_chunk_tokens


def topk_lower_id_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk over the last dim with ties broken by the lower id, as the fused router kernel does
    (torch.topk orders ties its own way, which differs between CPU and CUDA; bf16 logits tie often)."""
    values, ids = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k].contiguous()


def route_softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Softmax over experts, top-k, optional renormalisation. -> (weights f32 [T, A], ids [T, A]).

    In float64, rounded to float32 at the end (transformers: float32 throughout, within 1 ulp of this):
    a float32 softmax's sum depends on its order and its exp on the device; in float64 those differences
    (and whether the softmax divides or multiplies by 1 / sum) stay below what rounding to float32 shows,
    so the result is the same on CPU, CUDA and in the fused router kernel (kernels/router_topk.py)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float64)
    weights, ids = topk_lower_id_first(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float(), ids


def route_sigmoid_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                          n_group: int, topk_group: int, renormalize: bool, routed_scaling_factor: float):
    """GLM-4.5 / DeepSeek-V3 routing ("noaux_tc"). -> (weights f32 [T, A], ids [T, A]).

    Sigmoid scores; the correction bias only steers the *choice* (the weights are the plain scores).
    Experts split into n_group groups; a group scores the sum of its best two biased scores; only the
    topk_group best groups compete for the top-k. Then optional renormalisation (+1e-20, as transformers)
    and, in float32, the routed scaling factor. Follows transformers' Glm4MoeTopkRouter op for op, but in
    float64 up to the scaling, as route_softmax_topk says why (sigmoid written as 1 / (1 + exp(-x)), the
    ops the fused kernel does).
    """
    scores = (1.0 + torch.exp(-router_logits.double())).reciprocal()        # [T, E]
    choice = scores + correction_bias.double()
    if n_group > 1:
        T, E = choice.shape
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = topk_lower_id_first(choice, top_k)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights.float() * routed_scaling_factor, ids


def route_softmax_grouped(router_logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          renormalize: bool, routed_scaling_factor: float):
    """DeepSeek-V2 routing ("greedy" when n_group == 1, else "group_limited_greedy").
    -> (weights f32 [T, A], ids [T, A]).

    Softmax in float32; a group scores its best expert; experts outside the topk_group best groups
    score 0 (not -inf: transformers' DeepseekV2TopkRouter, op for op); top-k; optional
    renormalisation (norm_topk_prob, +1e-20); times the routed scaling factor.
    """
    scores = torch.softmax(router_logits.float(), dim=-1)                      # [T, E]
    if n_group > 1:
        T, E = scores.shape
        group_scores = scores.view(T, n_group, E // n_group).max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class Float32Gate(nn.Module):
    """Router weight kept in float32 whatever the model dtype, logits in float32 (DeepSeek-V2, and
    the base of SigmoidGroupedGate)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # NOTE: stays float32 whatever dtype the model is cast to (transformers keeps gate.weight and
        # the bias in float32: `_keep_in_fp32_modules_strict`); a bf16 bias would change the top-k.
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class SigmoidGroupedGate(Float32Gate):
    """Router of GLM-4.5 / DeepSeek-V3: float32 logits plus the per-expert `e_score_correction_bias`
    (checkpoint name `mlp.gate.e_score_correction_bias`)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


ROUTERS = ("softmax", "softmax_grouped", "sigmoid_grouped")


def experts_loop(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Reference: one expert at a time (slow, any shape, any dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.where(topk_ids == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


GROUPED_MM_MAX_GROUPS = 1024   # torch._grouped_mm's limit on the number of groups (experts, or cache pages)


def _grouped_mm_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    # grouped_mm needs 16-byte aligned strides and at most GROUPED_MM_MAX_GROUPS groups (a routed-fetch pool
    # of a few thousand pages is more); on CUDA only bf16 is supported.
    if w13.shape[0] > GROUPED_MM_MAX_GROUPS:
        return False
    elem = x.element_size()
    if (w13.shape[-1] * elem) % 16 or (w2.shape[-1] * elem) % 16 or (w2.shape[1] * elem) % 16:
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return hasattr(torch, "_grouped_mm")


def experts_grouped_mm(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """All experts in two grouped GEMMs over tokens sorted by expert, a chunk of tokens at a time
    (planning/kv_sizing.py::grouped_mm_chunk_tokens: whole, 8192 tokens' transients were the step's activation
    peak, which the budget holds out of the KV cache). No host sync."""
    T, A = topk_ids.shape
    step = grouped_mm_chunk_tokens(A, x.shape[1], w2.shape[-1], x.element_size())
    out = torch.empty_like(x)
    for s in range(0, T, step):
        _grouped_mm_chunk(x[s:s + step], w13, w2, topk_weights[s:s + step], topk_ids[s:s + step], out[s:s + step])
    return out


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _triton_epilogues(x: torch.Tensor) -> bool:
    """Whether experts_grouped_mm's activation and combine run as Triton kernels (CUDA, triton installed)."""
    return x.is_cuda and _HAS_TRITON


def _narrow_sort_key(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The expert ids in the narrowest integer type that holds [0, E): a radix sort (CUDA's argsort) makes one
    pass per key byte, so uint8 ids (E <= 256) sort in one pass instead of int64's eight; a stable sort gives the
    same order whatever the type."""
    if num_experts <= 256:
        return ids.to(torch.uint8)
    return ids.to(torch.int16) if num_experts <= 2 ** 15 else ids


# The grouped path's Triton passes over the routed rows (copies and fixed-order sums: the tile changes the speed,
# not a bit). At 8192 tokens of Qwen3-30B-A3B on the H100 (bench_prefill_moe.py, benchmarks/results/session33) the
# gather took 115.7-118.4 us against torch's x[order // A] 161.5-164.1, the combine 101.8-105.9 against the default
# tile's 120.4-123.9, silu_mul 100.9-102.2 against 103.7-106.0: ~3 ms of a 118-124 ms prefill step.
GROUPED_TILES = {"gather": dict(block_r=16, block_h=256, num_warps=4),
                 "silu": dict(block_m=2, block_i=1024, num_warps=4),
                 "sum": dict(block_t=1, block_h=2048, num_warps=8)}


def _grouped_mm_chunk(x, w13, w2, topk_weights, topk_ids, out) -> None:
    """out = the routed experts of x's tokens. On CUDA the activation (fp32 silu(gate) * up, one rounding) and
    the combine (per token, a fixed-order fp32 sum of its slots' rows read through the inverse permutation, no
    atomics: deterministic) are Triton kernels; elsewhere eager torch with a float32 index_add_."""
    T, A = topk_ids.shape
    E = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    keys, order = torch.sort(_narrow_sort_key(flat_ids, E), stable=True)
    # each expert's end row in the sorted order, from the sorted keys themselves: one launch where counting took
    # three (zeros, scatter_add, cumsum), and no host sync (bincount sizes its output from the data)
    offs = torch.searchsorted(keys, torch.arange(E, device=x.device, dtype=keys.dtype), right=True, out_int32=True)
    # NOTE: each transient is dropped as soon as the next is made (grouped_mm_row_bytes counts what overlaps)
    fused = _triton_epilogues(x)
    if fused:
        from pagedmoe.kernels.fused_moe import gather_rows, moe_sum, silu_mul
    # x[order // A]: on CUDA in one launch (gather_rows takes rows with a unit column stride)
    xs = gather_rows(x, order, A, **GROUPED_TILES["gather"]) if fused and x.stride(1) == 1 else x[order // A]
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)    # [T*A, 2I]
    del xs
    if fused:
        h = silu_mul(gate_up, **GROUPED_TILES["silu"])                 # [T*A, I]
        del gate_up
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        del gate_up, gate, up
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)            # [T*A, H], rows in expert order
    del h
    if fused:
        slot_row = torch.empty_like(order)
        slot_row[order] = torch.arange(order.numel(), device=order.device)   # y's row of slot t * A + k
        moe_sum(y.unsqueeze(0), topk_weights, topk_ids, out, 1, E, rows=slot_row, **GROUPED_TILES["sum"])
        return
    y = y.float().mul_(topk_weights.reshape(-1)[order, None])
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    acc.index_add_(0, order // A, y)
    out.copy_(acc)


def experts_triton(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Triton kernels that stream each touched expert's weights once (kernels/fused_moe.py). No host sync."""
    from pagedmoe.kernels.fused_moe import fused_moe  # lazy: triton is optional on CPU-only installs

    return fused_moe(x, w13, w2, topk_weights, topk_ids)


def sync_free(experts_fn: Callable, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether this expert path runs without host syncs (a requirement for CUDA-graph capture)."""
    if experts_fn is experts_grouped_mm or experts_fn is experts_triton:
        return True
    # auto: Triton for small batches (sync-free), grouped_mm or the loop above that.
    return experts_fn is experts_auto and (_grouped_mm_ok(x, w13, w2) or _auto_triton(x, w13, w2))


def _auto_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """experts_auto's rule: Triton on CUDA in half precision for small batches, and for any batch that
    grouped_mm cannot take (more than GROUPED_MM_MAX_GROUPS experts)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and (x.shape[0] <= TRITON_MAX_TOKENS or not _grouped_mm_ok(x, w13, w2)))


def experts_auto(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    if _auto_triton(x, w13, w2):
        return experts_triton(x, w13, w2, topk_weights, topk_ids)
    fn = experts_grouped_mm if _grouped_mm_ok(x, w13, w2) else experts_loop
    return fn(x, w13, w2, topk_weights, topk_ids)


def _triton_path(experts_fn: Callable, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `experts_fn` runs the Triton kernels for `x` (experts_auto's rule, or triton asked for)."""
    if experts_fn is experts_triton:
        return True
    return experts_fn is experts_auto and _auto_triton(x, w13, w2)


MOE_BACKENDS: dict[str, Callable] = {
    "auto": experts_auto,
    "grouped_mm": experts_grouped_mm,
    "loop": experts_loop,
    "triton": experts_triton,
}


class FusedMoE(nn.Module):
    """Router + routed experts (+ optional shared expert).

    Shared experts come in two kinds: Qwen2-MoE's `shared_expert` behind a sigmoid gate, and
    GLM-4.5 / DeepSeek's `shared_experts` added without one (shared_expert_name names the module as
    in the checkpoint). Routers: "softmax" (softmax top-k, optional renormalisation),
    "softmax_grouped" (route_softmax_grouped, DeepSeek-V2) and "sigmoid_grouped" (route_sigmoid_grouped).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, moe_idx: int, shared_intermediate_size: int = 0,
                 shared_expert_gate: bool = False, router: str = "softmax", n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 shared_expert_name: str = "shared_expert", experts: Optional[ExpertsProvider] = None,
                 ep_size: int = 1, ep_rank: int = 0) -> None:
        """`num_experts`: the experts this rank holds; with expert parallelism (ep_size > 1) the router
        chooses among num_experts * ep_size and this rank computes those of ids [ep_rank * num_experts,
        (ep_rank + 1) * num_experts) (the decoder layer's all-reduce combines the ranks)."""
        super().__init__()
        self.num_local_experts, self.ep_size, self.ep_rank = num_experts, ep_size, ep_rank
        num_experts *= ep_size
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        if router != "softmax" and n_group > 1:
            if num_experts % n_group or num_experts // n_group < 2 or not 1 <= topk_group <= n_group:
                raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not fit {num_experts} "
                                 f"experts (groups of >= 2 experts, 1 <= topk_group <= n_group)")
            if topk_group * (num_experts // n_group) < top_k:
                raise ValueError(f"topk_group {topk_group} groups hold fewer than top_k {top_k} experts")
        self.moe_idx = moe_idx  # index among the MoE layers: the expert table's layer index
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.router, self.n_group, self.topk_group = router, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        if router == "softmax":
            self.gate = Linear(hidden_size, num_experts, bias=False)  # --backbone-gemm (layers/linear.py)
        elif router == "softmax_grouped":
            self.gate = Float32Gate(hidden_size, num_experts)
        else:
            self.gate = SigmoidGroupedGate(hidden_size, num_experts)
        self.shared_expert_name: Optional[str] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if shared_intermediate_size:
            self.shared_expert_name = shared_expert_name
            self.add_module(shared_expert_name, GatedMLP(hidden_size, shared_intermediate_size))
            if shared_expert_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.experts_fn: Callable = experts_auto
        # The experts object the model was built with (experts/interface.py: resident provider or pager).
        self.experts = experts
        self.fused_router = False  # --fused-ops (layers/fused_ops.py) sets it where the kernel fits

    def shared_mlp(self) -> Optional[GatedMLP]:
        return None if self.shared_expert_name is None else self._modules[self.shared_expert_name]

    def route(self, x: torch.Tensor, counts: Optional[torch.Tensor] = None,
              count_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights f32 [T, A], ids [T, A]). `counts` (fused router only): the activity table's
        row of this layer, which the kernel adds the routed ids of the rows below count_rows[0] to."""
        if self.fused_router:  # --fused-ops: one Triton kernel (kernels/router_topk.py, layers/fused_ops.py)
            from pagedmoe.kernels.router_topk import router_topk

            if self.router == "softmax":
                return router_topk(self.gate(x), self.top_k, self.renormalize, counts=counts, count_rows=count_rows)
            return router_topk(self.gate(x), self.top_k, self.renormalize, "sigmoid",
                               self.gate.e_score_correction_bias, self.routed_scaling_factor, counts=counts,
                               count_rows=count_rows)
        if self.router == "softmax":
            return route_softmax_topk(self.gate(x), self.top_k, self.renormalize)
        if self.router == "softmax_grouped":
            return route_softmax_grouped(self.gate(x), self.top_k, self.n_group, self.topk_group,
                                         self.renormalize, self.routed_scaling_factor)
        return route_sigmoid_grouped(self.gate(x), self.gate.e_score_correction_bias, self.top_k,
                                     self.n_group, self.topk_group, self.renormalize,
                                     self.routed_scaling_factor)

    def run_experts(self, x: torch.Tensor, operand: ExpertOperand, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' GEMMs over the operand the experts object handed out (by its kind)."""
        if operand.kind == "dense":
            if operand.slots is not None:  # routed fetching: the expert cache's pool, indexed by page
                if _triton_path(self.experts_fn, x, operand.w13, operand.w2):
                    # the slot-map kernel: tiles chosen for the layer's E experts, as resident placement's
                    from pagedmoe.kernels.fused_moe import fused_moe_mixed

                    return fused_moe_mixed(x, [(operand.w13, operand.w2, operand.slots)], self.num_experts,
                                           topk_weights, topk_ids)
                topk_ids = operand.slots[topk_ids].long()   # one gather on the device, no sync
            return self.experts_fn(x, operand.w13, operand.w2, topk_weights, topk_ids)
        # --quantized-gemm direct: the Triton kernels read the quantized weights (triton: optional package)
        from pagedmoe.kernels.fused_moe import fused_moe_mixed, fused_moe_quantized

        if operand.kind == "mixed":  # dynamic precision: (w13, w2, slots) per precision group
            return fused_moe_mixed(x, operand.parts, self.num_local_experts, topk_weights, topk_ids)
        # static precision: every expert of the layer quantized, in id order
        return fused_moe_quantized(x, operand.w13, operand.w2, self.num_local_experts, topk_weights, topk_ids)

    def local_routes(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """Expert parallel: the routes to this rank's experts, in its local ids; a route to another rank's
        expert keeps weight 0 on local expert 0 (shapes stay fixed: no host sync, graph-capturable), and the
        mask of the rank's own routes. Every rank already holds every token (attention is tensor-parallel),
        so the dispatch is this mask and the combine is the decoder layer's all-reduce: at decode batch sizes
        it moves the same bytes as an all-to-all pair and needs no token counts exchanged."""
        local = topk_ids - self.ep_rank * self.num_local_experts
        own = (local >= 0) & (local < self.num_local_experts)
        return topk_weights * own, torch.where(own, local, torch.zeros_like(local)), own

    def _drops_unrouted(self, operand: ExpertOperand, x: torch.Tensor) -> bool:
        """Whether the GEMMs run_experts takes for this operand skip ids outside [0, E) (the Triton kernels:
        moe_align leaves them out, moe_sum masks them), so that another rank's routes cost nothing here."""
        return operand.kind != "dense" or _triton_path(self.experts_fn, x, operand.w13, operand.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        if experts is None:
            raise RuntimeError("this model was built without experts (engine/startup.py builds them)")
        # the fused router counts the routed ids into the activity table itself (one launch a layer fewer);
        # with expert parallelism the table counts this rank's local ids, which only local_routes gives
        activity = getattr(experts, "activity", None)
        counts = (activity.step_counts[self.moe_idx] if self.fused_router and self.ep_size == 1
                  and activity is not None else None)
        topk_weights, topk_ids = self.route(x, counts, None if counts is None else activity.counted_rows)
        own = None
        if self.ep_size > 1:
            topk_weights, topk_ids, own = self.local_routes(topk_weights, topk_ids)
        # NOTE: the router's ids go to the experts object as a device tensor (no host sync)
        operand = experts.weights(self.moe_idx, topk_ids, counted=counts is not None)
        predict = getattr(experts, "predict", None)   # routed fetching: prefetch the next layer's experts
        if predict is not None:
            predict(self.moe_idx, x)
        if own is not None and self._drops_unrouted(operand, x):
            # the other ranks' routes as -1: the Triton GEMMs skip them instead of running them on local expert
            # 0 at weight 0 (which cost a whole expert's GEMM over up to (N-1)/N of the routes, every layer)
            topk_ids = torch.where(own, topk_ids, torch.full_like(topk_ids, -1))
        out = self.run_experts(x, operand, topk_weights, topk_ids)
        experts.done(self.moe_idx)
        if self.shared_expert_name is not None:
            shared = self.shared_mlp()(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
