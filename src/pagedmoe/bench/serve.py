"""`pagedmoe bench serve`: load an OpenAI-compatible server the way vLLM's `bench serve` does.

Random-token prompts (sent as token-id lists, so input lengths are exact; `--random-prefix-len` starts
them all with one shared prefix, for prefix caching), `ignore_eos` so output
lengths are exact, streaming to time TTFT and inter-token latency, Poisson arrivals
(`--request-rate`, gamma with `--burstiness`) and an optional cap on requests in flight
(`--max-concurrency`). Prints vLLM's "Serving Benchmark Result" block; `--save-result` writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pagedmoe.bench.common import environment, write_json
from pagedmoe.bench.serve_metrics import RequestResult, calculate_metrics, format_result_block

TIMEOUT_S = 6 * 60 * 60
MIN_TOKENIZER_VOCAB = 100  # below this a "tokenizer" is the empty one transformers builds for config-only folders  # vLLM's: a benchmark request may legitimately queue for a long time


def register(sub) -> None:
    p = sub.add_parser("serve", help="benchmark an OpenAI-compatible server (online serving)",
                       description="Benchmark online serving against any OpenAI-compatible base URL.")
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "pagedmoe"],
                   help="label only: every backend is driven through /v1/completions")
    p.add_argument("--base-url", default=None, help="e.g. http://host:8000 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, for the vocabulary size")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="(env OPENAI_API_KEY)")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-prefix-len", "--shared-prefix-len", dest="random_prefix_len", type=int, default=0,
                   help="every prompt starts with the same N random tokens (a shared system prompt), before "
                        "its own --random-input-len ones (vLLM's --random-prefix-len)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--random-vocab-size", type=int, default=None,
                   help="token ids are drawn from [0, N) (default: the tokenizer's vocabulary)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default: on)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--save-detailed", action="store_true", help="also write per-request lengths and timings")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--result-file", type=Path, default=None, help="full path of the JSON (implies --save-result)")
    p.add_argument("--label", default=None, help="free text stored in the JSON (e.g. 'resident')")
    p.set_defaults(func=run_bench_serve)


# -- prompts ---------------------------------------------------------------------------------------
def _lengths(rng, mean: int, ratio: float, n: int) -> np.ndarray:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(n: int, input_len: int, output_len: int, ratio: float, vocab_size: int, seed: int,
                    prefix_len: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, reproducible from the seed; with `prefix_len` every
    prompt starts with the same prefix_len tokens (the rest as without it)."""
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, input_len, ratio, n), _lengths(rng, output_len, ratio, n)
    own = [(rng.integers(0, vocab_size, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist() if prefix_len else []
    return [(prefix + p, o) for p, o in own]


def _vocab_size(args, model_root: Optional[str]) -> int:
    if args.random_vocab_size:
        return args.random_vocab_size
    for path in (args.tokenizer, args.model, model_root):
        if not path or not Path(path).is_dir():
            continue
        try:
            from transformers import AutoTokenizer

            # The base vocabulary only: added/special tokens could end a prompt early or trip filters.
            size = int(AutoTokenizer.from_pretrained(path).vocab_size)
        except Exception:  # noqa: BLE001 - no tokenizer files
            size = 0
        if size >= MIN_TOKENIZER_VOCAB:
            return size
        # A shape-only folder (config.json only; transformers may still build an empty tokenizer).
        config = Path(path) / "config.json"
        if config.is_file() and isinstance(json.loads(config.read_text()).get("vocab_size"), int):
            return int(json.loads(config.read_text())["vocab_size"])
    raise ValueError("cannot tell the vocabulary size: pass --tokenizer PATH or --random-vocab-size N")


# -- requests --------------------------------------------------------------------------------------
async def send_request(client, url: str, payload: dict, headers: dict, result: RequestResult) -> RequestResult:
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message", obj["error"]))
                    return result
                choices = obj.get("choices") or []
                text = choices[0].get("text") if choices else None
                # With continuous usage stats a chunk counts by its tokens, so tokens whose text is empty
                # (no tokenizer on the server, held back for a stop string) are still timed.
                num_tokens = (obj.get("usage") or {}).get("completion_tokens")
                new_tokens = num_tokens is not None and num_tokens > (result.output_tokens or 0)
                if num_tokens is not None:
                    result.output_tokens = num_tokens
                if choices and (text or new_tokens):
                    now = time.perf_counter()
                    if result.num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.num_chunks += 1
                    result.generated_text += text or ""
        result.latency = last - start
        result.success = result.num_chunks > 0
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


def _payload(args, model: str, prompt: list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _arrivals(n: int, rate: float, burstiness: float, rng):
    """Yield 0..n-1, sleeping gamma-distributed gaps (mean 1/rate; shape 1 is Poisson)."""
    for i in range(n):
        yield i
        if rate != float("inf") and i + 1 < n:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def benchmark(args, base_url: str, model: str, requests: list[tuple[list[int], int]]) -> dict:
    import httpx
    from tqdm.auto import tqdm

    url = base_url + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S), limits=limits) as client:
        print("Starting initial single prompt test run...")
        prompt, out_len = requests[0]
        test = await send_request(client, url, _payload(args, model, prompt, out_len), headers,
                                  RequestResult(len(prompt), out_len))
        if not test.success:
            raise ValueError(f"the initial test request failed: {test.error}")
        print("Initial test run completed. Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({'Poisson process' if args.burstiness == 1 else 'Gamma'})")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        bar = tqdm(total=len(requests), disable=args.disable_tqdm)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(i: int) -> RequestResult:
            prompt, out_len = requests[i]
            result = RequestResult(len(prompt), out_len)
            if semaphore is None:
                await send_request(client, url, _payload(args, model, prompt, out_len), headers, result)
            else:
                async with semaphore:
                    await send_request(client, url, _payload(args, model, prompt, out_len), headers, result)
            bar.update(1)
            return result

        rng = np.random.default_rng(args.seed + 1)
        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    metrics = calculate_metrics(results, duration, percentiles)
    print(format_result_block(metrics, percentiles,
                              tuple(m for m in args.percentile_metrics.split(",") if m in ("ttft", "tpot", "itl", "e2el"))))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    metrics["errors"] = errors
    if args.save_detailed:
        metrics.update(input_lens=[r.prompt_len for r in results], ttfts=[r.ttft for r in results],
                       itls=[r.itl for r in results])
    else:
        metrics.pop("output_lens")
    return metrics


def _server_models(base_url: str, api_key: Optional[str]) -> list[dict]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json().get("data", [])
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"cannot list the models at {base_url}/v1/models: {e}") from None


_MEMORY_GAUGES = {"device_memory_used_bytes": "used_gib", "device_memory_peak_bytes": "peak_gib",
                  "gpu_memory_budget_bytes": "budget_gib"}


def server_device_memory(base_url: str, api_key: Optional[str]) -> dict:
    """The server's device memory (GiB) from its /metrics gauges (a pagedmoe server on CUDA); {} when it
    exports none (another server, CPU) or cannot be read."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    out = {}
    for line in resp.text.splitlines():
        name, _, rest = line.partition("{")
        key = _MEMORY_GAUGES.get(name.removeprefix("pagedmoe:"))
        if key and name.startswith("pagedmoe:"):
            out[key] = float(rest.rsplit(" ", 1)[-1]) / 2 ** 30
    if out.get("budget_gib") and "peak_gib" in out:
        out["peak_over_budget"] = out["peak_gib"] / out["budget_gib"]
    return out


def run_bench_serve(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    if args.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError("bench serve sends token-id prompts, which only /v1/completions takes")
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if args.random_prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    served = _server_models(base_url, args.api_key)
    model = args.model or (served[0]["id"] if served else None)
    if model is None:
        raise ValueError(f"{base_url} lists no models; pass --model")
    info = next((m for m in served if m.get("id") == model), {})
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, _vocab_size(args, info.get("root")), args.seed,
                               args.random_prefix_len)
    max_len = info.get("max_model_len")
    longest = max(len(p) + o for p, o in requests)
    if max_len and longest > max_len:
        raise ValueError(f"prompt + output up to {longest} tokens exceeds the server's max_model_len {max_len}")

    metrics = asyncio.run(benchmark(args, base_url, model, requests))
    memory = server_device_memory(base_url, args.api_key)
    if memory:
        metrics["server_device_memory"] = memory
        print(f"Server device memory: peak {memory['peak_gib']:.2f} GiB, {memory['used_gib']:.2f} GiB now "
              f"(budget {memory['budget_gib']:.2f} GiB: peak {100 * memory['peak_over_budget']:.1f}% of it)")
    if args.save_result or args.result_file:
        env = environment("httpx")
        result = {**env, "backend": args.backend, "label": args.label, "model_id": model,
                  "tokenizer_id": args.tokenizer or args.model, "base_url": base_url, "endpoint": args.endpoint,
                  "num_prompts": args.num_prompts, "request_rate": args.request_rate,
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                  "config": {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"},
                  **metrics}
        path = args.result_file
        if path is None:
            concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
            name = args.result_filename or (f"{args.backend}-{args.request_rate}qps{concurrency}-"
                                            f"{model.split('/')[-1]}-{env['date']}.json")
            path = Path(args.result_dir or ".") / name
        print(f"Result written to {write_json(path, result)}")
    return 0 if metrics["failed"] == 0 else 1
