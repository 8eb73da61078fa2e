"""Where a decode step's time goes: kernel time per kernel class (torch profiler, CUPTI) and wall time per step.

Runs the engine to a steady decode batch of B sequences, then profiles N decode steps and prints, per kernel
class (MoE GEMMs, attention, norms, rope, routing, GEMMs of the backbone, copies, other), the GPU time per
step, the number of launches per step, and the share of the step's wall time; last, the wall time of a step
against the sum of its kernels (the gap is host work or idle GPU), and the time per step of steps run back
to back without a sync (as in a throughput run: with --async-scheduling the host work hides behind the
GPU there, so it approaches the kernels' sum). One JSON per batch size under --out.

    python benchmarks/profile_step.py benchmarks/configs/qwen3-30b-a3b --load-format dummy \
        --expert-placement resident --batch-size 1 256 --input-len 512 --max-model-len 2048 --out $OUT/prof

Engine flags are pagedmoe's own (`pagedmoe bench latency --help`). Issue 25 uses this for the step-time
breakdown before and after.

`--prefill`: the same breakdown for prefill steps instead: each profiled step prefills fresh prompts of
--input-len tokens filling --max-num-batched-tokens, and the step's time is set against its compute floor
(FLOPs of the active weights and the causal attention, the lm_head at each prompt's last token only as the engine
computes it: planning/model_shape.py::step_flops, at --gemm-tflops; before 2026-12-07 the floor counted the lm_head
at every token, 10% too high for Qwen3-30B-A3B at 8 x 1024):

    python benchmarks/profile_step.py benchmarks/configs/qwen3-30b-a3b --load-format dummy \
        --expert-placement resident --prefill --input-len 1024 --max-model-len 2048 --out $OUT/prof
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import torch

from pagedmoe.bench.engine_args import add_offline_bench_args, make_engine, random_prompts
from pagedmoe.sampling_params import SamplingParams

# First matching pattern names the class; kernel names come from Triton (our own *_kernel bodies),
# cuBLAS/CUTLASS and torch's elementwise/reduction kernels. The fused ops' kernels: fused_add_rmsnorm_kernel
# counts as norm, router_topk_kernel as router.
CLASSES = [
    ("qk-rope-kv", r"qk_norm_rope"),  # --fused-ops: q/k norm + RoPE + KV write in one kernel (kernels/qk_norm_rope.py)
    ("moe", r"fused_moe|moe_|grouped|expert|silu_and_mul|topk_sum"),
    ("attention", r"paged_|attention|attn|flash|softmax_kernel|sdpa"),
    ("kv-write", r"kv_write|reshape_and_cache|index_put|scatter"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("router", r"topk|sort|argsort|cumsum|align"),
    ("gemm", r"gemm|cutlass|cublas|sm90_xmma|nvjet|matmul|mm_"),
    ("copy", r"memcpy|memset|copy|cat_|fill"),
    ("sampling", r"argmax|multinomial|exponential|log_softmax|max_"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pat in CLASSES:
        if re.search(pat, low):
            return cls
    return "other"


def steady_batch(engine, batch: int, input_len: int, output_len: int, seed: int) -> None:
    vocab = engine.model.dims.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, input_len, vocab, seed)):
        engine.add_request(f"prof-{batch}-{i}", None, params, prompt_token_ids=p)
    while engine.step_time["decode_steps"] == 0 or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(5):  # warm decode steps (graph capture happened at start-up)
        engine.step()


def pipelined_step_s(engine, num_steps: int) -> float:
    """Seconds per decode step with no sync between steps: what a throughput run's step costs."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    sync()
    return (time.perf_counter() - t0) / num_steps


def profile_steps(engine, num_steps: int) -> tuple[list[float], dict]:
    return profile_steps_of(engine.step, num_steps)


