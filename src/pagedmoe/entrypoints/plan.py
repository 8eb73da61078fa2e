"""`pagedmoe plan [MODEL] --gpu-memory-gb X [X ...]`: the memory split and modelled throughput of each expert
placement, from the model's config.json alone (no weights are read, no GPU is needed).

Budgets are GiB, or `weights+X` / `weights-X` (the model's bf16 weights plus or minus X GiB).
`--num-gpus N [N ...]` plans N GPUs of the same kind as the engine runs them with `--tensor-parallel-size N
--enable-expert-parallel`: each holds its share of the backbone and E / N experts of every layer within its
own `--gpu-memory-gb`, and all run the same sequences; the memory columns are one GPU's, the throughput the
engine's (docs/planner.md). `--tensor-parallel-size N` (with or without `--enable-expert-parallel`) plans one
layout the same way.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


def _env(flag: str, default, conv=str):
    """PAGEDMOE_<FLAG> as the default, as for the engine flags (flags win; a bad value: one line)."""
    from pagedmoe.config import env_default

    return env_default(flag, conv, default)


def register(sub) -> None:
    from pagedmoe.planning.plans import FUSED_TIER_MODELS

    p = sub.add_parser("plan", help="print the memory split and modelled throughput of each expert placement",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder with a config.json "
                                                          "(default: the embedded model)")
    p.add_argument("--gpu-memory-gb", nargs="+", required=_env("gpu_memory_gb", None) is None,
                   default=_env("gpu_memory_gb", None, lambda v: v.split()),
                   help="device budget(s) in GiB, or weights+X / weights-X")
    p.add_argument("--num-gpus", type=int, nargs="+", default=[1],
                   help="GPUs of the same kind, as the engine's --tensor-parallel-size N --enable-expert-parallel "
                        "(backbone sharded, experts split evenly); several values print one plan each (e.g. 1 8)")
    p.add_argument("--tensor-parallel-size", type=int, default=_env("tensor_parallel_size", 1, int),
                   help="plan one rank of the engine's --tensor-parallel-size N: the rank's share of the backbone "
                        "(heads, MLPs), of the experts and of the KV heads, as the engine splits them "
                        "(parallel/sharding.py); its budget is one GPU's")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   default=_env("enable_expert_parallel", False, lambda v: v.lower() in ("1", "true", "yes", "on")),
                   help="with --tensor-parallel-size: whole experts split over the ranks, as the engine does")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (workload)")
    p.add_argument("--output-len", type=int, default=1024, help="output tokens per request (workload)")
    p.add_argument("--max-model-len", type=int, default=_env("max_model_len", None, int),
                   help="longest sequence the KV cache must hold (default: input + output length)")
    p.add_argument("--max-num-seqs", type=int, default=_env("max_num_seqs", 256, int))
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("max_num_batched_tokens", 8192, int))
    p.add_argument("--block-size", type=int, default=_env("block_size", 16, int))
    p.add_argument("--dtype", default=_env("dtype", "auto"), choices=sorted(_DTYPE_BYTES),
                   help="weight and KV dtype (auto: bfloat16, as on the GPU)")
    p.add_argument("--expert-placement", default=_env("expert_placement", None),
                   choices=["resident", "paged", "auto"], help="the placement to mark as selected (default auto)")
    p.add_argument("--num-gpu-experts", type=int, default=_env("num_gpu_experts", None, int),
                   help="resident experts per layer of the selected paged placement")
    p.add_argument("--cpu-moe", action="store_true", default=_env("cpu_moe", False, lambda v: v.lower() in
                                                                   ("1", "true", "yes", "on")),
                   help="select the placement that pages every expert (--num-gpu-experts 0)")
    p.add_argument("--expert-buffers", default=_env("expert_buffers", "vmm"),
                   choices=["vmm", "vmm-ring", "plain", "auto"],
                   help="vmm: resident experts mapped into the buffers (2 MiB slots), copies one layer ahead; "
                        "vmm-ring: the same rows as one ring, copies as early as a row is free; plain: two full "
                        "double buffers (auto = vmm)")
    p.add_argument("--compression-ratio", type=float, default=None,
                   help="model a lossless compressed GPU tier at this size ratio (e.g. 0.68)")
    p.add_argument("--compressed-gemm", default="auto", choices=["auto", "decode", *FUSED_TIER_MODELS],
                   help="as the engine's flag: decode (the compressed tier decoded each step) or a tier the MoE GEMM "
                        "reads in place (issue 23; no decode pass), modelled at its format's ratio unless "
                        "--compression-ratio and its kernel's measured time in bf16 reads: "
                        + ", ".join(f"{gemm} ({ratio}, {time}x)" for gemm, (ratio, time) in FUSED_TIER_MODELS.items())
                        + "; auto: fused-hibyte under --expert-compression lossless where the engine would run it "
                        "(one GPU, bf16, sizes multiples of 64, not --expert-fetch routed), else decode")
    p.add_argument("--fused-compression", action="store_true",
                   help="the same as --compressed-gemm fused (kept for older scripts)")
    p.add_argument("--host-compression", default=_env("host_compression", None), choices=["none", "lossless"],
                   help="lossless: model the host tier held compressed (0.683 of the bytes over PCIe, decoded "
                        "on the GPU); none: raw everywhere; default: raw, and both for routed fetching's "
                        "placements (as the engine)")
    p.add_argument("--expert-fetch", default=_env("expert_fetch", "auto"), choices=["auto", "stream", "routed"],
                   help="as the engine's: auto and routed also weigh placements chosen for routed fetching "
                        "(planning/routed_plan.py); stream: the stream-all search alone")
    p.add_argument("--expert-compression", default=_env("expert_compression", None), choices=["none", "lossless"],
                   help="the compressed GPU tier in routed fetching's placements: none forbids it; default (or "
                        "lossless) allows it when bf16 (the stream-all search models it with --compression-ratio)")
    p.add_argument("--host-memory-gb", type=float, default=_env("host_memory_gb", None, float),
                   help="pinned host memory the host tier may take, in GiB (default: unbounded; the plan may be "
                        "for another machine, unlike the engine, which detects it)")
    p.add_argument("--hardware-json", type=Path, default=None,
                   help="measured rates (HardwareProfile keys); default: the H200 of shared/H200.md")
    p.add_argument("--json", "--output-json", dest="json", type=Path, default=None, help="write the tables here")
    p.set_defaults(func=run_plan)


def parse_budget(text: str, weight_bytes: int) -> int:
    from pagedmoe.planning.kv_sizing import GiB

    t = text.strip().lower().replace(" ", "")
    try:
        if t.startswith("weights"):
            rest = t[len("weights"):]
            budget = int(weight_bytes + (float(rest) * GiB if rest else 0))
        else:
            budget = int(float(t) * GiB)
    except (ValueError, OverflowError):  # not a number, nan, inf
        raise ValueError(f"--gpu-memory-gb {text!r}: expected GiB (e.g. 64) or weights+X") from None
    if budget <= 0:
        raise ValueError(f"--gpu-memory-gb {text!r} is {budget / GiB:.2f} GiB: it must be > 0")
    return budget


def _rows(shape, inputs, mode: str, num_gpu: Optional[int], compression_ratio: Optional[float]):
    """(label, plan or PlacementBudgetError, is_auto, is_selected) for the table."""
    from pagedmoe.planning.placement import Placement
    from pagedmoe.planning.planner import PlacementBudgetError, plan_memory, plan_placement

    L, E = shape.num_moe_layers, shape.experts_per_gpu
    ns = sorted({0, E // 4, E // 2, (3 * E) // 4, E - 1} | ({num_gpu} if num_gpu is not None else set()))
    rows = []

    def add(label, placement, selected=False):
        try:
            rows.append((label, plan_placement(inputs, placement), False, selected))
        except PlacementBudgetError as e:
            rows.append((label, e, False, selected))

    add("resident", Placement.resident(L, E), mode == "resident" or (mode == "paged" and num_gpu == E))
    for n in ns:
        if 0 <= n < E:
            add(f"paged N={n}" + (" (cpu-moe)" if n == 0 else ""), Placement.uniform(L, E, n),
                mode == "paged" and n == num_gpu)
    kwargs = dict(max_model_len=inputs.max_model_len, block_size=inputs.block_size, workload=inputs.workload,
                  max_num_seqs=inputs.max_num_seqs, max_num_batched_tokens=inputs.max_num_batched_tokens,
                  hw=inputs.hw, buffers=inputs.buffers, compression_ratio=compression_ratio,
                  host_compression_ratio=inputs.host_compression_ratio, host_budget_bytes=inputs.host_budget_bytes,
                  fused_compressed=inputs.fused_compressed, fused_time_factor=inputs.fused_time_factor)
    for auto_mode in (("auto", "paged") if mode == "paged" and num_gpu is None else ("auto",)):
        try:
            plan = plan_memory(shape, inputs.budget_bytes, inputs.activation_bytes, auto_mode, **kwargs)
            label = ("auto: " if auto_mode == "auto" else "paged best: ") + plan.placement.label()
            rows.append((label, plan, auto_mode == "auto", mode == auto_mode))
        except PlacementBudgetError as e:
            rows.append((auto_mode, e, auto_mode == "auto", mode == auto_mode))
    return rows


def format_table(rows) -> str:
    from pagedmoe.planning.kv_sizing import GiB

    # An all-reduce column only for tensor-parallel plans (the one-GPU table is unchanged).
    comm = any(not isinstance(p, Exception) and p.estimate.decode.comm_s > 0 for _, p, _, _ in rows)

    head = (f"  {'placement':<26}{'backbone':>9}{'resident':>9}{'compr':>7}{'host':>7}{'buffers':>8}{'act':>6}"
            f"{'KV':>7}{'KV tokens':>11}{'seqs':>6}{'step ms':>9}{'pcie':>8}{'decode':>7}{'hbm':>7}{'compute':>8}"
            + (f"{'allred':>7}" if comm else "") + f"{'prefill/seq':>12}{'out tok/s':>11}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    for label, plan, is_auto, selected in rows:
        mark = ("*" if is_auto else " ") + (">" if selected else " ")
        if isinstance(plan, Exception):
            if hasattr(plan, "host_tier_bytes"):  # HostBudgetError: the host tier is over --host-memory-gb
                lines.append(f"{mark}{label:<26}does not fit: host tier {g(plan.host_tier_bytes)} > host limit "
                             f"{g(plan.host_budget_bytes)} GiB (~{plan.min_budget_bytes / GiB:.2f} GiB GPU with the "
                             f"overflow resident)")
            else:
                lines.append(f"{mark}{label:<26}does not fit (needs {plan.min_budget_bytes / GiB:.2f} GiB)")
            continue
        d, e = plan.estimate.decode, plan.estimate
        lines.append(
            f"{mark}{label:<26}{g(plan.backbone_bytes):>9}{g(plan.resident_expert_bytes):>9}"
            f"{g(plan.compressed_expert_bytes):>7}{g(plan.host_tier_bytes):>7}{g(plan.buffer_bytes):>8}"
            f"{g(plan.activation_bytes):>6}{g(plan.kv_bytes):>7}{plan.kv_capacity_tokens:>11}{plan.num_seqs:>6}"
            f"{d.total_s * 1e3:>9.1f}{d.pcie_s * 1e3:>8.1f}{d.decode_s * 1e3:>7.1f}{d.hbm_s * 1e3:>7.1f}{d.compute_s * 1e3:>8.1f}"
            + (f"{d.comm_s * 1e3:>7.1f}" if comm else "")
            + f"{e.prefill_s_per_seq * 1e3:>12.1f}{plan.output_throughput:>11.1f}")
    return "\n".join(lines)


def _fetch_rows(shape, hw, rows, context_len: float, host_ratio: float = 0.0, host_ratios=None,
                max_num_batched_tokens: int = 8192, max_num_seqs: int = 256):
    """--expert-fetch's modelled decode step at batch 1, 8, 32 for the selected placement (else the auto pick),
    when it is paged: (label, N, rows of planning/fetch_cost.py::fetch_table, the stream steps' threshold);
    None otherwise. `host_ratios`: the host ratio of rows that differ from `host_ratio` (routed fetching's
    placements), by label."""
    from pagedmoe.planning.fetch_cost import FetchTiers, fetch_table, graph_fetch_max_seqs, stream_step_min_tokens

    pick = next((r for r in rows if r[3] and not isinstance(r[1], Exception)), None) or \
        next((r for r in rows if r[2] and not isinstance(r[1], Exception)), None)
    if pick is None:
        return None
    n = min(pick[1].placement.num_gpu_experts, default=shape.experts_per_gpu)
    if n >= shape.experts_per_gpu:
        return None
    ratio = (host_ratios or {}).get(pick[0], host_ratio)
    tiers = FetchTiers(min(pick[1].placement.num_compressed_experts, default=0), ratio or 1.0)
    return (pick[0], n, fetch_table(shape, hw, n, context_len, tiers=tiers),
            stream_step_min_tokens(shape, hw, n, max_num_batched_tokens, context_len, tiers,
                                   graph_fetch_max_seqs(shape, hw, n, max_num_seqs, context_len, tiers)))


def format_fetch(label: str, n: int, table: list[dict], stream_min_tokens: int = 0) -> str:
    lines = [f"expert fetch for {label.strip()} (N={n}; planning/fetch_cost.py: --expert-fetch auto picks at "
             "max_num_seqs, --expert-fetch-path auto per CUDA-graph bucket): modelled decode step ms"]
    lines.append(f"  {'batch':>6}{'stream':>10}{'routed':>10}{'routed':>10}{'resident':>10}  choice")
    lines.append(f"  {'':>6}{'':>10}{'(copy)':>10}{'(uva)':>10}{'':>10}")
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    for r in table:
        choice = r["choice"] + (f" ({r['routed_path']})" if r["choice"] == "routed" else "")
        lines.append(f"  {r['batch']:>6}{ms(r['stream_s']):>10}{ms(r['routed_s']):>10}{ms(r['routed_uva_s']):>10}"
                     f"{ms(r['resident_s']):>10}  {choice}")
    lines.append(f"  routed fetching's stream steps (every expert prefetched a layer ahead, no sync): forwards of "
                 f"{stream_min_tokens}+ tokens beyond the uva buckets" if stream_min_tokens else
                 "  routed fetching's stream steps: none (path (a) models faster up to max_num_batched_tokens, or "
                 "the cache leaves fewer than 2 x E pages beside path (b)'s miss area)")
    return "\n".join(lines)


def run_plan(args) -> int:
    from pagedmoe.config import resolve_model
    from pagedmoe.planning.cost_model import H200, HardwareProfile
    from pagedmoe.planning.kv_sizing import CUDA_CONTEXT_BYTES, GiB, estimate_activation_bytes, start_up_reserve_bytes
    from pagedmoe.planning.model_shape import ModelShape
    from pagedmoe.entrypoints.plan_routed import format_routed, routed_rows
    from pagedmoe.planning.fetch_cost import PLAN_BATCHES
    from pagedmoe.planning.placement import LOSSLESS_PLANNING_RATIO
    from pagedmoe.planning.planner import PlanInputs
    from pagedmoe.planning.plans import fused_tier_model
    from pagedmoe.planning.resolve import AUTO_FUSED_GEMM, planning_buffer_kind, resolve_placement_flags

    mode, num_gpu = resolve_placement_flags(args.expert_placement, args.num_gpu_experts, args.cpu_moe)
    hw = HardwareProfile.from_json(args.hardware_json) if args.hardware_json else H200
    path = resolve_model(args.model)
    if args.tensor_parallel_size > 1 and args.num_gpus != [1]:
        raise ValueError("--num-gpus N plans the engine's --tensor-parallel-size N --enable-expert-parallel: give "
                         "one of --num-gpus and --tensor-parallel-size")
    for n in args.num_gpus:
        if n < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {n}")
    # (ranks, expert parallel) of each plan: --num-gpus N is the engine's TP = N with experts split over the ranks
    layouts = ([(args.tensor_parallel_size, args.enable_expert_parallel)] if args.num_gpus == [1]
               else [(n, n > 1) for n in args.num_gpus])
    shapes = [ModelShape.from_hf_config(path, dtype_bytes=_DTYPE_BYTES[args.dtype], tensor_parallel_size=n,
                                        expert_parallel=ep) for n, ep in layouts]
    shape = shapes[0]
    per_gpu = min(s.experts_per_gpu for s in shapes)
    if num_gpu is not None and not 0 <= num_gpu <= per_gpu:
        raise ValueError(f"--num-gpu-experts {num_gpu} is outside [0, {per_gpu}] for this model"
                         + (" (experts per layer per GPU)" if per_gpu != shape.num_experts else ""))
    if args.host_memory_gb is not None and not args.host_memory_gb > 0:
        raise ValueError(f"--host-memory-gb must be > 0 (GiB of host memory for the pinned host tier), got "
                         f"{args.host_memory_gb}")
    host_budget = None if args.host_memory_gb is None else int(args.host_memory_gb * GiB)
    if args.compression_ratio is not None and not 0 < args.compression_ratio <= 1:
        raise ValueError(f"--compression-ratio must be in (0, 1], got {args.compression_ratio}")
    if args.fused_compression:
        if args.compressed_gemm not in ("auto", "decode", "fused"):
            raise ValueError(f"--fused-compression means --compressed-gemm fused; it cannot be combined with "
                             f"--compressed-gemm {args.compressed_gemm}")
        args.compressed_gemm = "fused"
    if args.compressed_gemm == "auto":   # as planning/resolve.py settles it for the engine
        one_rank = len(shapes) == 1 and shape.tensor_parallel_size == 1 and not args.enable_expert_parallel
        fits = shape.hidden_size % 64 == 0 and shape.moe_intermediate_size % 64 == 0
        args.compressed_gemm = AUTO_FUSED_GEMM if (args.expert_compression == "lossless" and one_rank and fits and
                                                   args.dtype in ("auto", "bfloat16") and
                                                   args.expert_fetch != "routed") else "decode"
    fused_ratio, fused_factor = fused_tier_model(args.compressed_gemm)
    if fused_ratio is not None and args.compression_ratio is None:
        args.compression_ratio = fused_ratio
    max_model_len = args.max_model_len or args.input_len + args.output_len
    act = estimate_activation_bytes(args.max_num_batched_tokens, args.max_num_seqs, shape.hidden_size,
                                    shape.moe_intermediate_size, shape.top_k, shape.vocab_size, shape.dtype_bytes)
    # what the engine keeps out of the KV cache on the GPU beside the activations (planning/kv_sizing.py)
    reserve = start_up_reserve_bytes(act, args.max_num_seqs, shape.hidden_size, shape.moe_intermediate_size,
                                     shape.top_k, shape.vocab_size, shape.dtype_bytes, context_bytes=CUDA_CONTEXT_BYTES)
    act += reserve
    buffers = planning_buffer_kind(args.expert_buffers, cuda=True)   # the plan is for a GPU
    host_ratio = LOSSLESS_PLANNING_RATIO if args.host_compression == "lossless" else 0.0
    for s in shapes:  # every budget checked before anything is printed
        for text in args.gpu_memory_gb:
            parse_budget(text, s.weight_bytes)
    name = shape.name or path
    print(f"pagedmoe plan {name}: {shape.num_layers} layers ({shape.num_moe_layers} MoE) x {shape.num_experts} "
          f"experts, top-{shape.top_k}; weights {shape.weight_bytes / GiB:.2f} GiB (backbone "
          f"{shape.backbone_bytes / GiB:.2f} + experts {shape.all_expert_bytes / GiB:.2f}; one expert "
          f"{shape.expert_bytes / 2**20:.1f} MiB); KV {shape.kv_bytes_per_token / 1024:.1f} KiB/token")
    print(f"workload {args.input_len} in / {args.output_len} out, max_model_len {max_model_len}, max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, {buffers} buffers"
          f"{', host tier compressed (0.683)' if host_ratio else ''}"
          f"{f', host memory limit {args.host_memory_gb:.2f} GiB' if host_budget is not None else ''}; "
          f"{hw.name}: HBM {hw.hbm_bytes_per_s / 1e12:.2f} TB/s, PCIe {hw.pcie_h2d_bytes_per_s / 1e9:.1f} GB/s, "
          f"GEMM {hw.gemm_flops / 1e12:.0f} TFLOP/s, step overhead {hw.step_overhead_s * 1e3:.1f} ms + "
          f"{hw.layer_overhead_s * 1e3:.2f} ms/layer + {hw.seq_overhead_s * 1e6:.0f} us/sequence")
    print(f"activations include {reserve / GiB:.2f} GiB the engine reserves on the GPU (CUDA context, graph pools, "
          "workspaces, fragmentation): --gpu-memory-gb is all device memory the process holds")
    print("GiB columns; step = modelled decode step (max of the floors + pipeline fill + overhead); "
          "* = auto pick, > = selected by the flags")
    report = {"model": name, "shape": shape.to_dict(), "hardware": json.loads(hw.to_json()),
              "workload": {"input_len": args.input_len, "output_len": args.output_len},
              "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
              "buffers": buffers, "compression_ratio": args.compression_ratio,
              "compressed_gemm": args.compressed_gemm,
              "host_compression": args.host_compression, "host_memory_gb": args.host_memory_gb,
              "selected_mode": mode,
              "selected_num_gpu_experts": num_gpu, "budgets": []}
    first_error = None
    for gpu_shape, text in [(s, t) for s in shapes for t in args.gpu_memory_gb]:
        num_gpus = gpu_shape.tensor_parallel_size
        budget = parse_budget(text, gpu_shape.weight_bytes)
        inputs = PlanInputs(gpu_shape, budget, act, max_model_len, args.block_size,
                            (args.input_len, args.output_len), args.max_num_seqs, args.max_num_batched_tokens, hw,
                            None, None, buffers, host_ratio, host_budget, fused_compressed=fused_ratio is not None,
                            fused_time_factor=fused_factor)
        rows = _rows(gpu_shape, inputs, mode, num_gpu, args.compression_ratio)
        context_len = (args.input_len + args.output_len) / 2
        routed = routed_rows(args, inputs, rows, context_len)
        host_ratios = {}
        if routed is not None:   # routed fetching's placements join the table; * moves to the one auto picks
            picks, chosen = routed
            for p in picks[1:]:
                label = "routed: " + p.label().replace(", host compressed", " +host lz")
                host_ratios[label] = LOSSLESS_PLANNING_RATIO if p.host_compression == "lossless" else 0.0
                rows.append((label, p.plan, p is chosen, p is chosen and mode == "auto"))
            if chosen is not picks[0]:
                rows = [(lb, pl, a and lb in host_ratios, sel and (lb in host_ratios or mode != "auto"))
                        for lb, pl, a, sel in rows]
        if num_gpus > 1 and len(shapes) > 1:
            print(f"\n{num_gpus} x {hw.name}, as the engine runs --tensor-parallel-size {num_gpus} "
                  f"--enable-expert-parallel: each GPU holds its share of the backbone ({gpu_shape.num_heads} "
                  f"attention heads) and {gpu_shape.experts_per_gpu} of {shape.num_experts} experts per layer "
                  f"(weights {gpu_shape.weight_bytes / GiB:.2f} GiB); every GPU runs the same sequences: memory "
                  f"columns per GPU, out tok/s of the engine; budget {budget / GiB:.2f} GiB per GPU ({text}):")
        elif len(args.num_gpus) > 1:
            print(f"\n1 x {hw.name}: budget {budget / GiB:.2f} GiB ({text}):")
        else:
            print(f"\nbudget {budget / GiB:.2f} GiB ({text}):")
        print(format_table(rows))
        if routed is not None:
            print(format_routed(*routed, args.max_num_seqs, context_len))
        fetch = _fetch_rows(gpu_shape, hw, rows, context_len, host_ratio, host_ratios, args.max_num_batched_tokens,
                            args.max_num_seqs)
        if fetch is not None:
            print(format_fetch(*fetch))
        selected = [r for r in rows if r[3]]
        if selected and isinstance(selected[0][1], Exception) and first_error is None:
            first_error = selected[0][1]
        report["budgets"].append({
            "num_gpus": num_gpus, "experts_per_gpu": gpu_shape.experts_per_gpu,
            "budget_bytes": budget, "budget_gib": budget / GiB, "budget_arg": text,
            "fetch": None if fetch is None else {"label": fetch[0], "num_gpu_experts": fetch[1], "batches": fetch[2],
                                                 "stream_min_tokens": fetch[3]},
            "routed_search": None if routed is None else [
                {"origin": p.origin, "label": p.label(), "fetch": p.fetch, "host_compression": p.host_compression,
                 "num_seqs": p.num_seqs, "step_ms": p.step_s * 1e3, "chosen": p is routed[1],
                 "batches_ms": p.steps_ms(PLAN_BATCHES, context_len)} for p in routed[0]],
            "rows": [{"label": label, "auto": is_auto, "selected": sel, "fits": not isinstance(plan, Exception),
                      **({"min_budget_bytes": plan.min_budget_bytes, "error": str(plan)}
                         if isinstance(plan, Exception) else plan.to_dict())}
                     for label, plan, is_auto, sel in rows]})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    if first_error is not None:
        raise first_error
    sys.stdout.flush()
    return 0
