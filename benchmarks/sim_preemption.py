"""The engine's scheduler (engine/scheduler.py, the real one) on the whole-GPU throughput workload without a model:
how many prompt tokens preemption makes it recompute, and what a swap space (kvcache/swap.py) saves, on CPU.

Defaults are Mixtral-8x7B's run of `benchmarks/vs_vllm.sh tput-mixtral` on one H200: 512 prompts of 1024 tokens,
1024 out, 256 sequences, 8192 tokens a step, 23763 KV blocks of 16 (380,208 tokens), 128 kB of KV a token. Step
time is a piecewise-linear model from that shape's profiles (7.4 ms at one token, 34.4 ms at 256, 393 ms at 8192),
swaps at 55 GB/s; only its ratios mean anything. With no swap space it reproduced the measured run's counts (2944
decode steps at a mean batch of 167.5 and 151 preemptions, against 2946, 167.5 and 152).

    python benchmarks/sim_preemption.py                  # swap spaces of 0, 2048, 4096, 8192 host blocks
    python benchmarks/sim_preemption.py --host-blocks 0 8192 --kv-blocks 23763
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from pagedmoe.engine.request import Request, RequestStatus  # noqa: E402
from pagedmoe.engine.scheduler import Scheduler  # noqa: E402
from pagedmoe.kvcache.block_pool import KVCacheManager  # noqa: E402
from pagedmoe.kvcache.swap import SwapSpace  # noqa: E402
from pagedmoe.sampling_params import SamplingParams  # noqa: E402


def step_ms(tokens: int) -> float:
    if tokens <= 256:
        return 7.4 + (34.4 - 7.4) * (tokens - 1) / 255
    return 34.4 + (393.0 - 34.4) * (tokens - 256) / (8192 - 256)


def simulate(host_blocks: int, kv_blocks: int, prompts: int, input_len: int, output_len: int, max_seqs: int,
             max_tokens: int, token_bytes: int, block_size: int = 16) -> dict:
    rng = random.Random(0)
    kv = KVCacheManager(kv_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(kv, max_seqs, max_tokens, SwapSpace(host_blocks) if host_blocks else None)
    for i in range(prompts):
        r = Request(str(i), [rng.randrange(32000) for _ in range(input_len)], SamplingParams(max_tokens=output_len),
                    max_tokens=output_len)
        sched.add_request(r)
    t_ms, prefill_tokens, moved = 0.0, 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        prefill_tokens += sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        blocks = sum(len(b) for b, _ in out.swap_out) + sum(len(b) for _, b in out.swap_in)
        moved += blocks * block_size * token_bytes
        t_ms += step_ms(out.num_batched_tokens) + blocks * block_size * token_bytes / 55e6
        sched.update(out.scheduled)
        for s in out.scheduled:
            if s.samples:
                s.request.output_token_ids.append(1)
                if s.request.num_output_tokens >= s.request.max_tokens:
                    sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
    assert kv.num_free_blocks == kv.num_blocks and (sched.swap is None or sched.swap.num_used_blocks == 0)
    return {"host_blocks": host_blocks, "time_s": t_ms / 1e3, "tok_s": prompts * output_len / (t_ms / 1e3),
            "prefill_tokens": prefill_tokens, "recomputed": prefill_tokens - prompts * input_len,
            "preemptions": sched.num_preemptions_total, "swapped": sched.num_swapped_total, "moved_gib": moved / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-blocks", type=int, nargs="+", default=[0, 2048, 4096, 8192])
    ap.add_argument("--kv-blocks", type=int, default=23763)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-bytes-per-token", type=int, default=131072)
    a = ap.parse_args()
    for h in a.host_blocks:
        r = simulate(h, a.kv_blocks, a.num_prompts, a.input_len, a.output_len, a.max_num_seqs,
                     a.max_num_batched_tokens, a.kv_bytes_per_token)
        print(f"host blocks {h:6d}: modelled {r['time_s']:.1f} s ({r['tok_s']:.0f} output tok/s), prompt tokens "
              f"computed {r['prefill_tokens']} ({r['recomputed']} recomputed), {r['preemptions']} preemptions "
              f"({r['swapped']} swapped, {r['moved_gib']:.1f} GiB over PCIe)")


if __name__ == "__main__":
    main()
