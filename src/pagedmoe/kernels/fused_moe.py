"""Triton MoE expert GEMMs for decode-sized batches: each touched expert's weights are streamed once.

Shapes: T tokens, E experts, A active experts per token, H hidden, I expert intermediate size,
N = T * A slots (one per (token, k), flat index t * A + k), S split-K partitions of the w2 GEMM.
  x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, A] float;
  topk_ids [T, A] int. Weights take any strides with a unit last stride: experts/layout.py hands
  out views into packed per-expert rows (expert stride >= 3IH), never contiguous [E, ...] tensors.

At decode sizes (N / E ~ 1-16 rows per expert) the expert GEMMs read ~6IH bytes per touched expert
for a few FLOPs per byte: they are weight streaming, so the tiles are chosen for enough programs in
flight and wide loads, not for MMA shape. After moe_align (slots sorted by expert, padded per expert
to BLOCK_M rows, one launch), three launches:
  1. fused_moe_kernel, GATED: program (block of BLOCK_M slots of one expert, BLOCK_N columns of I)
     computes the gate and up GEMMs for the same rows and writes h = silu(gate) * up [N, I].
  2. fused_moe_kernel, not GATED: program (block, BLOCK_N columns of H, split of I) computes
     h @ w2[e]^T over its part of I and writes y [S, N, H] (fp32 when S > 1).
  3. moe_sum_kernel: out[t] = sum_k w[t, k] * sum_s y[s, t * A + k], in a fixed order (deterministic,
     no atomics: resident and paged runs stay bit-identical).
The block index varies fastest over program ids, so the blocks of one expert that read the same
weight tile run side by side and all but the first read it from L2.
Accumulation is fp32; h is rounded to the input dtype before the w2 GEMM, as the reference does.
Reference: ``pagedmoe.models.layers.moe.experts_loop``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._attention_checks import check_float, check_index, check_same_device, dot_precision
from .device_info import sm_count
from .fused_moe_tiles import acc_zeros, block_rows, mma, slot_block_rows, store_block, weight_tile
from .fused_moe_config import FusedMoEConfig, check_moe_args, choose_split_k, default_config, expected_blocks
from .fused_moe_tuned import tuned_config
from .moe_align import moe_align
from .pdl import launch_args, pdl_enter
from pagedmoe.codecs.quant import INT4_GROUP, QuantizedTensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# moe_sum tile: 8 tokens x 512 columns; fixed, so one compile serves every batch size.
SUM_BLOCK_T, SUM_BLOCK_H = 8, 512
# silu_mul tile (grouped_mm's activation): 8 rows x 512 columns, fixed likewise.
SILU_BLOCK_M, SILU_BLOCK_I = 8, 512
# Steps of at most this many tokens skip moe_align: each slot is its own block (fused_moe_kernel's SLOT_BLOCKS; one
# token's top-k experts are distinct, so this is moe_align's layout in another block order). At batch 1 on the
# H200 moe_align took 5.0 us a layer for Qwen3-30B-A3B (0.241 ms of a 4.36 ms step) and 2.6 us for Mixtral-8x7B.
SLOT_BLOCKS_MAX_TOKENS = 1
# gather_rows tile (grouped_mm's token rows in expert order): 8 rows x 512 columns until measured otherwise.
GATHER_BLOCK_R, GATHER_BLOCK_H = 8, 512


# Sizes that change with the batch are not specialised on (=1, %16): one compile serves every
# batch bucket; strides, N, K and k_per_split keep their divisibility hints (16-byte loads).
@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def fused_moe_kernel(
    a_ptr, w_ptr, out_ptr, sorted_slots_ptr, block_expert_ptr, ws_ptr, slot_ptr,
    num_slots, num_blocks, N, K, k_per_split,
    stride_a, stride_we, stride_wn, stride_os, stride_om, stride_se, stride_sn, num_experts,
    TOP_K: tl.constexpr, GATED: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr = 0, GROUP: tl.constexpr = 128, USE_SLOTS: tl.constexpr = False,
    SLOT_BLOCKS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """out[slot, n] (+ split offset) = act(a[slot // TOP_K, k-range] @ w[e, n, k-range]^T) for one block.

    GATED: w rows n (gate) and N + n (up), output silu(gate) * up. Not GATED: plain product of one
    split of K, for moe_sum_kernel to add up. QUANT (see weight_tile): w holds quantized values (int4:
    bytes, stride_wn counted in bytes) and ws_ptr their float32 scales (stride_se per expert, stride_sn
    per output row); the tiles are dequantized in registers, not through a bf16 copy in memory.
    USE_SLOTS: w holds only some experts (one precision group of a mixed layer); slot_ptr [E] gives each
    expert's index in w, or -1 for an expert of another group, whose blocks this launch skips.
    SLOT_BLOCKS (one token, no moe_align): block p is slot p alone, block_expert_ptr the flat routing ids (any id
    outside [0, num_experts) skips its block); the same rows and sums as the sorted blocks of that token.
    """
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pid_m = pid % num_blocks
    pid_n = pid // num_blocks
    pid_k = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if SLOT_BLOCKS:
        if (expert < 0) | (expert >= num_experts):  # a route moe_align would have dropped
            return
    elif expert < 0:  # past the last used block (the grid is sized by a bound, not by the routing)
        return
    if USE_SLOTS:
        expert = tl.load(slot_ptr + expert)
        if expert < 0:  # another precision group's expert: its own launch computes these rows
            return

    if SLOT_BLOCKS:
        slots, m_mask, a_rows, offs_n, n_mask = slot_block_rows(pid_m, pid_n, num_slots, N, TOP_K, BLOCK_M, BLOCK_N,
                                                                EVEN_N)
    else:
        slots, m_mask, a_rows, offs_n, n_mask = block_rows(sorted_slots_ptr, pid_m, pid_n, num_slots, N, TOP_K,
                                                            BLOCK_M, BLOCK_N, EVEN_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_a + (k_start + offs_k)[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    offs_kh = tl.arange(0, BLOCK_K // 2)
    if QUANT == 2:  # two K positions per byte: the tile's BLOCK_K / 2 bytes (k_start is even)
        wg_ptrs = w_base + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start // 2 + offs_kh)[None, :]
    else:
        wg_ptrs = w_base + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
    wu_ptrs = wg_ptrs + N * stride_wn
    sg_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
    su_ptrs = sg_ptrs + N * stride_sn
    acc_g = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:  # a constant-true mask keeps the K direction unmasked (16-byte loads)
            k_mask = tl.full([BLOCK_K], 1, tl.int1)
        else:
            k_mask = (k0 + offs_k) < k_end
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANT == 2:  # by byte: the byte of K positions 2j, 2j + 1 loads when 2j is in range
            w_mask = n_mask[:, None] & ((k0 + 2 * offs_kh) < k_end)[None, :]
        else:
            w_mask = n_mask[:, None] & k_mask[None, :]
        wg = weight_tile(wg_ptrs, sg_ptrs, k0, w_mask, n_mask, a_ptr, QUANT, GROUP, BLOCK_K)
        acc_g = mma(acc_g, wg, a, SWAP_AB, DOT_PRECISION)
        w_step = BLOCK_K // 2 if QUANT == 2 else BLOCK_K
        if GATED:
            wu = weight_tile(wu_ptrs, su_ptrs, k0, w_mask, n_mask, a_ptr, QUANT, GROUP, BLOCK_K)
            acc_u = mma(acc_u, wu, a, SWAP_AB, DOT_PRECISION)
            wu_ptrs += w_step
        a_ptrs += BLOCK_K
        wg_ptrs += w_step

    store_block(acc_g, acc_u, out_ptr, pid_k, stride_os, stride_om, slots, offs_n, m_mask, n_mask, GATED, SWAP_AB)


@triton.jit
def _slot_sum(y_ptr, weights_ptr, ids_ptr, row_ptr, rows, k, offs_h, t_mask, h_mask, num_splits, num_experts,
              stride_ys, stride_ym, stride_wt, stride_it,
              TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PERMUTED: tl.constexpr,
              ONE_SPLIT: tl.constexpr):
    """w[t, k] * sum_s y[s, r, h] for slot k of the tile's tokens (moe_sum_kernel's term, float32)."""
    ids = tl.load(ids_ptr + rows * stride_it + k, mask=t_mask, other=-1)
    # NOTE: slots routed outside [0, E) were never computed (moe_align drops them): their y rows
    # are garbage, so they are masked out here, not multiplied by zero.
    valid = t_mask & (ids >= 0) & (ids < num_experts)
    w = tl.load(weights_ptr + rows * stride_wt + k, mask=valid, other=0.0).to(tl.float32)
    y_rows = rows * TOP_K + k
    if PERMUTED:
        y_rows = tl.load(row_ptr + y_rows, mask=t_mask, other=0).to(tl.int64)
    ptrs = y_ptr + y_rows[:, None] * stride_ym + offs_h[None, :]
    if ONE_SPLIT:
        part = tl.load(ptrs, mask=valid[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
    else:
        part = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for _ in range(num_splits):
            part += tl.load(ptrs, mask=valid[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
            ptrs += stride_ys
    return w[:, None] * part


@triton.jit(do_not_specialize=["T", "num_splits"])
def moe_sum_kernel(
    y_ptr, weights_ptr, ids_ptr, out_ptr, row_ptr,
    T, H, num_splits, num_experts,
    stride_ys, stride_ym, stride_wt, stride_it, stride_ot,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PERMUTED: tl.constexpr,
    PDL: tl.constexpr = False, ONE_SPLIT: tl.constexpr = False, UNROLL: tl.constexpr = False,
):
    """out[t, h] = sum_k w[t, k] * sum_s y[s, r, h] over a [BLOCK_T, BLOCK_H] tile, r = t * TOP_K + k, or
    when PERMUTED r = row[t * TOP_K + k] (y's rows in another order, e.g. sorted by expert). ONE_SPLIT: S = 1
    (no loop over splits); UNROLL: the k loop unrolled (its loads in flight together), same order, same sums."""
    pdl_enter(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = offs_t < T
    h_mask = offs_h < H
    rows = offs_t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    if UNROLL:
        for k in tl.static_range(TOP_K):
            acc += _slot_sum(y_ptr, weights_ptr, ids_ptr, row_ptr, rows, k, offs_h, t_mask, h_mask, num_splits,
                             num_experts, stride_ys, stride_ym, stride_wt, stride_it,
                             TOP_K, BLOCK_T, BLOCK_H, PERMUTED, ONE_SPLIT)
    else:
        for k in range(TOP_K):  # a loop by default: unrolled with the splits loop, the [BLOCK_T, BLOCK_H] pointers spill
            acc += _slot_sum(y_ptr, weights_ptr, ids_ptr, row_ptr, rows, k, offs_h, t_mask, h_mask, num_splits,
                             num_experts, stride_ys, stride_ym, stride_wt, stride_it,
                             TOP_K, BLOCK_T, BLOCK_H, PERMUTED, ONE_SPLIT)
    tl.store(out_ptr + rows[:, None] * stride_ot + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & h_mask[None, :])


@dataclass(frozen=True)
class _ExpertWeights:
    """One expert GEMM's weights as the kernel reads them: w [E, rows, K] by strides (elements; int4: bytes
    of packed nibble pairs), and for quantized weights their float32 scales and the kernel's QUANT code."""
    data: torch.Tensor
    stride_e: int
    stride_n: int
    scales: torch.Tensor | None = None
    stride_se: int = 0
    stride_sn: int = 0
    quant: int = 0

    @classmethod
    def of(cls, w: torch.Tensor) -> "_ExpertWeights":
        return cls(w, w.stride(0), w.stride(1))

    @classmethod
    def quantized(cls, qt, num_experts: int) -> "_ExpertWeights":
        rows = qt.shape[0] // num_experts  # the stack is [E * rows, K], expert e's rows at e * rows
        return cls(qt.data, rows * qt.data.stride(0), qt.data.stride(0), qt.scales, rows * qt.scales.stride(0),
                   qt.scales.stride(0), 2 if qt.precision == "int4" else 1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, out: torch.Tensor | None = None,
              config: FusedMoEConfig | None = None, **overrides) -> torch.Tensor:
    """Routed experts: out[t] = sum_k w[t, k] * FFN_{ids[t, k]}(x[t]), FFN(x) = w2 (silu(gate x) * up x).

    No host sync (CUDA-graph capturable): every size comes from shapes. config (or keyword
    overrides of its fields, for benchmarks) picks the tiles; default_config otherwise.
    Returns out [T, H] in x's dtype.
    """
    T, A, E, H, I = check_moe_args(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_groups(x, [(_ExpertWeights.of(w13), _ExpertWeights.of(w2), None)], topk_weights, topk_ids,
                      T, A, E, H, I, out, config, overrides)


def _check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, H: int) -> None:
    check_float(x, "x", 2)
    check_float(topk_weights, "topk_weights", 2)
    check_index(topk_ids, "topk_ids", 2, (torch.int32, torch.int64))
    if x.shape[1] != H or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)} do not fit experts of hidden size {H}")


