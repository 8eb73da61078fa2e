"""How paged experts reach the GPU, modelled per decode batch: the one cost model behind `--expert-fetch auto`,
`--expert-fetch-path auto` and `pagedmoe plan`'s fetch table. Pure Python; formulas in docs/planner.md
("Fetching what is routed").

  stream    (experts/pager.py): every host expert of every layer is copied every step, one layer ahead,
            behind compute: cost_model.decode_step_cost with that traffic (its pipeline fill included).
  routed    (experts/routed.py, experts/cache.py): per MoE layer the distinct routed experts
            d = E*(1-(1-A/E)^B) (uniform routing: real routing is skewed, so fewer) are looked up in a cache of
            C = max(E, L*N + 2(E-N)) pages; with uniform routing a page hits with probability min(1, C / (L*E)).
            A miss from the host tier moves its bytes (x the compression ratio for a compressed host tier), a
            miss from the compressed GPU tier moves none; a miss from either lossless tier is decoded.
            Two fetch paths, chosen per CUDA-graph batch bucket:
    copy    path (a): the misses are copied after the layer's host sync, not hidden behind compute; each layer
            pays the sync and lookup (ROUTED_LAYER_SYNC_S), each miss its fill's launches (ROUTED_MISS_HOST_S),
            and the step runs without CUDA graphs (both fitted on the H200);
    uva     path (b) (experts/routed_uva.py): a GPU kernel reads the host misses from mapped pinned memory at
            UVA_PCIE_SHARE of the copy engine's rate (raw rows gathered; a compressed host tier decoded by the
            indexed lossless decode as it reads, at UVA_DECODE_PCIE_SHARE of that rate or the decoder's, the
            slower), the compressed GPU tier's misses are decoded (in the same stream, after the host's: the
            decoder's rate), no sync (ROUTED_UVA_LAYER_S per layer for its small kernels), in CUDA graphs.
  resident  only when every expert fits (N = E): nothing moves.
Stream steps (routed fetching's forwards of T >= stream_min_tokens tokens beyond path (b)): every expert of every
layer is looked up, its misses at the cache's hit rate filled one layer ahead behind compute, as stream overlaps
(`stream_step_s`); no sync. `stream_step_min_tokens` is the smallest T at which path (a) models slower.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from pagedmoe.config_sections import fused_format
from pagedmoe.planning.cost_model import HardwareProfile, StepTraffic, decode_step_cost
from pagedmoe.planning.kv_sizing import decode_buckets
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import LOSSLESS_PLANNING_RATIO

# Path (a), per MoE layer and step: the host sync of the routed ids, the page-table lookup and the slot-map
# write; per miss: its fill's launches (a copy, or four copies and a decode for a compressed host expert) and
# bookkeeping. Fitted on the H200 (Qwen3-30B-A3B, 24 GiB, N=0 C=56, host tier compressed, --fused-ops on, at
# c2e1f27): 85.8 / 313.6 ms per step at batch 1 / 8 against 50.4 / 201.6 ms modelled with 60 us per layer and
# nothing per miss; these two constants make the model give the measured times at both batches.
ROUTED_LAYER_SYNC_S = 0.51e-3
ROUTED_MISS_HOST_S = 38e-6
# Path (b): gathered at 53.6 GB/s on the H200 (16.31 GB moved in a 304 ms batch-8 step, bf16 N=36, at c2e1f27)
# against the copy engine's 54.5 (shared/H200.md); per MoE layer its plan (a few small torch ops) and gather
# launches, inside a graph: an estimate.
UVA_PCIE_SHARE = 0.98
ROUTED_UVA_LAYER_S = 15e-6
# Path (b) over a compressed host tier: the lossless decoder reads its arrays from mapped host memory, 43.8 GB/s of
# compressed bytes on the H200 with 16 warps a block against the gather's 49.6 in the same run
# (benchmarks/bench_routed_fetch.py at 8ae7d4f): 0.88 of the gather's rate.
UVA_DECODE_PCIE_SHARE = 0.88
PLAN_BATCHES = (1, 8, 32)
# Routed fetching is chosen only when modelled at least this much faster than stream-all: its sync and eager
# costs are estimates until measured, and stream-all is the measured pipeline (and keeps CUDA graphs).
ROUTED_MARGIN = 0.10



@dataclass(frozen=True)
class FetchTiers:
    """Where the experts' master copies live besides the raw host tier: `num_compressed` per MoE layer in the
    compressed GPU tier, and the host tier compressed (`host_ratio` < 1: its bytes per bf16 byte)."""
    num_compressed: int = 0
    host_ratio: float = 1.0
    any_compressed: bool = False   # some layer holds compressed GPU-tier experts (per-layer counts may differ)

    @property
    def host_compressed(self) -> bool:
        """The host tier held compressed: its misses are decoded on the device (path (a): after a copy into
        staging; path (b): read from mapped host memory by the decoder)."""
        return self.host_ratio < 1.0

    @classmethod
    def of_plan(cls, num_compressed, host_compression: str) -> "FetchTiers":
        """From an ExpertPlan's per-layer compressed counts (the fewest of any layer) and host compression."""
        counts = list(num_compressed) if isinstance(num_compressed, (tuple, list)) else [num_compressed or 0]
        return cls(min(counts, default=0), LOSSLESS_PLANNING_RATIO if host_compression == "lossless" else 1.0,
                   any(counts))


