"""Routing-aware placement search (issue 21): the placement for routed fetching, and the choice between it and
the one the stream-all search picked. Pure Python; formulas in docs/planner.md ("Placements for routed fetching").

The stream-all search (planner.plan_memory) optimises the every-step copy of every host expert. Routed fetching
moves only the routed misses, so under uniform routing its best placement keeps the most experts on the GPU: per
N resident (bf16 cache pages) in 0..E-1, as many experts as fit in the lossless compressed GPU tier (0.683 of
bf16; a routed miss from it is decoded, never copied, by either fetch path), the host tier compressed where allowed
(fetched by path (a) alone: such a placement is costed without path (b)). Per N two
compressed counts are tried: the most the budget holds with one max_model_len sequence of KV (the KV minimum),
and the most that still leaves the KV for as many workload sequences as C = 0 does. Each candidate is sized by
planner.plan_placement (the one device budget) and costed by fetch_cost.fetch_step_s at the sequences its KV
holds (max_num_seqs, or fewer); the placements are compared by decode tokens per second (sequences / step).
The pick: the routed-optimised placement when it beats the stream-optimised one as --expert-fetch would settle
it (auto: by ROUTED_MARGIN when that one settles to stream, the same rule as fetch_cost.choose_fetch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

from pagedmoe.planning.fetch_cost import (FetchTiers, ROUTED_MARGIN, choose_fetch, fetch_step_s, routed_host_bytes,
                                          routed_s)
from pagedmoe.planning.placement import LOSSLESS_PLANNING_RATIO, Placement
from pagedmoe.planning.plans import PlacementBudgetError, PlacementPlan, PlanInputs

# The routed search fills the budget with compressed experts up to the KV minimum; the tier's real ratio is only
# known once the weights are encoded (the KV cache is sized after loading), so it is planned this much larger
# (bytes / bf16 bytes) for the fit: ~1.5% of the tier's bytes, 0.2 GiB of Qwen3-30B-A3B's 16 GiB at 24 GiB.
COMPRESSED_HEADROOM = 0.01


@dataclass(frozen=True)
class FetchPick:
    """One placement with its host-tier mode, the fetch --expert-fetch would settle on for it and the modelled
    decode step at the sequences its KV cache holds."""

    plan: PlacementPlan
    host_compression: str       # "none" | "lossless"
    fetch: str                  # "stream" | "routed" | "resident"
    step_s: float
    origin: str                 # "stream-optimised" | "routed-optimised"
    shape: object = None        # the ModelShape and HardwareProfile it was costed for
    hw: object = None
    fetch_path: str = "auto"    # the routed fetch paths modelled (_with_paths)

    @property
    def num_seqs(self) -> int:
        return max(1, self.plan.num_seqs)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_seqs / self.step_s

    def tiers(self) -> FetchTiers:
        return FetchTiers.of_plan(self.plan.placement.num_compressed_experts, self.host_compression)

    def label(self) -> str:
        host = ", host compressed" if self.host_compression == "lossless" else ""
        return f"{self.plan.placement.label()}{host}"

    def steps_ms(self, batches: Iterable[int], context_len: float) -> dict[int, float]:
        """Modelled decode step ms at each batch under this pick's fetch."""
        return {b: 1e3 * _fetch_s(self.shape, self.hw, self.plan.placement, b, context_len, self.tiers(), self.fetch,
                                  self.fetch_path)
                for b in batches}


def _with_paths(costs: dict, fetch_path: str) -> dict:
    """fetch_step_s's costs as the engine's --expert-fetch-path `fetch_path` runs routed fetching: auto, either path
    (the faster per bucket; path (b) only where it can run); copy, path (a) alone; uva, path (b) alone (its cost as
    "routed" too, so routed_s gives it; where it cannot run, the engine refuses the flag: path (a) is costed)."""
    costs = dict(costs)
    if fetch_path == "copy":
        costs["routed_uva"] = None
    elif fetch_path == "uva" and costs.get("routed_uva") is not None:
        costs["routed"] = costs["routed_uva"]
    return costs


def _fetch_s(shape, hw, placement: Placement, num_seqs: int, context_len: float, tiers: FetchTiers,
             fetch: str, fetch_path: str) -> float:
    costs = _with_paths(fetch_step_s(shape, hw, min(placement.num_gpu_experts, default=0), num_seqs, context_len,
                                     tiers), fetch_path)
    return routed_s(costs) if fetch == "routed" else costs[fetch]


def settle(plan: PlacementPlan, inputs: PlanInputs, host_compression: str, requested: str, context_len: float,
           origin: str, fetch_path: str = "auto") -> FetchPick:
    """`plan` with the fetch `requested` (auto | stream | routed) settles on, as fetch_cost.resolve_fetch would
    on CUDA (at max_num_seqs), and its step at the plan's sequences (max_num_seqs, or fewer where the KV is short).
    `fetch_path`: the routed fetch paths the engine would run (_with_paths): "auto" where path (b) can run (CUDA
    graphs on CUDA), "copy" where it cannot (--enforce-eager, off CUDA, --expert-fetch-path copy), "uva" forced."""
    tiers = FetchTiers.of_plan(plan.placement.num_compressed_experts, host_compression)
    n = min(plan.placement.num_gpu_experts, default=0)

    def costs_at(seqs: int) -> dict:
        return _with_paths(fetch_step_s(inputs.shape, inputs.hw, n, seqs, context_len, tiers), fetch_path)

    costs = costs_at(max(1, plan.num_seqs))
    if plan.placement.is_resident:
        fetch = "resident"
    elif requested == "auto":   # the engine settles auto at max_num_seqs (fetch_cost.settle_expert_fetch)
        fetch = choose_fetch(costs_at(inputs.max_num_seqs))
    else:
        fetch = requested
    return FetchPick(plan, host_compression, fetch, routed_s(costs) if fetch == "routed" else costs[fetch], origin,
                     inputs.shape, inputs.hw, fetch_path)


