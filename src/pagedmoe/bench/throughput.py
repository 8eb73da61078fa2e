"""`pagedmoe bench throughput`: offline throughput on random token prompts (vLLM's output line)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from pagedmoe.bench.common import device_memory_line, environment, write_json
from pagedmoe.bench.engine_args import add_offline_bench_args, device_memory, make_engine, random_prompts


def register(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (requests/s, tokens/s)",
                       description="Offline throughput on random token prompts with ignore_eos.")
    add_offline_bench_args(p)
    p.add_argument("--num-prompts", type=int, default=1000)
    add_steady_arg(p)
    p.set_defaults(func=run)


def add_steady_arg(p) -> None:
    p.add_argument("--steady-decode-steps", type=int, default=0, metavar="N",
                   help="instead of the full run: fill the KV cache with as many sequences as the workload "
                        "keeps in flight (KV tokens // (input+output)), time N decode steps with the cache full, "
                        "and project the full run's throughput (for runs too long to finish; 0 = full run)")


def run_throughput(engine, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   show_progress: bool = True) -> dict:
    from pagedmoe.sampling_params import SamplingParams

    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    engine.survive_step_oom = False  # a benchmark with a failed step measures nothing: its OOM stops it
    prompts = random_prompts(num_prompts, input_len, engine.model.dims.vocab_size, seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True,
                            output_kind="final_only")
    warm_up(engine, input_len)
    stats_before = engine.get_stats()
    experts_before = engine.expert_stats()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", None, params, prompt_token_ids=p)
    bar = tqdm(total=num_prompts, desc="Processed prompts",  # vLLM's; not a second "Throughput:" line
               disable=not show_progress or os.environ.get("PAGEDMOE_NO_PROGRESS") is not None)
    num_output = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_output += len(out.outputs[0].token_ids)
                bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    stats = engine.get_stats()
    num_input = num_prompts * input_len
    delta = {k: stats[k] - stats_before[k] for k in stats
             if k.startswith("step_") or k in ("num_preemptions_total", "num_swapped_preemptions_total")}
    return {
        "elapsed_time": elapsed,
        "num_requests": num_prompts,
        "total_num_tokens": num_input + num_output,
        "num_output_tokens": num_output,
        "requests_per_second": num_prompts / elapsed,
        "tokens_per_second": (num_input + num_output) / elapsed,
        "output_tokens_per_second": num_output / elapsed,
        "prefill_time_s": delta["step_prefill_s"],
        "decode_time_s": delta["step_decode_s"],
        "decode_steps": delta["step_decode_steps"],
        "mean_decode_step_ms": 1e3 * delta["step_decode_s"] / max(1, delta["step_decode_steps"]),
        "mean_decode_batch": delta["step_decode_tokens"] / max(1, delta["step_decode_steps"]),
        "num_preemptions": delta["num_preemptions_total"],
        "num_swapped_preemptions": delta["num_swapped_preemptions_total"],
        "prefill_step_tokens": delta["step_prefill_tokens"],
        "kv_capacity_tokens": engine.plan.kv_capacity_tokens,
        "expert_traffic": _expert_delta(experts_before, engine.expert_stats()),
        "expert_traffic_summary": engine.expert_traffic_summary(experts_before),
    }


def run_steady_state(engine, input_len: int, output_len: int, decode_steps: int, seed: int = 0,
                     max_seqs: int | None = None, timing_steps: int = 8) -> dict:
    """Steady-state throughput of the (input_len, output_len) workload, for runs too long to finish.

    The full run keeps n = KV tokens // (input_len + output_len) sequences in flight (capped by
    max_num_seqs and `max_seqs`). This admits n prompts long enough that after the fill phase (prefill
    chunks, each also decoding the sequences already prefilled) and `decode_steps` more decode steps each
    sequence holds about input_len + output_len tokens: the window is the end of a full run, KV cache full.
    Times those decode steps (each one decode token for all n sequences), then `timing_steps` more with
    the decode CUDA graphs off: a graph replay cannot time the pager's copies per layer, an eager step
    records CUDA events (copy stream busy, compute stream waiting). Then aborts the requests.
    Projected full-run output tokens/s = n * output_len / (prefill of n prompts of input_len, scaled from the
    fill phase + output_len * the window's mean step): the window has the run's longest contexts, so the
    projection errs low."""
    from pagedmoe.sampling_params import SamplingParams

    engine.survive_step_oom = False  # a benchmark with a failed step measures nothing: its OOM stops it
    if input_len < 1 or output_len < 1 or decode_steps < 1:
        raise ValueError("--input-len, --output-len and --steady-decode-steps must be >= 1")
    c, block = engine.config, engine.config.block_size
    per_seq = -(-(input_len + output_len) // block) * block
    n = min(c.max_num_seqs, engine.plan.kv_capacity_tokens // per_seq, max_seqs or c.max_num_seqs)
    if n < 1:
        raise ValueError(f"the KV cache ({engine.plan.kv_capacity_tokens} tokens) cannot hold one sequence of "
                         f"{input_len} + {output_len} tokens")
    fill_steps = -(-n * (input_len + output_len) // c.max_num_batched_tokens) + 1
    prompt_len = input_len + output_len - decode_steps - timing_steps - fill_steps - 1
    if prompt_len < 1:
        raise ValueError(f"--steady-decode-steps {decode_steps} leaves no prompt: input + output must exceed "
                         f"the window plus {fill_steps} fill steps")
    warm_up(engine, input_len)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True,
                            output_kind="final_only")
    before = engine.get_stats()
    start = time.perf_counter()
    ids = [f"steady-{i}" for i in range(n)]
    for rid, p in zip(ids, random_prompts(n, prompt_len, engine.model.dims.vocab_size, seed)):
        engine.add_request(rid, None, params, prompt_token_ids=p)
    requests = [engine.requests[rid] for rid in ids]
    fill_done = 0
    while not all(r.output_token_ids for r in requests) and engine.has_unfinished_requests():
        engine.step()
        fill_done += 1
    fill_s = time.perf_counter() - start
    filled = engine.get_stats()
    window_start = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
    window_s = time.perf_counter() - window_start
    after = engine.get_stats()
    eager = _timed_eager_steps(engine, timing_steps) if timing_steps else None
    for rid in ids:
        engine.abort_request(rid)
    steps = after["step_decode_steps"] - filled["step_decode_steps"]
    tokens = after["step_decode_tokens"] - filled["step_decode_tokens"]
    preempted = after["num_preemptions_total"] - before["num_preemptions_total"]
    if steps != decode_steps or tokens != n * decode_steps:
        early = sum(r.is_finished for r in requests)
        why = (f"; {early} of the {n} sequences finished early: the fill took {fill_done} steps where "
               f"{fill_steps} were planned, so the first ones reached their last token (e.g. a dynamic-precision "
               "cascade slowing admissions)" if early else "")
        raise RuntimeError(f"steady state broken: {steps} decode steps of {tokens} tokens in the window, expected "
                           f"{decode_steps} of {n} ({preempted} preemptions){why}")
    step_s = window_s / decode_steps
    prefill_s = (filled["step_prefill_s"] - before["step_prefill_s"]) * input_len / prompt_len
    projected = n * output_len / (prefill_s + output_len * step_s)
    return {
        "mode": "steady_state", "num_requests": n, "prompt_len": prompt_len, "fill_time_s": fill_s,
        "window_decode_steps": decode_steps, "window_time_s": window_s, "mean_decode_step_ms": 1e3 * step_s,
        "mean_decode_batch": n, "decode_tokens_per_second": n / step_s,
        "kv_cache_usage_at_end": after["kv_cache_usage_perc"], "num_preemptions": preempted,
        "prefill_time_s": prefill_s, "decode_time_s": output_len * step_s,
        "output_tokens_per_second": projected,
        "tokens_per_second": projected * (input_len + output_len) / output_len,
        "requests_per_second": projected / output_len,
        "kv_capacity_tokens": engine.plan.kv_capacity_tokens,
        # the pager's counters over the window alone (bytes moved, copy and wait time)
        "window_expert_stats": _expert_delta(filled, after),
        "eager_timing": eager,
    }


def _expert_delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in b if k.startswith("expert_") and isinstance(b[k], (int, float))}


def _timed_eager_steps(engine, steps: int) -> dict:
    """`steps` decode steps with the CUDA graphs off, so the pager's CUDA events time every layer's copy."""
    runner = engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        before = engine.get_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - t0
        d = _expert_delta(before, engine.get_stats())
    finally:
        runner.graphs = graphs
    copy_s, wait_s, h2d = d.get("expert_copy_s", 0.0), d.get("expert_wait_s", 0.0), d.get("expert_bytes_h2d", 0)
    return {"steps": steps, "mean_step_ms": 1e3 * elapsed / steps, "expert_copy_s": copy_s, "expert_wait_s": wait_s,
            "pcie_h2d_bytes": h2d, "h2d_gb_per_s": h2d / copy_s / 1e9 if copy_s > 0 else None,
            # the share of the copy stream's busy time the compute stream did not wait for
            "overlap_fraction": 1.0 - wait_s / copy_s if copy_s > 0 else None}


def warm_up(engine, input_len: int) -> None:
    """One short request, so kernel compilation stays out of the timing."""
    from pagedmoe.sampling_params import SamplingParams

    prompt = random_prompts(1, min(input_len, engine.max_model_len - 4), engine.model.dims.vocab_size, 1)[0]
    engine.add_request("warmup", None, SamplingParams(max_tokens=3, ignore_eos=True), prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()  # the next warm-up (bench sweep runs two) and the measured run compute in full


def run(args) -> int:
    engine, config = make_engine(args)
    if args.steady_decode_steps:
        r = run_steady_state(engine, args.input_len, args.output_len, args.steady_decode_steps, args.seed,
                             max_seqs=args.num_prompts)
        print(f"Steady state: {r['num_requests']} sequences, {r['mean_decode_step_ms']:.2f} ms per decode step "
              f"over {r['window_decode_steps']} steps (KV cache {100 * r['kv_cache_usage_at_end']:.1f}% used), "
              f"{r['decode_tokens_per_second']:.2f} decode tokens/s; projected full run:")
    else:
        r = run_throughput(engine, args.num_prompts, args.input_len, args.output_len, seed=args.seed)
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    if r.get("expert_traffic_summary"):
        print(r["expert_traffic_summary"])
    memory = device_memory(engine)
    if memory:
        print(device_memory_line(memory))
    if args.output_json:
        write_json(Path(args.output_json), {**r, "device_memory": memory, "config": {**config, "num_prompts": args.num_prompts,
                                                            "input_len": args.input_len,
                                                            "output_len": args.output_len},
                                            **environment()})
    return 0
