"""`pagedmoe bench sweep [MODEL] --budgets ... --placements ...`: offline throughput for every (GPU budget,
expert placement) in one process, with the planner's modelled figures next to each measurement.

Each point builds an engine (`--gpu-memory-gb` = the budget, placement flags from PLACEMENTS), runs the
`bench throughput` workload, records throughput, KV capacity, the step-time breakdown (prefill / decode wall
time, expert copy and wait time, PCIe bytes) and the planner's modelled throughput and decode-step floors for
the placement the engine actually took, then frees the engine before the next point. A placement that cannot
run at a budget is recorded as "does not fit (needs X GiB)" and skipped. Output: DIR/sweep.json and PNG plots
(bench/plots.py). `--replot A.json B.json` merges the points of earlier sweeps (e.g. one per device call)
and redraws, without running anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

from pagedmoe.bench.common import device_memory_line, environment, write_json
from pagedmoe.bench.engine_args import device_memory

logger = logging.getLogger("pagedmoe")

# Placement name -> engine flags (EngineConfig field names). A new placement is one line here, e.g.
# "paged+lossless": {"expert_placement": "paged", "expert_compression": "lossless"}.
PLACEMENTS: dict[str, dict[str, Any]] = {
    "resident": {"expert_placement": "resident"},
    "paged": {"expert_placement": "paged"},
    "auto": {"expert_placement": "auto"},
    "cpu-moe": {"expert_placement": "paged", "cpu_moe": True},
    # the planner's best split with a lossless compressed tier beside the host tier (issue 6), decoded each step
    # (pinned: --compressed-gemm auto would read it in place on a GPU, as paged+lossless-hibyte)
    "paged+lossless": {"expert_placement": "auto", "expert_compression": "lossless", "compressed_gemm": "decode"},
    # the same, the compressed tier in format v2 read by the MoE GEMMs themselves, never decoded (issue 23)
    "paged+lossless-fused": {"expert_placement": "auto", "expert_compression": "lossless", "compressed_gemm": "fused"},
    # the same in format version 3 (codecs/hibyte.py, held tile-major), decoded four weights a word into the MMA
    # operands (bf16 GEMM tolerance), or with the bf16 kernel's sums (-exact: logits bit for bit)
    "paged+lossless-hibyte": {"expert_placement": "auto", "expert_compression": "lossless",
                              "compressed_gemm": "fused-hibyte"},
    "paged+lossless-hibyte-exact": {"expert_placement": "auto", "expert_compression": "lossless",
                                    "compressed_gemm": "fused-hibyte-exact"},
    # the host tier held losslessly compressed: ~0.68 of the PCIe bytes, decoded on the GPU (issue 6)
    "paged+host-lossless": {"expert_placement": "paged", "host_compression": "lossless"},
    # every expert at its own precision rung, moved by the KV pressure controller (issue 7)
    "dynamic": {"expert_placement": "auto", "expert_precision": "dynamic"},
    # every expert int4 on the GPU (lossy, no host tier)
    "static-int4": {"expert_placement": "paged", "expert_precision": "static-int4"},
}
# Flags that fix a paged split: the sweep's --num-gpu-experts etc. apply to "paged" entries only (they would
# contradict resident, and silently turn auto into paged).
_PAGED_ONLY_FLAGS = ("num_gpu_experts", "cpu_moe", "num_compressed_experts")
_NOT_RESIDENT_FLAGS = _PAGED_ONLY_FLAGS + ("expert_compression", "host_compression", "compressed_gemm")


def register(sub) -> None:
    from pagedmoe.bench.throughput import add_steady_arg
    from pagedmoe.config import add_engine_args

    p = sub.add_parser("sweep", help="offline throughput over GPU budgets x expert placements, JSON + plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--budgets", nargs="+", default=None,
                   help="GPU budgets (--gpu-memory-gb of each point): GiB, or weights+X / weights-X")
    p.add_argument("--placements", nargs="+", default=["resident", "paged", "auto"], choices=sorted(PLACEMENTS),
                   help="expert placements to run at every budget (default: resident paged auto)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-dir", type=Path, default=Path("sweep-out"), help="sweep.json and the PNGs go here")
    p.add_argument("--hardware-json", type=Path, default=None,
                   help="rates for the modelled figures (HardwareProfile keys); default: the H200 profile")
    p.add_argument("--replot", nargs="+", type=Path, default=None, metavar="JSON",
                   help="merge the points of these sweep.json files into --output-dir and redraw; runs nothing")
    p.add_argument("--remodel", action="store_true",
                   help="with --replot: recompute each point's modelled figures with the current cost model "
                        "(and --hardware-json), from the placement and activations the engine planned")
    p.add_argument("--no-plots", action="store_true", help="write sweep.json only")
    add_steady_arg(p)
    # --gpu-memory-gb and --expert-placement are what the sweep varies.
    add_engine_args(p, skip=("model", "gpu_memory_gb", "expert_placement"))
    p.set_defaults(func=run)


def placement_flags(name: str) -> dict[str, Any]:
    """EngineConfig overrides for one placement: its PLACEMENTS entry, with the paging flags reset to their
    defaults where they cannot apply (all of them on resident entries, the paged-only ones on auto), so
    the sweep's own --num-gpu-experts etc. reach the paged entries only."""
    from pagedmoe.config import EngineConfig

    entry = dict(PLACEMENTS[name])
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    mode = entry["expert_placement"]
    if mode == "resident" or entry.get("expert_precision", "exact") != "exact":  # lossy precisions place every expert
        reset = _NOT_RESIDENT_FLAGS
    else:
        reset = _PAGED_ONLY_FLAGS if mode != "paged" else ()
    for flag in reset:
        entry.setdefault(flag, defaults[flag])
    return entry


