"""`pagedmoe bench latency`: prefill time and per-step decode time, each decode step next to its HBM floor."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from pagedmoe.bench.common import device_memory_line, environment, write_json
from pagedmoe.bench.engine_args import add_offline_bench_args, device_memory, make_engine, random_prompts
from pagedmoe.bench.roofline import H200_HBM_BYTES_PER_S, decode_step_bytes, measure_hbm_bandwidth


def register(sub) -> None:
    p = sub.add_parser("latency", help="prefill and per-step decode time against the HBM floor",
                       description="Time the prefill of a batch and each decode step after it.")
    add_offline_bench_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[8],
                   help="one or more batch sizes, measured one after the other on the same engine")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the measured requests (default 1.0 with top_p 1.0, as vLLM's bench "
                        "latency; 0: greedy. With random weights greedy decoding repeats its tokens, so routed "
                        "fetching would meet the same experts every step)")
    p.add_argument("--hbm-bandwidth", type=float, default=None,
                   help="bytes/s for the floor (default: measured on the GPU, else the H200 figure)")
    p.set_defaults(func=run)


def run_latency(engine, batch_size: int, input_len: int, output_len: int, hbm_bw: float, seed: int = 0,
                temperature: float = 1.0) -> dict:
    from pagedmoe.sampling_params import SamplingParams

    if batch_size > engine.config.max_num_seqs:
        raise ValueError(f"--batch-size {batch_size} exceeds --max-num-seqs {engine.config.max_num_seqs}")
    if input_len + output_len > engine.max_model_len:
        raise ValueError(f"input + output ({input_len + output_len}) exceeds max_model_len {engine.max_model_len}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    engine.survive_step_oom = False  # a benchmark with a failed step measures nothing: its OOM stops it
    prompts = random_prompts(batch_size + 1, input_len, engine.model.dims.vocab_size, seed)
    # the engine's one generator (seeded by --seed at start-up): one sampling launch per step, as a serving batch
    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("warmup", None, SamplingParams(max_tokens=3, ignore_eos=True), prompt_token_ids=prompts[-1])
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    for i, p in enumerate(prompts[:batch_size]):
        engine.add_request(f"lat-{i}", None, params, prompt_token_ids=p)
    prefill_s, decode = 0.0, []
    # The counters are cumulative and reading one waits for the device, so they are read only before the first
    # decode step and after the last: a read between decode steps would absorb the GPU work still queued (with
    # --async-scheduling, the step in flight) outside the timer, and the step would time only its host work.
    # The request's latency is its wall time from the first step to the last (whose return carries the last
    # token to the host), as vLLM's bench latency times generate(). The per-step times split it only roughly under
    # --async-scheduling: a step returns once the next is launched, and the counter read before the first decode
    # step waits for the prefill.
    start = None
    t_request = time.perf_counter()
    while engine.has_unfinished_requests():
        if not decode:
            start = _expert_counters(engine)
        decode_steps_before = engine.step_time["decode_steps"]
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if engine.step_time["decode_steps"] > decode_steps_before:
            decode.append(dt)
        else:
            prefill_s += dt
    request_s = time.perf_counter() - t_request
    end = _expert_counters(engine)
    per_step = {k: (end[k] - start[k]) / len(decode) if decode else None for k in end}
    dims = engine.model.dims
    num_moe = len(engine.model.moe_layers())
    context = input_len + output_len // 2
    bytes_ = decode_step_bytes(dims, engine.dtype.itemsize, batch_size, context, num_moe,
                               dims.num_layers - num_moe, engine.model.spec.shared_intermediate_size)
    floor = bytes_.total / hbm_bw
    # no decode step (--output-len 1: the prefill step samples the only token): the decode figures are null
    median = statistics.median(decode) if decode else None
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "temperature": temperature,
        "request_latency_s": request_s,
        "prefill_time_s": prefill_s, "prefill_tokens_per_s": batch_size * input_len / prefill_s,
        "decode_steps": len(decode), "median_decode_step_ms": 1e3 * median if decode else None,
        "mean_decode_step_ms": 1e3 * statistics.fmean(decode) if decode else None,
        "decode_floor_ms": 1e3 * floor, "floor_over_measured": floor / median if decode else None,
        "step_bytes": {"experts": bytes_.expert_bytes, "backbone": bytes_.backbone_bytes, "kv": bytes_.kv_bytes},
        "hbm_bytes_per_s": hbm_bw, "decode_step_ms": [1e3 * d for d in decode],
        # issue 21: what paging moved against what the router needed (averages over the decode steps)
        "expert_fetch": engine.expert_plan.fetch,
        # routed: decode batches up to this fetch by path (b) (UVA gather, CUDA graphs); 0: path (a) only
        "expert_fetch_sync_free_max_seqs": engine.expert_plan.sync_free_max_seqs,
        # routed: forwards of at least this many tokens beyond path (b) are stream steps; 0: none
        "expert_fetch_stream_min_tokens": engine.expert_plan.stream_min_tokens,
        "expert_bytes_moved_per_step": per_step["moved"],
        "expert_bytes_decoded_per_step": per_step["decoded"],
        "routed_expert_bytes_per_step": per_step["routed"] * engine.expert_store.expert_numel * engine.dtype.itemsize
        if decode else None,
        # routed fetching only: per decode step, routed (layer, expert) pairs found in the cache / fetched
        **{f"expert_cache_{k}_per_step": per_step[k] for k in ("hits", "misses") if k in per_step},
    }


def _expert_counters(engine) -> dict:
    """Cumulative counters, read after a step: host -> device expert bytes (moved), expert bytes decoded on the
    device (decoded), distinct (layer, expert) pairs routed (routed), and under routed fetching the expert cache's
    hits and misses."""
    pager = engine.pager
    out = {"moved": pager.stats.bytes_h2d if pager is not None else 0,
           "decoded": pager.stats.bytes_decoded if pager is not None else 0,
           "routed": int(engine.activity.distinct_routed)}
    if pager is not None and hasattr(pager, "cache_stats"):
        st = pager.cache_stats()
        out.update(hits=st["hits"], misses=st["misses"])
    return out


def run(args) -> int:
    import torch

    if min(args.batch_size) < 1 or args.input_len < 1 or args.output_len < 1:  # before the model loads
        raise ValueError("--batch-size, --input-len and --output-len must be >= 1")
    engine, config = make_engine(args)
    bw = args.hbm_bandwidth or (measure_hbm_bandwidth() if torch.cuda.is_available() else H200_HBM_BYTES_PER_S)
    results = []
    for batch in args.batch_size:
        r = run_latency(engine, batch, args.input_len, args.output_len, bw, seed=args.seed,
                        temperature=args.temperature)
        results.append(r)
        print(f"Batch {batch}: request latency {r['request_latency_s'] * 1e3:.2f} ms ({args.input_len} in, "
              f"{args.output_len} out; first step to last, wall)")
        print(f"Batch {batch}: prefill {r['prefill_time_s'] * 1e3:.2f} ms for {batch} x {args.input_len} tokens "
              f"({r['prefill_tokens_per_s']:.0f} tokens/s)")
        floor = (f"HBM floor {r['decode_floor_ms']:.3f} ms ({r['step_bytes']['experts'] / 1e9:.2f} GB experts + "
                 f"{r['step_bytes']['backbone'] / 1e9:.2f} GB backbone + {r['step_bytes']['kv'] / 1e9:.2f} GB KV at "
                 f"{bw / 1e12:.2f} TB/s)")
        if r["decode_steps"]:
            print(f"Batch {batch}: decode step (median of {r['decode_steps']}) {r['median_decode_step_ms']:.3f} ms; "
                  f"{floor}; floor/measured = {r['floor_over_measured']:.2f}")
        else:   # nor expert traffic per decode step
            print(f"Batch {batch}: no decode steps (--output-len {args.output_len}: the prefill step samples the "
                  f"only token); {floor}")
            continue
        print(f"Batch {batch}: experts moved {r['expert_bytes_moved_per_step'] / 1e9:.3f} GB/step host->device "
              f"({r['expert_fetch']}), routed {r['routed_expert_bytes_per_step'] / 1e9:.3f} GB/step, decoded on the "
              f"device {r['expert_bytes_decoded_per_step'] / 1e9:.3f} GB/step")
        if "expert_cache_hits_per_step" in r:
            hits, misses = r["expert_cache_hits_per_step"], r["expert_cache_misses_per_step"]
            print(f"Batch {batch}: expert cache {hits:.1f} hits, {misses:.1f} misses per step "
                  f"(hit rate {hits / max(1e-9, hits + misses):.1%})")
    memory = device_memory(engine)
    if memory:
        print(device_memory_line(memory))
    if args.output_json:
        write_json(Path(args.output_json), {"results": results, "device_memory": memory, "config": config,
                                            **environment()})
    return 0