def _fits(inputs: PlanInputs, placement: Placement) -> Optional[PlacementPlan]:
    from pagedmoe.planning.planner import plan_placement

    try:
        return plan_placement(inputs, placement)
    except PlacementBudgetError:
        return None


def _most_compressed(inputs: PlanInputs, n: int, ratio: float, lo: int, hi: int, ok) -> Optional[PlacementPlan]:
    """The plan of the largest C in [lo, hi] whose plan passes `ok` (C = lo is known to) with the compressed tier
    COMPRESSED_HEADROOM larger than planned: more compressed experts take more device memory, so the test is
    monotone in C. The plan returned is sized at `ratio`."""
    L, E = inputs.shape.num_moe_layers, inputs.shape.experts_per_gpu
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = _fits(inputs, Placement.uniform(L, E, n, mid, min(1.0, ratio + COMPRESSED_HEADROOM) if mid else 0.0))
        if plan is not None and ok(plan):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return None if best is None else _fits(inputs, Placement.uniform(L, E, n, best, ratio if best else 0.0))


def routed_candidates(inputs: PlanInputs, compression_ratio: Optional[float]) -> list[PlacementPlan]:
    """Paged placements for routed fetching: for each N in 0..E-1 resident, no compressed tier (without a ratio),
    or the most compressed experts the budget holds with the KV minimum and the most that keep the workload's
    sequences of C = 0. Plans whose routed host tier (every expert but the compressed tier's, fetch_cost.
    routed_host_bytes) exceeds inputs.host_budget_bytes are left out."""
    shape = inputs.shape
    L, E = shape.num_moe_layers, shape.experts_per_gpu
    sized = dataclasses.replace(inputs, host_budget_bytes=None)  # the routed host limit is checked below
    host_mode = "lossless" if inputs.host_compression_ratio else "none"
    out: list[PlacementPlan] = []
    for n in range(E):
        base = _fits(sized, Placement.uniform(L, E, n))
        if base is None:
            break   # more resident experts fit no better
        plans = [base]
        if compression_ratio and E - n > 0:
            plans.append(_most_compressed(sized, n, compression_ratio, 0, E - n, lambda p: True))
            plans.append(_most_compressed(sized, n, compression_ratio, 0, E - n,
                                          lambda p, s=base.num_seqs: p.num_seqs >= s))
        seen = set()
        for plan in plans:
            key = plan.placement if plan is not None else None
            if plan is None or key in seen:
                continue
            seen.add(key)
            host = routed_host_bytes(shape, plan.placement.num_compressed_experts, host_mode)
            if inputs.host_budget_bytes is None or host <= inputs.host_budget_bytes:
                out.append(plan)
    return out


def best_routed(inputs: PlanInputs, compression_ratio: Optional[float], context_len: float,
                requested: str = "routed", fetch_path: str = "auto") -> Optional[FetchPick]:
    """The routed-optimised placement: the best decode tokens/s under routed fetching, among the candidates
    --expert-fetch `requested` settles on routed for (routed: all; auto: where routed is modelled ROUTED_MARGIN
    faster than stream-all); ties: more experts on the GPU. None when there is none."""
    host_mode = "lossless" if inputs.host_compression_ratio else "none"
    best = None
    for plan in routed_candidates(inputs, compression_ratio):
        pick = settle(plan, inputs, host_mode, requested, context_len, "routed-optimised", fetch_path)
        if pick.fetch != "routed":
            continue   # stream-all would run it: the stream-all search's ground (and its compression flags)
        p = plan.placement
        key = (pick.decode_tokens_per_s, p.total_gpu + p.total_compressed, p.total_gpu)
        if best is None or key > best[0]:
            best = (key, pick)
    return None if best is None else best[1]


def choose(stream_pick: FetchPick, routed_picks: Iterable[Optional[FetchPick]], requested: str) -> FetchPick:
    """The stream-optimised pick, or the best routed-optimised one when modelled faster (decode tokens/s at the
    sequences each holds). Against a stream-optimised placement that settles to stream, routed must win by
    ROUTED_MARGIN, as in fetch_cost.choose_fetch; resident placements are never displaced."""
    if stream_pick.fetch == "resident":
        return stream_pick
    bar = stream_pick.decode_tokens_per_s
    if requested == "auto" and stream_pick.fetch == "stream":
        bar /= 1.0 - ROUTED_MARGIN
    best = max((p for p in routed_picks if p is not None), key=lambda p: p.decode_tokens_per_s, default=None)
    return best if best is not None and best.decode_tokens_per_s > bar else stream_pick


def routed_compression_ratio(flag: Optional[str], is_bf16: bool) -> Optional[float]:
    """The compressed GPU tier's ratio for the routed search: --expert-compression unset (the default) or
    lossless, bf16 weights; None: no compressed tier (--expert-compression none, or not bf16)."""
    return LOSSLESS_PLANNING_RATIO if is_bf16 and flag in (None, "lossless") else None


def routed_host_modes(flag: Optional[str], is_bf16: bool) -> list[str]:
    """The host-tier modes the routed search tries: --host-compression none or lossless as given; unset (the
    default) or auto: both when bf16 (lossless is exact; both fetch paths read it), else raw."""
    if flag in ("none", "lossless"):
        return [flag]
    return ["none", "lossless"] if is_bf16 else ["none"]