def cache_pages(shape: ModelShape, num_gpu_experts: int) -> int:
    """Pages of the expert cache: the device rows stream-all holds (experts/build.py::cache_slots)."""
    E = shape.experts_per_gpu
    return max(E, shape.num_moe_layers * num_gpu_experts + 2 * (E - num_gpu_experts))


def miss_rows(num_experts: int, top_k: int, max_tokens: int) -> int:
    """Pages of path (b)'s miss area (experts/cache.py, experts/routed_uva.py): one per distinct expert a forward
    of `max_tokens` tokens can route to a layer; 0 without path (b)."""
    return min(num_experts, max_tokens * top_k) if max_tokens > 0 else 0


def cache_misses(shape: ModelShape, num_gpu_experts: int, num_compressed: int, looked_up: float) -> tuple:
    """(misses, those from the host tier) per step when each MoE layer looks `looked_up` distinct experts up in the
    cache: with uniform routing a page hits with probability min(1, C / (L x E)); a miss is from the compressed GPU
    tier with probability num_compressed / E."""
    L, E = shape.num_moe_layers, shape.experts_per_gpu
    hit = min(1.0, cache_pages(shape, num_gpu_experts) / max(1, L * E))
    misses = L * looked_up * (1.0 - hit)
    return misses, misses * (E - num_compressed) / E


def fetch_step_s(shape: ModelShape, hw: HardwareProfile, num_gpu_experts: int, num_seqs: int,
                 context_len: float, tiers: FetchTiers = FetchTiers()) -> dict[str, Optional[float]]:
    """Modelled decode step seconds of each fetch at `num_seqs` sequences (None: not possible): stream,
    routed (path (a), copy engine, eager), routed_uva (path (b), CUDA graphs) and resident."""
    L, E = shape.num_moe_layers, shape.experts_per_gpu   # this GPU's experts of a layer
    n = max(0, min(num_gpu_experts, E))
    comp = max(0, min(tiers.num_compressed, E - n))
    eb = shape.expert_bytes
    streamed = L * (E - n - comp)
    decoded = L * comp + (streamed if tiers.host_ratio < 1.0 else 0)
    stream = StepTraffic(h2d_bytes=int(streamed * eb * tiers.host_ratio), decode_out_bytes=decoded * eb,
                         decode_in_bytes=int(decoded * eb * LOSSLESS_PLANNING_RATIO))
    out: dict[str, Optional[float]] = {
        "stream": decode_step_cost(shape, hw, stream, num_seqs, context_len).total_s,
        "resident": decode_step_cost(shape, hw, StepTraffic(), num_seqs, context_len).total_s if n >= E else None}
    base = decode_step_cost(shape, hw, StepTraffic(), num_seqs, context_len)
    misses, host_misses = cache_misses(shape, n, comp, shape.routed_experts(num_seqs))
    moved = host_misses * eb * tiers.host_ratio
    decode = (misses - (host_misses if tiers.host_ratio >= 1.0 else 0.0)) * eb / hw.lossless_decode_bytes_per_s
    # no CUDA graphs: the per-layer launch overhead is paid on top of the fitted (graph) overhead once more
    eager = shape.num_layers * hw.layer_overhead_s
    out["routed"] = (base.total_s + moved / hw.pcie_h2d_bytes_per_s + decode + L * ROUTED_LAYER_SYNC_S
                     + misses * ROUTED_MISS_HOST_S + eager)
    # path (b): the host misses read over PCIe (a compressed host tier's decoded as they are read: the slower of the
    # two rates), then the compressed GPU tier's decoded, on the same stream
    if tiers.host_compressed:
        comp_decode = (misses - host_misses) * eb / hw.lossless_decode_bytes_per_s
        host_s = max(moved / (UVA_DECODE_PCIE_SHARE * UVA_PCIE_SHARE * hw.pcie_h2d_bytes_per_s),
                     host_misses * eb / hw.lossless_decode_bytes_per_s)
    else:
        comp_decode, host_s = decode, moved / (UVA_PCIE_SHARE * hw.pcie_h2d_bytes_per_s)
    out["routed_uva"] = base.total_s + host_s + comp_decode + L * ROUTED_UVA_LAYER_S
    return out