def _quantized_pair(q13, q2, n: int, H: int, I: int, cfg: FusedMoEConfig) -> tuple[_ExpertWeights, _ExpertWeights]:
    """n experts' quantized stacks q13 [n * 2I, H], q2 [n * H, I] checked, as the kernel reads them."""
    if q13.precision != q2.precision or q13.precision not in ("fp8", "int8", "int4"):
        raise ValueError(f"quantized experts must share one of fp8/int8/int4, got {q13.precision}, {q2.precision}")
    if tuple(q13.shape) != (n * 2 * I, H) or tuple(q2.shape) != (n * H, I):
        raise ValueError(f"stacks {q13.shape} / {q2.shape} do not hold {n} experts' [2I, H] / [H, I] weights "
                         f"(H={H}, I={I})")
    for qt in (q13, q2):
        if not qt.data.is_contiguous() or not qt.scales.is_contiguous() or qt.scales.dtype != torch.float32:
            raise ValueError("quantized data and float32 scales must be contiguous")
    if q13.precision == "int4" and (INT4_GROUP % cfg.block_k or INT4_GROUP % cfg.block_k2):
        raise ValueError(f"int4 tiles must lie in one group of {INT4_GROUP}: block_k {cfg.block_k} / block_k2 "
                         f"{cfg.block_k2} must divide it")
    return _ExpertWeights.quantized(q13, n), _ExpertWeights.quantized(q2, n)


