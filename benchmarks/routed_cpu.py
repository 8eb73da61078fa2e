"""Routed fetching on CPU with the default model (real, skewed routing): the expert cache's hit rate, bytes
moved per generated token against stream-all, and how well layer l+1's router applied to layer l's MoE input
predicts layer l+1's experts (prefetch by prediction, issue 21 item 2c). No GPU: bytes and counts only.

    python benchmarks/routed_cpu.py [--batch 1 8] [--num-gpu-experts 0 8] [--tokens 48] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("PAGEDMOE_NO_PROGRESS", "1")

PROMPTS = ["import os\n\ndef read_config(path):\n    ", "class Stack:\n    def __init__(self):\n        ",
           "def fib(n):\n    if n < 2:\n", "for i in range(10):\n    print(", "# sort a list of dicts by key\n",
           "def parse_args():\n    parser = argparse.", "with open(path) as f:\n    for line in f:\n",
           "def mean(xs):\n    return "]


def _prediction_hooks(model, acc: dict):
    """Forward hooks on every MoE layer: layer l's input routed by layer l+1's router (the prediction) against
    what layer l+1 routes (per forward, distinct experts: what a prefetch would have to bring in)."""
    moes = model.moe_layers()
    seen: dict = {}

    def hook(idx):
        def fn(module, args):
            x = args[0]
            _, actual = module.route(x)
            seen[idx] = set(actual.reshape(-1).tolist())
            if idx > 0 and ("pred", idx) in seen:
                pred = seen.pop(("pred", idx))
                acc["routed"] += len(seen[idx])
                acc["predicted_hits"] += len(seen[idx] & pred)
                acc["predicted"] += len(pred)
            if idx + 1 < len(moes):
                _, nxt = moes[idx + 1].route(x)
                seen[("pred", idx + 1)] = set(nxt.reshape(-1).tolist())
        return fn

    return [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(moes)]


def measure(fetch: str, num_gpu_experts: int, batch: int, tokens: int, predict: bool = False,
            prefetch: bool = False) -> dict:
    """Decode `tokens` tokens for `batch` prompts of the default model, paged with N resident (stream) or a
    cache of the same rows (routed); bytes per decode step and per generated token, cache hits."""
    from pagedmoe import LLM, SamplingParams

    flags = dict(cpu_moe=True) if num_gpu_experts == 0 else dict(num_gpu_experts=num_gpu_experts)
    llm = LLM(device="cpu", max_model_len=256, expert_fetch=fetch, expert_prefetch=prefetch, **flags)
    eng = llm.engine
    acc = {"routed": 0, "predicted_hits": 0, "predicted": 0}
    hooks = _prediction_hooks(eng.model, acc) if predict else []
    tok = eng.tokenizer
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], params)
    eng.step()   # the prefill (every prompt fits one step)
    s0 = eng.get_stats()
    d0 = int(eng.activity.distinct_routed)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    s1 = eng.get_stats()
    for h in hooks:
        h.remove()
    expert = eng.expert_store.expert_numel * eng.dtype.itemsize
    moved = s1["expert_bytes_h2d"] - s0["expert_bytes_h2d"]
    routed = (int(eng.activity.distinct_routed) - d0) * expert
    out = {"fetch": fetch, "num_gpu_experts": num_gpu_experts, "batch": batch, "decode_steps": steps,
           "expert_bytes": expert, "moved_bytes_per_step": moved / steps, "routed_bytes_per_step": routed / steps,
           "moved_bytes_per_token": moved / (steps * batch)}
    if fetch == "routed":
        h, m = s1["expert_cache_hits"] - s0["expert_cache_hits"], s1["expert_cache_misses"] - s0["expert_cache_misses"]
        pf = s1["expert_cache_prefetched"] - s0["expert_cache_prefetched"]
        pfh = s1["expert_cache_prefetch_hits"] - s0["expert_cache_prefetch_hits"]
        out.update(cache_pages=eng.pager.cache.num_slots, hits=h, misses=m, hit_rate=h / max(1, h + m),
                   prefetched=pf, prefetch_hits=pfh)
    if predict:
        out.update(prediction_recall=acc["predicted_hits"] / max(1, acc["routed"]),
                   predicted_per_routed=acc["predicted"] / max(1, acc["routed"]))
    del tok
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-gpu-experts", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for n in args.num_gpu_experts:
        for b in args.batch:
            s = measure("stream", n, b, args.tokens)
            r = measure("routed", n, b, args.tokens, predict=True)
            p = measure("routed", n, b, args.tokens, prefetch=True)
            rows += [s, r, p]
            print(f"N={n:<3} batch {b:<3}: stream {s['moved_bytes_per_token'] / 1e6:7.3f} MB/token moved; routed "
                  f"{r['moved_bytes_per_token'] / 1e6:7.3f} MB/token ({r['moved_bytes_per_token'] / s['moved_bytes_per_token']:.3f}x), "
                  f"cache {r['cache_pages']} pages, hit rate {r['hit_rate']:.3f}, routed "
                  f"{r['routed_bytes_per_step'] / 1e6:.3f} MB/step, moved/routed "
                  f"{r['moved_bytes_per_step'] / r['routed_bytes_per_step']:.3f}; prediction recall "
                  f"{r['prediction_recall']:.3f} ({r['predicted_per_routed']:.2f} predicted per routed)")
            print(f"            with --expert-prefetch: {p['moved_bytes_per_token'] / 1e6:7.3f} MB/token, on-demand "
                  f"hit rate {p['hit_rate']:.3f}, {p['prefetched']} pages prefetched, {p['prefetch_hits']} of them "
                  f"routed ({p['prefetch_hits'] / max(1, p['prefetched']):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
