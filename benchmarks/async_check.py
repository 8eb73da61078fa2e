"""Does a batch-1 decode under --async-scheduling wait for the GPU? Runs one request (greedy, ignore_eos) and
prints the host time of each engine.step(), the wall time with a device sync at the end, and the tokens (compare
a plain run's with an async run's).

    python benchmarks/async_check.py benchmarks/configs/qwen3-30b-a3b --load-format dummy --expert-placement resident \
        --input-len 512 --output-len 64 --max-model-len 2048 [--async-scheduling]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedmoe.bench.engine_args import add_offline_bench_args, make_engine, random_prompts
from pagedmoe.sampling_params import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_bench_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    engine, _ = make_engine(args)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    prompt = random_prompts(1, args.input_len, engine.model.dims.vocab_size, 0)[0]
    for name in ("warmup", "run"):
        engine.add_request(name, None, SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True),
                           prompt_token_ids=prompt)
        steps, tokens = [], []
        sync()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
            steps.append(time.perf_counter() - t)
        host = time.perf_counter() - t0
        sync()
        wall = time.perf_counter() - t0
        engine.reset_prefix_cache()
    print(json.dumps({"async": engine.config.async_scheduling, "steps": len(steps), "tokens": len(tokens),
                      "median_step_ms": 1e3 * statistics.median(steps), "host_s": host, "wall_s": wall,
                      "ids": tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