def fused_moe_quantized(x: torch.Tensor, q13, q2, num_experts: int, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, out: torch.Tensor | None = None,
                        config: FusedMoEConfig | None = None, **overrides) -> torch.Tensor:
    """fused_moe on quantized experts (codecs/quant.py QuantizedTensor stacks, expert e's rows at e * rows:
    q13 [E * 2I, H], q2 [E * H, I]; fp8 / int8 per output channel, int4 in groups of 128), dequantized
    tile by tile in registers: each weight byte is read once, and no dequantized copy is written. The
    weights it multiplies are the ones kernels/dequant.py would write, so with the same tiles the result
    equals fused_moe on those dequantized weights bit for bit in the interpreter and under MMA v3 (64-row
    blocks); under MMA v2 its tiles keep their 8-bit loads' operand layout (fused_moe_tiles.weight_tile), and
    the sums may differ in the last bits."""
    E = num_experts
    if E < 1 or q13.shape[0] % (2 * E) or q2.shape[0] % E:
        raise ValueError(f"stacks {q13.shape} / {q2.shape} do not hold {E} experts' [2I, H] / [H, I] weights")
    I, H = q13.shape[0] // (2 * E), q13.shape[1]
    _check_routing(x, topk_weights, topk_ids, H)
    check_same_device(x=x, w13=q13.data, w2=q2.data, topk_weights=topk_weights, topk_ids=topk_ids)
    T, A = topk_ids.shape
    cfg = config or default_config(T, A, E, H, I, x.dtype, sm_count(x.device))
    cfg = dataclasses.replace(cfg, **overrides) if overrides else cfg
    return fused_moe_groups(x, [(*_quantized_pair(q13, q2, E, H, I, cfg), None)], topk_weights, topk_ids,
                      T, A, E, H, I, out, cfg, {})