def profile_steps_of(step, num_steps: int) -> tuple[list[float], dict]:
    """Wall time of each of num_steps calls of step() (synchronised) and the kernels' time per class."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            with torch.profiler.record_function(STEP_MARK):
                step()
                sync()
            walls.append(time.perf_counter() - t0)
    if cuda:
        print_gaps(gpu_gaps(prof.events()), num_steps)
    per_class = defaultdict(lambda: {"us": 0.0, "launches": 0, "kernels": defaultdict(float)})
    for evt in prof.events():
        # on a CPU-only machine (smoke runs) the CPU ops stand in for kernels
        if cuda and (evt.device_type != torch.autograd.DeviceType.CUDA or evt.name == STEP_MARK):
            continue
        top_level = evt.cpu_parent is None or evt.cpu_parent.name == STEP_MARK
        if not cuda and (not top_level or not evt.name.startswith("aten::")):
            continue
        us = (evt.device_time if hasattr(evt, "device_time") else evt.cuda_time) if cuda else evt.cpu_time
        c = per_class[kernel_class(evt.name)]
        c["us"] += us
        c["launches"] += 1
        c["kernels"][evt.name[:90]] += us
    return walls, per_class


STEP_MARK = "profile_step.step"
GAP_MIN_US = 20.0   # idle stretches of the GPU shorter than this are launch spacing, not stalls


def gpu_gaps(events) -> dict:
    """Where each profiled step's GPU stood idle: from the step's start (host) to its first kernel (lead), between
    its kernels (idle: the union of kernel intervals subtracted, stretches >= GAP_MIN_US listed with the
    kernels either side), and from its last kernel to the step's end (tail, the host's sync and bookkeeping)."""
    cuda = torch.autograd.DeviceType.CUDA
    steps = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.name == STEP_MARK and e.device_type != cuda)
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == cuda and e.name != STEP_MARK)
    out = {"lead_us": 0.0, "idle_us": 0.0, "tail_us": 0.0, "small_idle_us": 0.0, "gaps": []}
    for s0, s1 in steps:
        ks = [k for k in kernels if s0 <= k[0] <= s1]
        if not ks:
            continue
        out["lead_us"] += ks[0][0] - s0
        busy_end, prev = ks[0][1], ks[0][2]
        for k0, k1, name in ks[1:]:
            gap = k0 - busy_end
            if gap >= GAP_MIN_US:
                out["idle_us"] += gap
                out["gaps"].append((gap, prev[:50], name[:50]))
            elif gap > 0:
                out["small_idle_us"] += gap
            if k1 > busy_end:
                busy_end, prev = k1, name
        out["tail_us"] += max(0.0, s1 - busy_end)
    out["gaps"].sort(reverse=True)
    return out


def print_gaps(g: dict, num_steps: int) -> None:
    print(f"GPU idle per step: lead (step start to first kernel) {g['lead_us'] / num_steps / 1e3:.3f} ms, "
          f"stalls >= {GAP_MIN_US:g} us {g['idle_us'] / num_steps / 1e3:.3f} ms "
          f"({len(g['gaps']) / num_steps:.1f} a step), shorter gaps {g['small_idle_us'] / num_steps / 1e3:.3f} ms, "
          f"tail (last kernel to step end) {g['tail_us'] / num_steps / 1e3:.3f} ms")
    for gap, before, after in g["gaps"][:8]:
        print(f"  {gap:9.1f} us idle after {before} before {after}")


def prefill_profile(engine, args) -> int:
    """Profile --num-steps prefill steps of fresh prompts (max_tokens 1: each request ends with its prefill)."""
    from pagedmoe.config import default_model_path
    from pagedmoe.planning.model_shape import ModelShape

    per_step = max(1, engine.config.max_num_batched_tokens // args.input_len)
    tokens = per_step * args.input_len
    vocab = engine.model.dims.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seq = iter(range(10 ** 9))

    def one_step() -> None:
        for p in random_prompts(per_step, args.input_len, vocab, args.seed + next(seq)):
            engine.add_request(f"prefill-{next(seq)}", None, params, prompt_token_ids=p)
        while engine.has_unfinished_requests():
            engine.step()

    def back_to_back() -> float:
        """Mean wall of --num-steps prefill steps queued at once and run back to back (the throughput run's
        measure: with --async-scheduling a step's host work overlaps the step before it on the GPU)."""
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        for p in random_prompts(per_step * args.num_steps, args.input_len, vocab, args.seed + next(seq)):
            engine.add_request(f"prefill-{next(seq)}", None, params, prompt_token_ids=p)
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync()
        # per prefill step: per_step whole prompts fill each (an async engine's last call only collects)
        return (time.perf_counter() - t0) / args.num_steps

    def timed() -> list[float]:
        one_step()  # warm-up (Triton compiles)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        out = []
        for _ in range(args.num_steps):
            sync()
            t0 = time.perf_counter()
            one_step()
            sync()
            out.append(time.perf_counter() - t0)
        return out

    # The wall time set against the floor is that of steps run without the profiler: recording every host op
    # slows the eager prefill's ~2-3k launches, so the profiled steps' wall (reported beside it) is longer.
    graphs = engine.runner.prefill_graphs
    replays = graphs.replays if graphs is not None else None
    walls = timed()
    pipelined = back_to_back()
    eager_walls = None
    if graphs is not None:   # the same steps with the prefill CUDA graphs set aside: the eager prefill's wall
        replays = graphs.replays - replays
        engine.runner.prefill_graphs = None
        eager_walls = timed()
        engine.runner.prefill_graphs = graphs
    profiled_walls, per_class = profile_steps_of(one_step, args.num_steps)
    if args.host_profile:
        host_profile(one_step, args.num_steps, Path(args.out) / "host_prefill.txt" if args.out else None)
    shape = ModelShape.from_hf_config(engine.config.model or default_model_path())
    # causal: the mean context is half the prompt; logits only at each prompt's last token (one row a prompt)
    flops = shape.step_flops(tokens, args.input_len / 2, sampled_rows=per_step)
    floor = flops / (args.gemm_tflops * 1e12)
    wall = sorted(walls)[len(walls) // 2]
    profiled = sorted(profiled_walls)[len(profiled_walls) // 2]
    gpu_us = sum(c["us"] for c in per_class.values()) / args.num_steps
    print(f"\n=== prefill {per_step} x {args.input_len} = {tokens} tokens: wall {wall * 1e3:.3f} ms per step "
          f"(median; {profiled * 1e3:.3f} under the profiler), kernels {gpu_us / 1e3:.3f} ms; compute floor "
          f"{floor * 1e3:.3f} ms ({flops / 1e12:.2f} TFLOP at {args.gemm_tflops:g} TFLOP/s): floor / wall = "
          f"{floor / wall:.2f}, {tokens / wall:,.0f} tokens/s")
    print(f"back to back ({args.num_steps * per_step} prompts queued at once, async scheduling "
          f"{'on' if engine._async is not None else 'off'}): {pipelined * 1e3:.3f} ms per step, "
          f"floor / wall {floor / pipelined:.2f}")
    if eager_walls is not None:
        eager = sorted(eager_walls)[len(eager_walls) // 2]
        print(f"prefill CUDA graphs: {replays} replays in {args.num_steps + 1} steps; the same steps eager "
              f"(--prefill-graph-tokens 0): wall {eager * 1e3:.3f} ms (median), floor / wall {floor / eager:.2f}")
    print_classes(per_class, args.num_steps, wall * 1e6)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile_prefill_{tokens}.json").write_text(json.dumps({
            "prefill_tokens": tokens, "prompts_per_step": per_step, "input_len": args.input_len,
            "wall_ms": [1e3 * w for w in walls], "profiled_wall_ms": [1e3 * w for w in profiled_walls],
            "back_to_back_ms": pipelined * 1e3,
            "prefill_graph_replays": replays,
            "eager_wall_ms": None if eager_walls is None else [1e3 * w for w in eager_walls],
            "kernel_ms_per_step": gpu_us / 1e3, "floor_ms": floor * 1e3,
            "tflop_per_step": flops / 1e12, "gemm_tflops": args.gemm_tflops, "classes": class_record(per_class, args.num_steps)},
            indent=1, default=str))
    return 0


def host_profile(step, num_steps: int, path) -> None:
    """Host time per function over num_steps calls of step() (cProfile): where a host-bound step's gap goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(num_steps):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    print(buf.getvalue())
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(buf.getvalue())


def print_classes(per_class: dict, num_steps: int, wall_us: float) -> None:
    print(f"{'class':<12} {'ms/step':>9} {'launches/step':>14} {'share':>7}  top kernel")
    for cls, c in sorted(per_class.items(), key=lambda kv: -kv[1]["us"]):
        top = max(c["kernels"].items(), key=lambda kv: kv[1])[0]
        print(f"{cls:<12} {c['us'] / num_steps / 1e3:9.3f} {c['launches'] / num_steps:14.1f} "
              f"{c['us'] / num_steps / wall_us:7.1%}  {top[:60]}")


def class_record(per_class: dict, num_steps: int) -> dict:
    return {cls: {"ms_per_step": c["us"] / num_steps / 1e3, "launches_per_step": c["launches"] / num_steps,
                  "kernels_ms_per_step": {k: v / num_steps / 1e3 for k, v in
                                          sorted(c["kernels"].items(), key=lambda kv: -kv[1])}}
            for cls, c in sorted(per_class.items(), key=lambda kv: -kv[1]["us"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_bench_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 256])
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--out", default=None, help="folder for one JSON per batch size")
    p.add_argument("--host-profile", action="store_true",
                   help="also run --num-steps steps under cProfile and print the host functions by own time")
    p.add_argument("--prefill", action="store_true", help="profile prefill steps instead of decode steps")
    p.add_argument("--gemm-tflops", type=float, default=753.0,
                   help="the compute floor's rate (../shared/H200.md: bf16 GEMM 8192^3, 753 TFLOP/s)")
    args = p.parse_args()
    engine, config = make_engine(args)
    if args.prefill:
        return prefill_profile(engine, args)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    from pagedmoe.kernels.pdl import enabled as pdl_enabled

    pdl_on = pdl_enabled(engine.device)
    for batch in args.batch_size:
        steady_batch(engine, batch, args.input_len, args.output_len, args.seed)
        pipelined = pipelined_step_s(engine, args.num_steps)
        walls, per_class = profile_steps(engine, args.num_steps)
        if args.host_profile:
            host_profile(engine.step, args.num_steps, out / f"host_b{batch}.txt" if out else None)
        while engine.has_unfinished_requests():  # drain before the next batch size
            for rid in list(engine.requests):
                engine.abort_request(rid)
            engine.step()
        wall_us = 1e6 * sum(walls) / len(walls)
        gpu_us = sum(c["us"] for c in per_class.values()) / args.num_steps
        print(f"\n=== batch {batch}: wall {wall_us / 1e3:.3f} ms per decode step (median "
              f"{1e3 * sorted(walls)[len(walls) // 2]:.3f}), kernels {gpu_us / 1e3:.3f} ms, gap "
              f"{(wall_us - gpu_us) / 1e3:.3f} ms; steps back to back (one sync at the end, as a throughput "
              f"run; --async-scheduling overlaps host and GPU there): {pipelined * 1e3:.3f} ms per step")
        if pdl_on:
            print("PDL on (kernels/pdl.py): a kernel's time includes its wait for the one before, so the classes "
                  "overlap and their sum exceeds the step; PAGEDMOE_PDL=0 gives a breakdown that adds up")
        print_classes(per_class, args.num_steps, wall_us)
        if out:
            record = {"batch_size": batch, "num_steps": args.num_steps, "wall_ms": [1e3 * w for w in walls],
                      "pdl": pdl_on,
                      "pipelined_ms_per_step": 1e3 * pipelined,
                      "kernel_ms_per_step": gpu_us / 1e3, "config": config,
                      "classes": class_record(per_class, args.num_steps)}
            (out / f"profile_b{batch}.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