def stream_step_s(shape: ModelShape, hw: HardwareProfile, num_gpu_experts: int, num_tokens: int,
                  context_len: float, tiers: FetchTiers = FetchTiers()) -> float:
    """Modelled seconds of a stream step of routed fetching (experts/routed.py) at `num_tokens` tokens, on the
    same footing as fetch_step_s's routed (path (a)): every expert of every MoE layer looked up in the cache, the
    misses (all E at its hit rate) copied and decoded one layer ahead on the copy stream, overlapped with compute
    as stream is (decode_step_cost with that traffic); no per-layer sync; eager (no CUDA graphs) like path (a).
    The fills' host launches (ROUTED_MISS_HOST_S each) run ahead of the copies: they count where they outlast
    the copy side."""
    E = shape.experts_per_gpu
    n = max(0, min(num_gpu_experts, E))
    eb = shape.expert_bytes
    misses, host_misses = cache_misses(shape, n, max(0, min(tiers.num_compressed, E - n)), E)
    decoded = misses - (0.0 if tiers.host_compressed else host_misses)
    traffic = StepTraffic(h2d_bytes=int(host_misses * eb * tiers.host_ratio), decode_out_bytes=int(decoded * eb),
                          decode_in_bytes=int(decoded * eb * LOSSLESS_PLANNING_RATIO))
    cost = decode_step_cost(shape, hw, traffic, num_tokens, context_len)
    host_s = misses * ROUTED_MISS_HOST_S
    return cost.total_s + max(0.0, host_s - max(cost.pcie_s, cost.decode_s)) + shape.num_layers * hw.layer_overhead_s


def stream_step_min_tokens(shape: ModelShape, hw: HardwareProfile, num_gpu_experts: int, max_num_batched_tokens: int,
                           context_len: float, tiers: FetchTiers = FetchTiers(), sync_free_max_seqs: int = 0) -> int:
    """ExpertPlan.stream_min_tokens: the smallest power of two T <= max_num_batched_tokens at which path (a)'s
    modelled step (fetch_step_s's routed) is slower than a stream step's; 0 when none is, when N = E, and when the
    cache's LRU pages (less path (b)'s miss area, min(E, sync_free_max_seqs x A) pages) are fewer than 2 x E: a
    layer's prefetch may not take the E pages of the layer computing, so it would get fewer than E and fall back
    on path (a)."""
    E = shape.experts_per_gpu
    miss_area = miss_rows(E, shape.top_k, sync_free_max_seqs)
    if num_gpu_experts >= E or max(E, cache_pages(shape, num_gpu_experts) - miss_area) < 2 * E:
        return 0
    t = 1
    while t <= max_num_batched_tokens:
        routed = fetch_step_s(shape, hw, num_gpu_experts, t, context_len, tiers)["routed"]
        if routed > stream_step_s(shape, hw, num_gpu_experts, t, context_len, tiers):
            return t
        t *= 2
    return 0