def point_config(args, name: str, budget_bytes: int):
    """The EngineConfig of one point: the sweep's engine flags, the budget, the placement's flags."""
    from pagedmoe.config import engine_config_from_args
    from pagedmoe.planning.kv_sizing import GiB

    return engine_config_from_args(args, model=args.model, gpu_memory_gb=budget_bytes / GiB, **placement_flags(name))


def _placement_fields(config) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("expert_placement", *_NOT_RESIDENT_FLAGS, "expert_precision")}


def _free_engine_memory(closers: list) -> None:
    """Drop the previous engine's device memory before the next point: tensors go with gc, CUDA VMM
    mappings (expert buffers) need an explicit close, cached blocks go back with empty_cache."""
    import torch

    gc.collect()
    for close in closers:
        try:
            close()
        except Exception as e:  # a failed unmap must not hide the sweep's results
            logger.warning("sweep: closing expert buffers failed: %s", e)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # Pinned host-tier blocks stay cached by torch's host allocator too (84 GiB for Mixtral's experts):
        # give them back, or the next paged point may not find host memory for its own.
        empty_host = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                      or getattr(torch._C, "_host_emptyCache", None))
        if empty_host is not None:
            empty_host()


def _pager_counters(stats: dict) -> dict:
    keys = ("expert_bytes_h2d", "expert_bytes_d2d", "expert_bytes_decoded", "expert_copy_s", "expert_wait_s",
            "expert_steps", "expert_timed_bytes_h2d")
    return {k: stats.get(k, 0) for k in keys}


