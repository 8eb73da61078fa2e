"""Token slots sorted by expert, each expert's group padded to BLOCK_M rows (input of fused_moe.py).

Shapes: T tokens, A active experts per token, E experts; a *slot* is one (token, k) pair, flat index
s = t * A + k, N = T * A slots. Outputs, sized from shapes only (no host sync, graph-capturable):
  sorted_slots [max_blocks * BLOCK_M] int32: expert 0's slots (ascending), padded with the sentinel N
      to a multiple of BLOCK_M, then expert 1's, ...; rows past the last used block hold N too.
  block_expert [max_blocks] int32: the expert of each BLOCK_M-row block; -1 past the last used one.
max_blocks bounds sum_e ceil(c_e / BLOCK_M) for any routing: at most N / BLOCK_M + (non-empty
experts), and never more than N (every used block holds a slot). Slots whose id is outside [0, E)
go nowhere (the reference loop over experts skips them too).

One kernel launch. Program p owns slot chunk p: it counts all N ids per expert (redundantly in every
program; N <= a few thousand at decode, so this is cheaper than a second launch), takes the block
offsets from the counts, ranks its own slots among the earlier slots of the same expert (a stable
order, equal to a stable argsort) and scatters them. Padding rows and block_expert are split over
the programs by block; real rows and padding rows never overlap, so no program waits for another.
Reference: ``moe_align_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_checks import next_pow2
from .pdl import launch_args, pdl_enter

ALIGN_CHUNK = 64  # slots per program, and ids per inner step
# Above this many slots moe_align sorts with torch ops (moe_align_sorted) instead: the kernel's programs each count
# all N ids, O(N^2 / CHUNK) work, fine at decode sizes but most of the Triton path's 8.6 ms at a prefill of 8192
# tokens (65,536 slots of Qwen3-30B-A3B) on the H100 (bench_prefill_moe.py, benchmarks/results/session33).
ALIGN_SORT_MIN_SLOTS = 8192


def max_num_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the number of BLOCK_M-row blocks any routing of num_slots slots can need."""
    if num_slots == 0:
        return 0
    return min(num_slots, triton.cdiv(num_slots, block_m) + min(num_experts, num_slots))