def settle_stream_steps(fetch: str, shape: ModelShape, num_gpu_experts: int, tiers: FetchTiers,
                        max_num_batched_tokens: int, context_len: float, device_type: str,
                        sync_free_max_seqs: int = 0, hw: Optional[HardwareProfile] = None) -> int:
    """ExpertPlan.stream_min_tokens under routed fetching on CUDA (stream_step_min_tokens, with the settled
    ExpertPlan.sync_free_max_seqs); 0 otherwise: off CUDA there is no copy engine to model. --expert-prefetch does
    not change it: prediction serves the path (a) forwards below it, stream steps the larger ones."""
    if fetch != "routed" or device_type != "cuda":
        return 0
    return stream_step_min_tokens(shape, hw or HardwareProfile(), num_gpu_experts, max_num_batched_tokens,
                                  context_len, tiers, sync_free_max_seqs)


def routed_path(costs: dict[str, Optional[float]]) -> str:
    """The routed fetch path of a bucket: uva (CUDA graphs) when possible and modelled faster, else copy."""
    uva = costs.get("routed_uva")
    return "uva" if uva is not None and uva < costs["routed"] else "copy"


def routed_s(costs: dict[str, Optional[float]]) -> float:
    return costs["routed_uva"] if routed_path(costs) == "uva" else costs["routed"]


def choose_fetch(costs: dict[str, Optional[float]]) -> str:
    """resident where every expert fits; else routed (by its faster path) when modelled ROUTED_MARGIN faster
    than stream; else stream."""
    if costs.get("resident") is not None:
        return "resident"
    return "routed" if routed_s(costs) < (1.0 - ROUTED_MARGIN) * costs["stream"] else "stream"


def resolve_fetch(requested: str, paged: bool, compatible: Optional[str], shape: ModelShape, num_gpu_experts: int,
                  num_seqs: int, device_type: str, context_len: float,
                  hw: Optional[HardwareProfile] = None, tiers: FetchTiers = FetchTiers()) -> str:
    """--expert-fetch `requested` settled: "stream" or "routed". `compatible` None when routed fetching can
    take effect with the other flags, else the flag that rules it out (named when routed is asked for).
    auto: the cost model's choice at the batch the engine is sized for (max_num_seqs) on CUDA; off CUDA
    there is no copy engine to model, so stream."""
    if requested == "routed":
        if not paged:
            raise ValueError("--expert-fetch routed pages experts from the host tier; it needs paged placement "
                             "(--expert-placement paged, --num-gpu-experts N or --cpu-moe)")
        if compatible is not None:
            raise ValueError(f"--expert-fetch routed fetches exact experts from the host and lossless tiers; it cannot take effect "
                             f"with {compatible} (use --expert-fetch stream)")
        return "routed"
    if requested == "stream" or not paged or compatible is not None or device_type != "cuda":
        return "stream"
    hw = hw or HardwareProfile()
    choice = choose_fetch(fetch_step_s(shape, hw, num_gpu_experts, num_seqs, context_len, tiers))
    return "routed" if choice == "routed" else "stream"


def fetch_table(shape: ModelShape, hw: HardwareProfile, num_gpu_experts: int, context_len: float,
                batches=PLAN_BATCHES, tiers: FetchTiers = FetchTiers()) -> list[dict]:
    """`pagedmoe plan`'s rows: per batch the modelled step time of each fetch (routed by both paths), the choice,
    and the routed path the bucket gets."""
    rows = []
    for b in batches:
        costs = fetch_step_s(shape, hw, num_gpu_experts, b, context_len, tiers)
        rows.append({"batch": b, **{f"{k}_s": v for k, v in costs.items()}, "choice": choose_fetch(costs),
                     "routed_path": routed_path(costs)})
    return rows


def graph_fetch_max_seqs(shape: ModelShape, hw: HardwareProfile, num_gpu_experts: int, max_num_seqs: int,
                         context_len: float, tiers: FetchTiers = FetchTiers()) -> int:
    """The largest decode bucket up to which every bucket's routed path is uva (the buckets the CUDA graphs
    capture: a prefix of them); 0 when batch 1 already prefers copy. A bucket whose forward would otherwise be a
    stream step (stream_step_min_tokens reaches it, with that bucket's miss area) keeps path (b) only where path
    (b) models faster than the stream step: at many sequences path (b) reads about what a stream step copies,
    without overlapping it with compute (Qwen3 at 60 GiB N=64, 64 clients: 668 ms TPOT against stream-all's 571)."""
    best = 0
    for b in decode_buckets(max_num_seqs):
        costs = fetch_step_s(shape, hw, num_gpu_experts, b, context_len, tiers)
        if routed_path(costs) != "uva":
            break
        if (stream_step_min_tokens(shape, hw, num_gpu_experts, b, context_len, tiers, sync_free_max_seqs=b)
                and stream_step_s(shape, hw, num_gpu_experts, b, context_len, tiers) < costs["routed_uva"]):
            break
        best = b
    return best