def fused_moe_mixed(x: torch.Tensor, parts, num_experts: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    *, out: torch.Tensor | None = None, config: FusedMoEConfig | None = None) -> torch.Tensor:
    """A layer whose experts are held at several precisions (--expert-precision dynamic). parts: one
    (w13, w2, slots) per group: float expert views w13 [n, 2I, H] / w2 [n, H, I] (exact experts, any
    expert stride), QuantizedTensor stacks as fused_moe_quantized takes them, or lossless format v2
    TiledTensors [n, 2I, H] / [n, H, I] (one part per expert, as fused_moe_lossless takes them), or version 3
    (hibyte) tensors or their fused_moe_hibyte.HiByteExperts launchers (the engine tier's kernel choice); slots int32
    [E] on the device, each expert's index in that part or -1. Every expert belongs to exactly one part. One
    routing sort, one launch pair per part (a part skips the other parts' blocks), one sum: equal bit for
    bit to fused_moe on the layer's experts with the lossless ones decoded, under the same tiles (with quantized
    parts, as fused_moe_quantized is to their dequantized weights; hibyte launchers with exact=False, within bf16
    GEMM tolerance of it)."""
    if not parts:
        raise ValueError("fused_moe_mixed needs at least one part")
    E, H = num_experts, x.shape[1]
    _check_routing(x, topk_weights, topk_ids, H)
    T, A = topk_ids.shape
    first2 = parts[0][1]
    I = first2.shape[1] if isinstance(first2, QuantizedTensor) else first2.shape[2]
    # the tiles fused_moe would take for the layer (its tuned table, else the defaults): every part runs over
    # its blocks and splits, so the sums are those of fused_moe on the assembled layer
    cfg = config or tuned_config(T, A, E, H, I, x.dtype, x.device) or default_config(T, A, E, H, I, x.dtype,
                                                                                      sm_count(x.device))
    hib = [w13 for w13, _, _ in parts if getattr(w13, "version", None) == 3]
    if config is None and hib:  # large blocks: larger tiles (the hibyte parts decode first from DECODE_MIN_ROWS)
        from .fused_moe_hibyte import layer_tiles

        cfg = layer_tiles(cfg, T * A, E, x.dtype, fast=all(getattr(w, "exact", True) is False for w in hib))
    groups = []
    for w13, w2, slots in parts:
        if slots.dtype != torch.int32 or tuple(slots.shape) != (E,) or slots.device != x.device:
            raise ValueError(f"slots must be int32 [{E}] on {x.device}, got {slots.dtype} {tuple(slots.shape)}")
        if isinstance(w13, QuantizedTensor):
            groups.append((*_quantized_pair(w13, w2, w13.shape[0] // (2 * I), H, I, cfg), slots))
            continue
        if getattr(w13, "version", None) == 3:  # lossless version 3 (hibyte) or its launchers, decoded in the GEMM
            from .fused_moe_hibyte import hibyte_pair

            groups.append((*hibyte_pair(w13, w2, H, I, x.device), slots))
            continue
        if getattr(w13, "version", None) == 2:  # lossless format v2, decoded in the GEMM
            from .fused_moe_lossless import lossless_tiles, tiled_pair

            # the decode's register needs (lossless_tiles: same sums); the interpreter keeps the layer's tiles (its
            # numpy dot sums each K step in one go, so there the K step does change the sums)
            tiles = None if config is not None or x.dtype == torch.float32 or INTERPRET else lossless_tiles(cfg)
            groups.append((*tiled_pair(w13, w2, H, I, x.device, x.dtype, tiles), slots))
            continue
        check_float(w13, "w13", 3)
        check_float(w2, "w2", 3)
        if w13.dtype != x.dtype or tuple(w13.shape[1:]) != (2 * I, H) or tuple(w2.shape[1:]) != (H, I):
            raise ValueError(f"exact part {tuple(w13.shape)} / {tuple(w2.shape)} does not fit H={H}, I={I} "
                             f"in {x.dtype}")
        groups.append((_ExpertWeights.of(w13), _ExpertWeights.of(w2), slots))
    return fused_moe_groups(x, groups, topk_weights, topk_ids, T, A, E, H, I, out, cfg, {})


def fused_moe_groups(x, groups, topk_weights, topk_ids, T, A, E, H, I, out, config, overrides) -> torch.Tensor:
    """groups: [(w13, w2, slots)], one per precision group of the layer; slots (int32 [E]: each expert's
    index in the group's weights, -1 elsewhere) is None for a group holding every expert by id. Every
    slot's rows of h and y are written by its expert's group's launches; one moe_sum adds them up."""
    out = check_out_like(out, x)
    if T == 0:
        return out
    num_sms = sm_count(x.device)
    # a tuned table's entry for this GPU, shape and batch (kernels/fused_moe_config.py), else the defaults
    cfg = config or tuned_config(T, A, E, H, I, x.dtype, x.device) or default_config(T, A, E, H, I, x.dtype, num_sms)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    N = T * A
    # One token: each slot is its own block (fused_moe_kernel's SLOT_BLOCKS) and moe_align is not launched; groups
    # with kernels of their own (lossless) keep the sorted blocks. The same rows and sums either way.
    slot_blocks = T <= SLOT_BLOCKS_MAX_TOKENS and not any(hasattr(w13, "launch") for w13, _, _ in groups)
    if slot_blocks:
        block_expert = topk_ids.reshape(-1)
        sorted_slots, num_blocks = block_expert, N
    else:
        sorted_slots, block_expert = moe_align(topk_ids, E, cfg.block_m)
        num_blocks = block_expert.numel()
    precision = dot_precision(x.dtype)

    # A group whose weights have a `launch` (kernels/fused_moe_lossless.py: experts in lossless format v2) runs
    # its own kernel over the same blocks, rows of h and y, and splits.
    h = torch.empty((N, I), dtype=x.dtype, device=x.device)
    for w13, _, slots in groups:
        if hasattr(w13, "launch"):
            w13.launch((num_blocks * triton.cdiv(I, cfg.block_n), 1), x, h, sorted_slots, block_expert, slots, N,
                       num_blocks, I, H, H, 0, h.stride(0), A, True, cfg, precision)
            continue
        launch_dense(w13, (num_blocks * triton.cdiv(I, cfg.block_n), 1), x, h, sorted_slots, block_expert, slots, N,
                     num_blocks, I, H, H, 0, h.stride(0), A, True, cfg, precision, E, slot_blocks)

    n_tiles2 = triton.cdiv(H, cfg.block_n2)
    splits, k_per_split = w2_splits(cfg, num_blocks, T, A, E, H, I, num_sms)
    # NOTE: every valid slot is in exactly one block, and every (column tile, split) program of that
    # block writes its y row: moe_sum_kernel reads only rows written here (invalid slots are masked).
    y_dtype = torch.float32 if splits > 1 else x.dtype
    y = torch.empty((splits, N, H), dtype=y_dtype, device=x.device)
    for _, w2, slots in groups:
        if hasattr(w2, "launch"):
            w2.launch((num_blocks * n_tiles2, splits), h, y, sorted_slots, block_expert, slots, N, num_blocks, H, I,
                      k_per_split, y.stride(0), y.stride(1), 1, False, cfg, precision)
            continue
        launch_dense(w2, (num_blocks * n_tiles2, splits), h, y, sorted_slots, block_expert, slots, N, num_blocks, H, I,
                     k_per_split, y.stride(0), y.stride(1), 1, False, cfg, precision, E, slot_blocks)

    return moe_sum(y, topk_weights, topk_ids, out, splits, E)


def launch_dense(w: _ExpertWeights, grid, a, out, sorted_slots, block_expert, slots, num_slots, num_blocks, N, K,
                 k_per_split, stride_os, stride_om, top_k, gated, cfg, precision, num_experts,
                 slot_blocks=False) -> None:
    """fused_moe_kernel over the blocks of one GEMM (gated: w13's, with cfg's first tiles; else w2's) on weights `w`
    (float or quantized; slots [E]: each expert's index in w, or -1 for blocks this launch skips; None: by id).
    The arguments a `launch` hook takes (fused_moe_lossless.py), and the experts' count."""
    bn, bk, warps, stages = ((cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) if gated else
                             (cfg.block_n2, cfg.block_k2, cfg.num_warps2, cfg.num_stages2))
    fused_moe_kernel[grid](
        a, w.data, out, sorted_slots, block_expert, a if w.scales is None else w.scales,
        block_expert if slots is None else slots,
        num_slots, num_blocks, N, K, k_per_split,
        a.stride(0), w.stride_e, w.stride_n, stride_os, stride_om, w.stride_se, w.stride_sn, num_experts,
        TOP_K=top_k, GATED=gated, SWAP_AB=cfg.swap_ab, EVEN_K=K % bk == 0, EVEN_N=N % bn == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision,
        QUANT=w.quant, GROUP=INT4_GROUP, USE_SLOTS=slots is not None, SLOT_BLOCKS=slot_blocks,
        num_warps=warps, num_stages=stages, **launch_args(a.device),
    )


def check_out_like(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """out (or a new tensor) like x: [T, H] in x's dtype, unit last stride."""
    if out is None:
        return torch.empty_like(x)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"out must be like x {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def w2_splits(cfg: FusedMoEConfig, num_blocks: int, T: int, A: int, E: int, H: int, I: int,
              num_sms: int) -> tuple[int, int]:
    """(splits of I, k_per_split) of the w2 GEMM: cfg.split_k, or by occupancy; every split a whole number
    of split_step (default BLOCK_K2) steps, so each starts at an even K."""
    step = cfg.split_step or cfg.block_k2
    splits = cfg.split_k or choose_split_k(
        min(num_blocks, expected_blocks(T, A, E, cfg.block_m)) * triton.cdiv(H, cfg.block_n2), I, step, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(I, splits), step) * step
    return triton.cdiv(I, k_per_split), k_per_split


def moe_sum(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
            splits: int, E: int, rows: torch.Tensor | None = None, *, block_t: int = SUM_BLOCK_T,
            block_h: int = SUM_BLOCK_H, num_warps: int = 8, unroll: bool = False) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * sum_s y[s, t * A + k] (moe_sum_kernel, one launch), y [S, N, H]; with `rows`,
    y's row of slot t * A + k is rows[t * A + k]. The tile and unroll change the speed, not the sums."""
    T, A = topk_ids.shape
    H = out.shape[1]
    moe_sum_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, block_h))](
        y, topk_weights, topk_ids, out, topk_ids if rows is None else rows,
        T, H, splits, E,
        y.stride(0), y.stride(1), topk_weights.stride(0), topk_ids.stride(0), out.stride(0),
        TOP_K=A, BLOCK_T=block_t, BLOCK_H=block_h, PERMUTED=rows is not None, ONE_SPLIT=splits == 1,
        UNROLL=unroll, num_warps=num_warps, **launch_args(y.device),
    )
    return out