def measure(engine, num_prompts: int, input_len: int, output_len: int, seed: int, steady_steps: int = 0) -> dict:
    """run_throughput plus the pager's counters over the timed part only. run_throughput starts with a
    one-request warm-up; running the same warm-up twice before it (the first compiles, the second is
    warm) gives the warm-up's own counters to subtract. With `steady_steps`, run_steady_state instead
    (num_prompts caps its batch), its breakdown the window's own."""
    from pagedmoe.bench.throughput import warm_up, run_steady_state, run_throughput

    if steady_steps:
        r = run_steady_state(engine, input_len, output_len, steady_steps, seed, max_seqs=num_prompts)
        w, e = r["window_expert_stats"], r["eager_timing"] or {}
        # Copy and wait time per step come from the eager steps (CUDA graph replays are not timed per layer),
        # scaled to the window's steps; bytes are the window's own.
        scale = steady_steps / e["steps"] if e else 0.0
        return {**r, "breakdown": {"prefill_s": r["fill_time_s"], "decode_s": r["window_time_s"],
                                   "expert_copy_s": e.get("expert_copy_s", 0.0) * scale,
                                   "expert_wait_s": e.get("expert_wait_s", 0.0) * scale,
                                   "pcie_h2d_bytes": w.get("expert_bytes_h2d", 0),
                                   "d2d_bytes": w.get("expert_bytes_d2d", 0),
                                   "decoded_bytes": w.get("expert_bytes_decoded", 0),
                                   "pager_steps": w.get("expert_steps", 0)}}
    warm_up(engine, input_len)
    a = _pager_counters(engine.get_stats())
    warm_up(engine, input_len)
    b = _pager_counters(engine.get_stats())
    r = run_throughput(engine, num_prompts, input_len, output_len, seed=seed)
    c = _pager_counters(engine.get_stats())
    pager = {k: max(0, (c[k] - b[k]) - (b[k] - a[k])) for k in c}
    return {**r, "breakdown": {"prefill_s": r["prefill_time_s"], "decode_s": r["decode_time_s"],
                               "expert_copy_s": pager["expert_copy_s"], "expert_wait_s": pager["expert_wait_s"],
                               "pcie_h2d_bytes": pager["expert_bytes_h2d"], "d2d_bytes": pager["expert_bytes_d2d"],
                               "decoded_bytes": pager["expert_bytes_decoded"], "pager_steps": pager["expert_steps"],
                               # the bytes of the eager steps copy_s timed (replays move bytes untimed)
                               "timed_h2d_bytes": pager["expert_timed_bytes_h2d"]}}


