"""Host work of one decode step at a large batch, without the model: scheduling, building the step's
inputs, and turning sampled tokens into outputs. On the H200 this work is what the decode step spends beyond
its floors per sequence (~48 us/sequence fitted in docs/benchmarks.md, "Expert paging"); it runs on the
CPU, so this benchmark measures it on any machine.

    python benchmarks/bench_host_overhead.py [--seqs 256] [--context 1024] [--steps 50] [--output-kind K]

Builds an engine on the CPU from the embedded default model (its tokenizer detokenises every token) with `--seqs` running requests of `--context` tokens,
then for `--steps` decode steps times: scheduler.schedule, ModelRunner.prepare (inputs built on the host;
on CUDA they are also copied), the sampler on random logits (device work on a GPU: reported apart), and
the output processing (_finish_step without the sampler). Medians, in ms per step and us per sequence;
last, the part of it that stays between two GPU steps with and without --async-scheduling.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--output-kind", default="cumulative", choices=["cumulative", "final_only"])
    args = p.parse_args()
    from pagedmoe.config import EngineConfig, default_model_path
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.sampling_params import SamplingParams

    torch.set_num_threads(1)
    path = default_model_path()
    max_len = args.context + args.steps + 8
    engine = LLMEngine(EngineConfig(model=path, device="cpu", max_model_len=max_len, max_num_seqs=args.seqs,
                                    max_num_batched_tokens=args.seqs * args.context, num_kv_blocks=args.seqs * (-(-max_len // 16)),
                                    ))
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.steps + 4, ignore_eos=True,
                            **({"output_kind": args.output_kind} if args.output_kind != "cumulative" else {}))
    vocab = engine.model.dims.vocab_size
    gen = torch.Generator().manual_seed(0)
    for i in range(args.seqs):
        ids = torch.randint(10, vocab, (args.context,), generator=gen).tolist()
        engine.add_request(f"r{i}", None, params, prompt_token_ids=ids)
    # Prefill without the model: mark every prompt computed and give each request its first token.
    sched = engine.scheduler.schedule()
    engine.scheduler.update(sched.scheduled)
    for s in sched.scheduled:
        s.request.output_token_ids.append(11)
    times = {"schedule": [], "prepare": [], "sampler (device work on a GPU)": [], "outputs": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        engine.runner.prepare(sched, engine.kv)
        t2 = time.perf_counter()
        logits = torch.randn(len(sched.scheduled), vocab, generator=gen)
        t3 = time.perf_counter()
        sampled = engine.sampler.sample(logits, [s.request.params for s in sched.scheduled],
                                        [None] * len(sched.scheduled))
        t4 = time.perf_counter()
        engine.sampler.sample = lambda *a, **k: sampled  # the outputs timing leaves the sampler out
        engine._finish_step(sched, logits, list(range(len(sched.scheduled))))
        del engine.sampler.sample
        t5 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
            times[key].append(dt)
        assert all(s.num_new_tokens == 1 for s in sched.scheduled) and len(sched.scheduled) == args.seqs
    print(f"host work per decode step, {args.seqs} sequences at ~{args.context} tokens, output_kind "
          f"{args.output_kind} (median of {args.steps}):")
    host = 0.0
    for key, ts in times.items():
        med = statistics.median(ts)
        if not key.startswith("sampler"):
            host += med
        print(f"  {key:<32}{med * 1e3:8.3f} ms {med / args.seqs * 1e6:8.2f} us/seq")
    print(f"  {'host total (without the sampler)':<32}{host * 1e3:8.3f} ms {host / args.seqs * 1e6:8.2f} us/seq")
    # --async-scheduling (engine/async_step.py) launches step N + 1 before it processes step N's tokens:
    # only scheduling and the inputs stay between two GPU steps; the outputs run while the GPU works
    critical = statistics.median(times["schedule"]) + statistics.median(times["prepare"])
    print(f"  on the critical path between GPU steps: plain {host * 1e3:.3f} ms, --async-scheduling "
          f"{critical * 1e3:.3f} ms (the outputs overlap the step; they must stay under its GPU time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