@triton.jit(do_not_specialize=["M"])
def silu_mul_kernel(x_ptr, out_ptr, M, I, stride_xm, stride_om, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """out[m, i] = silu(x[m, i]) * x[m, I + i], in float32, rounded once to out's dtype."""
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (offs_m < M)[:, None] & (offs_i < I)[None, :]
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_i[None, :]
    g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(ptrs + I, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_i[None, :], (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty),
             mask=mask)



@triton.jit(do_not_specialize=["R"])
def gather_rows_kernel(x_ptr, order_ptr, out_ptr, R, H, stride_xt, stride_or, DIV: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[r] = x[order[r] // DIV] over a [BLOCK_R, BLOCK_H] tile (a copy: the same bits)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r_mask = offs_r < R
    src = (tl.load(order_ptr + offs_r, mask=r_mask, other=0) // DIV).to(tl.int64)
    mask = r_mask[:, None] & (offs_h < H)[None, :]
    v = tl.load(x_ptr + src[:, None] * stride_xt + offs_h[None, :], mask=mask)
    tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_or + offs_h[None, :], v, mask=mask)


def gather_rows(x: torch.Tensor, order: torch.Tensor, div: int, *, block_r: int = GATHER_BLOCK_R,
                block_h: int = GATHER_BLOCK_H, num_warps: int = 4) -> torch.Tensor:
    """x[order // div] ([len(order), H], x's dtype) in one launch: the grouped path's token rows in expert order,
    order being the slots t * div + k sorted by expert (torch would first divide, then gather: two kernels)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("gather_rows: x must be 2-D with a unit column stride")
    if order.dim() != 1:
        raise ValueError("gather_rows: order must be 1-D")
    R, H = order.shape[0], x.shape[1]
    out = torch.empty(R, H, dtype=x.dtype, device=x.device)
    if R:
        gather_rows_kernel[(triton.cdiv(R, block_r), triton.cdiv(H, block_h))](
            x, order, out, R, H, x.stride(0), out.stride(0), DIV=div, BLOCK_R=block_r, BLOCK_H=block_h,
            num_warps=num_warps)
    return out


def silu_mul(gate_up: torch.Tensor, *, block_m: int = SILU_BLOCK_M, block_i: int = SILU_BLOCK_I,
             num_warps: int = 4) -> torch.Tensor:
    """silu(gate) * up of gate_up [M, 2I] (gate columns, then up) as one launch: [M, I] in gate_up's dtype."""
    M, two_i = gate_up.shape
    I = two_i // 2
    if gate_up.stride(1) != 1:
        raise ValueError("silu_mul: gate_up needs a unit column stride")
    out = torch.empty(M, I, dtype=gate_up.dtype, device=gate_up.device)
    silu_mul_kernel[(triton.cdiv(M, block_m), triton.cdiv(I, block_i))](
        gate_up, out, M, I, gate_up.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_I=block_i, num_warps=num_warps)
    return out