def run_point(config, shape, budget_bytes: int, args, hw, closers: list) -> dict:
    """Build one engine, measure it, and leave its memory to _free_engine_memory."""
    import torch

    from pagedmoe.bench.sweep_model import modelled, needs_gib
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.planning.kv_sizing import GiB

    engine = None
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(config)
        load_s = time.perf_counter() - t0
        r = measure(engine, args.num_prompts, args.input_len, args.output_len, args.seed, args.steady_decode_steps)
        device = device_memory(engine, budget_bytes)
        if device:
            logger.info("sweep: %s", device_memory_line(device))
        stats, store = engine.get_stats(), engine.expert_store
        point = {"status": "ok", "load_s": load_s, **r,
                 "num_kv_blocks": engine.plan.num_kv_blocks,
                 "expert_placement": stats["expert_placement"], "experts": stats["experts"],
                 "memory_gib": {"budget": budget_bytes / GiB, "weights": engine.plan.weight_bytes / GiB,
                                "activations": engine.plan.activation_bytes / GiB,
                                "reserve": engine.plan.reserve_bytes / GiB, "kv": engine.plan.kv_bytes / GiB,
                                "resident_experts": store.resident_bytes / GiB,
                                "compressed_experts": store.compressed_bytes / GiB,
                                "host_tier": store.host_bytes / GiB, "expert_buffers": store.buffer_bytes / GiB},
                 **({"device_memory": device} if device else {}),
                 "engine_plan": engine.placement_plan.to_dict() if engine.placement_plan is not None else None,
                 "modelled": modelled(engine, shape, budget_bytes, r["num_requests"], args.input_len,
                                      args.output_len, hw)}
        m = point["modelled"]
        b = r["breakdown"]
        eager = r.get("eager_timing")
        if eager and eager.get("h2d_gb_per_s"):
            point["pcie_h2d_gb_per_s"] = eager["h2d_gb_per_s"]
        elif b["expert_copy_s"] > 0 and b.get("timed_h2d_bytes"):
            point["pcie_h2d_gb_per_s"] = b["timed_h2d_bytes"] / b["expert_copy_s"] / 1e9
        if m.get("fits"):
            point["fraction_of_modelled_throughput"] = r["output_tokens_per_second"] / m["output_throughput"]
            point["decode_step_over_floor"] = r["mean_decode_step_ms"] / m["decode_step_ms"]["floor"]
        return point
    except torch.cuda.OutOfMemoryError as e:
        return {"status": "out_of_memory", "message": str(e).splitlines()[0]}
    except ValueError as e:  # BudgetError / PlacementBudgetError, or a placement this model cannot take
        need = needs_gib(e)
        return {"status": "does_not_fit" if need is not None else "error", "needs_gib": need, "message": str(e)}
    except RuntimeError as e:  # e.g. pinning the host tier failed: keep the other points
        logger.warning("sweep: point failed", exc_info=True)
        return {"status": "error", "message": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    finally:
        buffers = getattr(getattr(engine, "expert_store", None), "buffers", None)
        if hasattr(buffers, "close"):
            closers.append(buffers.close)
        kv = getattr(getattr(engine, "runner", None), "kv_backing", None)
        if kv is not None:
            closers.append(kv.close)
        engine = None


def describe(point: dict) -> str:
    if point["status"] == "ok":
        mem = point.get("device_memory") or {}
        peak = (f", device memory peak {mem['peak_gib']:.2f} GiB ({100 * mem['peak_over_budget']:.1f}% of the budget)"
                if "peak_over_budget" in mem else "")
        return f"{point['output_tokens_per_second']:.2f} output tok/s{peak}"
    if point["status"] == "does_not_fit":
        return f"does not fit (needs {point['needs_gib']:.2f} GiB)"
    return f"{point['status']}: {point.get('message', '')}"


def _peak_columns(point: dict) -> str:
    """The process's peak device memory (the driver's count) and its ratio to the budget; '-' off CUDA."""
    d = point.get("device_memory") or {}
    if "peak_gib" not in d:
        return f"{'-':>9}{'-':>12}"
    return f"{d['peak_gib']:>9.2f}{d['peak_gib'] / point['budget_gib']:>12.3f}"


def format_table(points: list[dict]) -> str:
    head = (f"{'budget GiB':>10}  {'placement':<10}{'out tok/s':>11}{'model tok/s':>12}{'KV tokens':>11}"
            f"{'seqs':>6}{'prefill s':>10}{'decode s':>10}{'step ms':>9}{'copy s':>8}{'wait s':>8}{'H2D GB':>9}"
            f"{'GB/s':>7}{'step/floor':>11}{'peak GiB':>9}{'peak/budget':>12}")
    lines = [head, "-" * len(head)]
    for p in points:
        lead = f"{p['budget_gib']:>10.3f}  {p['placement']:<10}"
        if p["status"] != "ok":
            lines.append(lead + describe(p))
            continue
        b, m = p["breakdown"], p.get("modelled") or {}
        model = f"{m['output_throughput']:>12.1f}" if m.get("fits") else f"{'-':>12}"
        ratio = f"{p['decode_step_over_floor']:>11.2f}" if "decode_step_over_floor" in p else f"{'-':>11}"
        gbps = f"{p['pcie_h2d_gb_per_s']:>7.1f}" if "pcie_h2d_gb_per_s" in p else f"{'-':>7}"
        lines.append(lead + f"{p['output_tokens_per_second']:>11.2f}{model}{p['kv_capacity_tokens']:>11}"
                     f"{p['num_requests']:>6}{b['prefill_s']:>10.2f}{b['decode_s']:>10.2f}"
                     f"{p['mean_decode_step_ms']:>9.1f}{b['expert_copy_s']:>8.2f}"
                     f"{b['expert_wait_s']:>8.2f}{b['pcie_h2d_bytes'] / 1e9:>9.2f}{gbps}{ratio}{_peak_columns(p)}")
    return "\n".join(lines)


def _write_outputs(result: dict, out_dir: Path, plots: bool) -> None:
    path = write_json(out_dir / "sweep.json", result)
    print(format_table(result["points"]))
    print(f"wrote {path}")
    if plots:
        from pagedmoe.bench.plots import plot_sweep

        for png in plot_sweep(result, out_dir):
            print(f"wrote {png}")


def replot(args) -> int:
    """Merge earlier sweeps' points (later files win for the same model, budget and placement) and redraw."""
    from pagedmoe.bench.sweep_model import remodel
    from pagedmoe.planning.cost_model import H200, HardwareProfile

    hw = HardwareProfile.from_json(args.hardware_json) if args.hardware_json else H200
    merged: dict = {}
    configs = []
    for path in args.replot:
        data = json.loads(Path(path).read_text())
        configs.append({"file": str(path), **data.get("config", {}), "git_commit": data.get("git_commit"),
                        "gpu_name": data.get("gpu_name")})
        for p in data["points"]:
            if args.remodel:
                p = remodel(p, data["config"], hw)
            merged[(p.get("model"), round(p["budget_gib"], 6), p["placement"])] = p
    points = sorted(merged.values(), key=lambda p: (str(p.get("model")), p["budget_gib"], p["placement"]))
    _write_outputs({"config": {"merged_from": configs}, "points": points, **environment()}, args.output_dir,
                   not args.no_plots)
    return 0


def run(args) -> int:
    if not args.no_plots:  # before the sweep, not after it
        from pagedmoe.extras import require

        require("matplotlib", "plot", "bench sweep's plots (or pass --no-plots)")
    if args.replot:
        return replot(args)
    import torch

    from pagedmoe.config import resolve_model
    from pagedmoe.planning.kv_sizing import GiB
    from pagedmoe.entrypoints.plan import parse_budget
    from pagedmoe.planning.cost_model import H200, HardwareProfile
    from pagedmoe.planning.model_shape import ModelShape
    from pagedmoe.models.loader import load_hf_config, resolve_dtype

    if not args.budgets:
        raise ValueError("--budgets is required (GiB, or weights+X), unless --replot")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    hw = HardwareProfile.from_json(args.hardware_json) if args.hardware_json else H200
    path = resolve_model(args.model)
    hf_config = load_hf_config(path)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    dtype_bytes = resolve_dtype(args.dtype, device, hf_config).itemsize
    shape = ModelShape.from_hf_config(hf_config, dtype_bytes=dtype_bytes)
    budgets = [(text, parse_budget(text, shape.weight_bytes)) for text in args.budgets]
    # Every point's config up front: a flag error stops the sweep before any engine is built.
    configs = {(text, name): point_config(args, name, b) for text, b in budgets for name in args.placements}
    model_name = shape.name or Path(path).name
    base = dataclasses.asdict(next(iter(configs.values())))
    for key in ("gpu_memory_gb", *_NOT_RESIDENT_FLAGS, "expert_placement"):
        base.pop(key, None)
    config = {"model": model_name, "model_path": path, "budgets": args.budgets, "placements": args.placements,
              "placement_flags": {n: _placement_fields(configs[(budgets[0][0], n)]) for n in args.placements},
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "steady_decode_steps": args.steady_decode_steps,
              "engine": base, "shape": shape.to_dict(), "hardware_model": json.loads(hw.to_json())}
    env = environment()
    points, closers = [], []
    for text, budget in budgets:
        for name in args.placements:
            logger.info("sweep: budget %s (%.3f GiB), placement %s", text, budget / GiB, name)
            point = run_point(configs[(text, name)], shape, budget, args, hw, closers)
            _free_engine_memory(closers)
            closers.clear()
            point = {"model": model_name, "budget_arg": text, "budget_gib": budget / GiB, "budget_bytes": budget,
                     "placement": name, "engine_flags": _placement_fields(configs[(text, name)]), **point}
            points.append(point)
            print(f"[sweep] {model_name} budget {budget / GiB:.3f} GiB ({text}) {name}: {describe(point)}",
                  flush=True)
            # After every point: a sweep stopped by a time limit keeps what it measured.
            write_json(args.output_dir / "sweep.json", {"config": config, "points": points, "complete": False, **env})
    _write_outputs({"config": config, "points": points, "complete": True, **env}, args.output_dir,
                   not args.no_plots)
    return 0 if any(p["status"] == "ok" for p in points) else 1