def settle_fetch_path(requested: str, fetch: str, shape: ModelShape, num_gpu_experts: int, tiers: FetchTiers,
                      max_num_seqs: int, context_len: float, device_type: str, graphs: bool,
                      interpreter: bool = False, hw: Optional[HardwareProfile] = None) -> int:
    """--expert-fetch-path `requested` settled into ExpertPlan.sync_free_max_seqs: forwards of up to that many
    tokens fetch by path (b) and its decode buckets run in CUDA graphs; 0: path (a) everywhere. uva needs routed
    fetching and a GPU (or Triton's interpreter, for tests); auto: the cost model per bucket on CUDA with graphs,
    else copy."""
    if requested != "auto" and fetch != "routed":
        raise ValueError(f"--expert-fetch-path {requested} picks how routed fetching fetches; it cannot take effect "
                         f"with --expert-fetch {fetch}")
    if requested == "uva":
        if device_type != "cuda" and not interpreter:
            raise ValueError("--expert-fetch-path uva runs a Triton kernel on mapped host memory: it needs a CUDA "
                             "device")
        return max_num_seqs
    if requested == "copy" or fetch != "routed" or device_type != "cuda" or not graphs:
        return 0
    return graph_fetch_max_seqs(shape, hw or HardwareProfile(), num_gpu_experts, max_num_seqs, context_len, tiers)


def routed_host_bytes(shape: ModelShape, num_compressed, host_compression: str) -> float:
    """The host tier under routed fetching: every expert but the compressed GPU tier's, at the planning ratio
    when the host tier is compressed."""
    comp = sum(num_compressed) if isinstance(num_compressed, (tuple, list)) else (num_compressed or 0) * \
        shape.num_moe_layers
    ratio = LOSSLESS_PLANNING_RATIO if host_compression == "lossless" else 1.0
    return (shape.num_expert_slots - comp) * shape.expert_bytes * ratio


def settle_expert_fetch(x, plan, shape: ModelShape, max_num_seqs: int, device_type: str, context_len: float,
                        host_limit: Callable[[], Optional[int]]) -> str:
    """The engine's --expert-fetch: `x` the expert flags (config_sections.ExpertConfig), `plan` the resolved
    ExpertPlan. Routed fetching takes exact host rows only (the first flag that rules it out is named), and
    keeps every expert's master copy in the host tier (the cache may evict any page): over `host_limit()`
    auto falls back on stream and an explicit routed is refused."""
    blocker = next((flag for flag, on in (
        ("--expert-precision " + x.precision, x.precision != "exact"),
        ("--expert-buffers " + x.buffers, x.buffers not in ("auto", "plain")),
        # the fused tier is read by the MoE GEMMs where it lies: routed fetching pages decoded rows
        ("--compressed-gemm " + plan.compressed_gemm, fused_format(plan.compressed_gemm) is not None)) if on), None)
    n = plan.num_gpu_experts
    n = min(n) if isinstance(n, (tuple, list)) else (n or 0)
    tiers = FetchTiers.of_plan(plan.num_compressed, plan.host_compression)
    fetch = resolve_fetch(x.fetch, plan.paged, blocker, shape, n, max_num_seqs, device_type, context_len,
                          tiers=tiers)
    limit = host_limit() if fetch == "routed" else None
    host_bytes = routed_host_bytes(shape, plan.num_compressed, plan.host_compression)
    if limit is not None and host_bytes > limit:
        if x.fetch == "routed":
            raise ValueError(f"--expert-fetch routed holds every expert in host memory (but the compressed GPU "
                             f"tier's: {host_bytes / 2**30:.2f} GiB), above the host memory limit of "
                             f"{limit / 2**30:.2f} GiB: raise --host-memory-gb or use --expert-fetch stream")
        fetch = "stream"
    return fetch