@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def moe_align_kernel(
    ids_ptr, sorted_slots_ptr, block_expert_ptr,
    num_slots, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_e = tl.arange(0, E_PAD)
    offs_c = tl.arange(0, CHUNK)
    offs_i = pid * CHUNK + offs_c
    ids_i = tl.load(ids_ptr + offs_i, mask=offs_i < num_slots, other=-1)
    ids_i = tl.where((ids_i >= 0) & (ids_i < num_experts), ids_i, -1).to(tl.int32)

    # 2-D accumulators, reduced once after the loop (a reduction per step would cost a barrier each).
    hist = tl.zeros([CHUNK, E_PAD], tl.int32)
    before = tl.zeros([CHUNK, CHUNK], tl.int32)
    for j0 in range(0, num_slots, CHUNK):
        offs_j = j0 + offs_c
        ids_j = tl.load(ids_ptr + offs_j, mask=offs_j < num_slots, other=-1)
        ids_j = tl.where((ids_j >= 0) & (ids_j < num_experts), ids_j, -1).to(tl.int32)
        hist += (ids_j[:, None] == offs_e[None, :]).to(tl.int32)
        same = (ids_i[:, None] == ids_j[None, :]) & (offs_j[None, :] < offs_i[:, None])
        before += same.to(tl.int32)
    counts = tl.sum(hist, axis=0)                      # [E_PAD]; 0 for e >= E (ids were clipped to -1)
    rank = tl.sum(before, axis=1)                      # [CHUNK]: earlier slots with the same expert
    num_blk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(num_blk, axis=0)               # inclusive; columns e >= E hold the total
    blk_start = blk_end - num_blk

    hit_i = ids_i[:, None] == offs_e[None, :]
    start_i = tl.sum(tl.where(hit_i, blk_start[None, :], 0), axis=1)
    tl.store(sorted_slots_ptr + start_i * BLOCK_M + rank, offs_i, mask=ids_i >= 0)

    offs_r = tl.arange(0, BLOCK_M)
    for b0 in range(pid * CHUNK_B, max_blocks, num_programs * CHUNK_B):
        offs_b = b0 + tl.arange(0, CHUNK_B)
        b_mask = offs_b < max_blocks
        # The expert of block b is the number of experts whose blocks all end at or before b
        # (empty experts included); past the last used block every column counts, giving E_PAD.
        e_b = tl.sum((blk_end[None, :] <= offs_b[:, None]).to(tl.int32), axis=1)
        e_b = tl.where(e_b < num_experts, e_b, -1)
        tl.store(block_expert_ptr + offs_b, e_b, mask=b_mask)
        hit_b = e_b[:, None] == offs_e[None, :]
        count_b = tl.sum(tl.where(hit_b, counts[None, :], 0), axis=1)
        start_b = tl.sum(tl.where(hit_b, blk_start[None, :], 0), axis=1)
        row_in_expert = (offs_b - start_b)[:, None] * BLOCK_M + offs_r[None, :]
        pad = (row_in_expert >= count_b[:, None]) & b_mask[:, None]
        sentinel = tl.full([CHUNK_B, BLOCK_M], 0, tl.int32) + num_slots
        tl.store(sorted_slots_ptr + offs_b[:, None] * BLOCK_M + offs_r[None, :], sentinel, mask=pad)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, A] (int32/int64) -> (sorted_slots [max_blocks * block_m], block_expert [max_blocks]) int32."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T, A] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_slots = ids.numel()
    if num_slots >= 2 ** 31 - 1:
        raise ValueError(f"too many slots for int32 indices: {num_slots}")
    max_blocks = max_num_blocks(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    if num_slots == 0:
        return sorted_slots, block_expert
    if num_slots > ALIGN_SORT_MIN_SLOTS:
        return moe_align_sorted(ids, num_experts, block_m, sorted_slots, block_expert)
    e_pad = max(16, next_pow2(num_experts))
    moe_align_kernel[(triton.cdiv(num_slots, ALIGN_CHUNK),)](
        ids, sorted_slots, block_expert, num_slots, num_experts, max_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, CHUNK_B=16,
        num_warps=8 if e_pad >= 128 else 4, **launch_args(ids.device),
    )
    return sorted_slots, block_expert


def moe_align_sorted(ids: torch.Tensor, num_experts: int, block_m: int, sorted_slots: torch.Tensor,
                     block_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's layout from a stable sort of the flat ids (torch ops, no host sync: graph-capturable), into the
    given outputs. Slot ids outside [0, E) sort after every expert (key E) and are written to a spare row."""
    N, E, dev = ids.numel(), num_experts, ids.device
    key = torch.where((ids >= 0) & (ids < E), ids, E)
    sorted_key, order = torch.sort(key, stable=True)
    start = torch.searchsorted(sorted_key, torch.arange(E + 1, device=dev, dtype=sorted_key.dtype))  # [E + 1]
    num_blk = (start[1:] - start[:-1] + block_m - 1) // block_m
    blk_end = torch.cumsum(num_blk, 0)
    blk_start = torch.cat([blk_end.new_zeros(1), blk_end, blk_end[-1:]])   # key E: past every real row
    first = torch.cat([start, start[-1:]])
    dest = blk_start[sorted_key] * block_m + torch.arange(N, device=dev) - first[sorted_key]
    spare = sorted_slots.numel()
    dest = torch.where(sorted_key < E, dest, spare)
    rows = torch.full((spare + 1,), N, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    sorted_slots.copy_(rows[:spare])
    e_b = torch.searchsorted(blk_end, torch.arange(block_expert.numel(), device=dev, dtype=blk_end.dtype), right=True)
    block_expert.copy_(torch.where(e_b < E, e_b, -1))
    return sorted_slots, block_expert


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of moe_align (host loop; for tests)."""
    ids = topk_ids.reshape(-1).cpu().long()
    num_slots = ids.numel()
    max_blocks = max_num_blocks(num_slots, num_experts, block_m)
    sorted_slots = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    blk = 0
    for e in range(num_experts):
        slots = torch.nonzero(ids == e).flatten()
        n = triton.cdiv(slots.numel(), block_m)
        sorted_slots[blk * block_m: blk * block_m + slots.numel()] = slots.int()
        block_expert[blk: blk + n] = e
        blk += n
    assert blk <= max_blocks
    return sorted_slots.to(topk_ids.device), block_expert.to(topk_ids.device)
