"""`pagedmoe bench throughput`: offline throughput on random token prompts (vLLM's output line)."""
from __future__ import annotations

import time
from pathlib import Path

from tqdm.auto import tqdm

from pagedmoe.bench.common import environment, write_json
from pagedmoe.bench.engine_args import add_offline_bench_args, make_engine, random_prompts


def register(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (requests/s, tokens/s)",
                       description="Offline throughput on random token prompts with ignore_eos.")
    add_offline_bench_args(p)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.set_defaults(func=run)


def run_throughput(engine, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   show_progress: bool = True) -> dict:
    from pagedmoe.sampling_params import SamplingParams

    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    prompts = random_prompts(num_prompts, input_len, engine.model.dims.vocab_size, seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    _warm_up(engine, input_len)
    stats_before = engine.get_stats()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", None, params, prompt_token_ids=p)
    bar = tqdm(total=num_prompts, desc="Throughput", disable=not show_progress)
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
    delta = {k: stats[k] - stats_before[k] for k in stats if k.startswith("step_") or k == "num_preemptions_total"}
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
        "kv_capacity_tokens": engine.plan.kv_capacity_tokens,
    }


def _warm_up(engine, input_len: int) -> None:
    """One short request, so kernel compilation stays out of the timing."""
    from pagedmoe.sampling_params import SamplingParams

    prompt = random_prompts(1, min(input_len, engine.max_model_len - 4), engine.model.dims.vocab_size, 1)[0]
    engine.add_request("warmup", None, SamplingParams(max_tokens=3, ignore_eos=True), prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()


def run(args) -> int:
    engine, config = make_engine(args)
    r = run_throughput(engine, args.num_prompts, args.input_len, args.output_len, seed=args.seed)
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    if args.output_json:
        write_json(Path(args.output_json), {**r, "config": {**config, "num_prompts": args.num_prompts,
                                                            "input_len": args.input_len,
                                                            "output_len": args.output_len},
                                            **environment()})
    return 0
