"""`pagedmoe bench serve`: vLLM's result block (exact labels and columns), metric definitions, JSON."""
from __future__ import annotations

import json

import pytest

from pagedmoe.bench.serve import random_requests
from pagedmoe.bench.serve_metrics import RequestResult, calculate_metrics, format_result_block

# The block from CONVENTIONS.md, labels only (values start in column 41, as vLLM prints them).
TEMPLATE = """\
============ Serving Benchmark Result ============
Successful requests:
Benchmark duration (s):
Total input tokens:
Total generated tokens:
Request throughput (req/s):
Output token throughput (tok/s):
Total Token throughput (tok/s):
---------------Time to First Token----------------
Mean TTFT (ms):
Median TTFT (ms):
P99 TTFT (ms):
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):
Median TPOT (ms):
P99 TPOT (ms):
---------------Inter-token Latency----------------
Mean ITL (ms):
Median ITL (ms):
P99 ITL (ms):
==================================================""".splitlines()


def parse_block(text: str) -> dict[str, float]:
    lines = text[text.index(TEMPLATE[0]):].splitlines()[: len(TEMPLATE)]
    values = {}
    for line, want in zip(lines, TEMPLATE):
        if want.startswith(("=", "-")):
            assert line == want
            continue
        assert line[:40].rstrip() == want and line[40] == " ", repr(line)
        values[want] = float(line[41:])
    return values


def test_metrics_follow_vllm_definitions():
    ok = RequestResult(prompt_len=10, expected_output_len=4, success=True, ttft=0.1, latency=0.4,
                       itl=[0.1, 0.1, 0.1], output_tokens=4)
    one = RequestResult(prompt_len=6, expected_output_len=1, success=True, ttft=0.3, latency=0.3, output_tokens=1)
    failed = RequestResult(prompt_len=7, expected_output_len=4, error="HTTP 503")
    m = calculate_metrics([ok, one, failed], duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 16 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(10.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.4 - 0.1) / (4 - 1); one-token requests have none
    assert m["p99_itl_ms"] == pytest.approx(100.0)
    values = parse_block(format_result_block(m))
    assert values["Successful requests:"] == 2 and values["Mean TPOT (ms):"] == 100.0


def test_random_requests_are_reproducible():
    a = random_requests(20, 32, 8, 0.25, vocab_size=100, seed=3)
    assert a == random_requests(20, 32, 8, 0.25, vocab_size=100, seed=3)
    assert a != random_requests(20, 32, 8, 0.25, vocab_size=100, seed=4)
    assert all(24 <= len(p) <= 40 and 6 <= o <= 10 for p, o in a)
    assert all(0 <= t < 100 for p, _ in a for t in p)
    assert {len(p) for p, _ in random_requests(5, 16, 4, 0.0, 100, 0)} == {16}


def test_bench_serve_against_the_server(server, tiny_model_dir, tmp_path, capsys):
    from pagedmoe.cli import main

    result_file = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "12", "--random-input-len", "8",
               "--random-output-len", "4", "--tokenizer", str(tiny_model_dir), "--max-concurrency", "4",
               "--request-rate", "200", "--disable-tqdm", "--result-file", str(result_file), "--label", "test"])
    out = capsys.readouterr().out
    assert rc == 0, out
    values = parse_block(out)
    assert values["Successful requests:"] == 12
    assert values["Total input tokens:"] == 12 * 8 and values["Total generated tokens:"] == 12 * 4
    assert values["Request throughput (req/s):"] > 0 and values["Mean TTFT (ms):"] > 0
    result = json.loads(result_file.read_text())
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p99_itl_ms", "completed", "duration", "git_commit", "versions", "config",
                "date", "model_id", "max_concurrency", "request_rate"):
        assert key in result, key
    assert result["completed"] == 12 and result["model_id"] == "tiny" and result["label"] == "test"
    assert result["config"]["random_input_len"] == 8 and result["versions"]["pagedmoe"]
    server.wait_idle()


@pytest.mark.parametrize("tokenizer", ["as_loaded", "none"])
def test_bench_serve_against_a_model_without_tokenizer(tiny_model_dir, tmp_path, capsys, tokenizer):
    """The GPU benchmarks serve shape-only folders (config.json, dummy weights, no tokenizer files): token-id
    prompts work, chunks are sent per token though they carry no text, and bench serve times them.
    transformers may build an empty tokenizer for such a folder ("as_loaded") or the engine has none."""
    import shutil

    import httpx

    from pagedmoe.cli import main
    from server_utils import ServerThread, assert_openai_error, make_engine

    shape_only = tmp_path / "shape_only"
    shape_only.mkdir()
    shutil.copy(tiny_model_dir / "config.json", shape_only / "config.json")
    engine = make_engine(shape_only, load_format="dummy", max_num_seqs=8)
    if tokenizer == "none":
        engine.tokenizer = engine.outputs.tokenizer = None
    with ServerThread(engine) as server:
        url = server.base_url
        assert_openai_error(httpx.post(url + "/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "x"}]}), 400)
        if tokenizer == "none":
            assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "text"}), 400)
            assert_openai_error(httpx.post(url + "/tokenize", json={"prompt": "x"}), 400)
        with httpx.stream("POST", url + "/v1/completions", json={
                "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
        assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 2
        rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "6", "--random-input-len", "8",
                   "--random-output-len", "4", "--disable-tqdm"])
        out = capsys.readouterr().out
        assert rc == 0, out
        values = parse_block(out)
        assert values["Successful requests:"] == 6 and values["Total generated tokens:"] == 24
        assert values["Mean TPOT (ms):"] > 0
        server.wait_idle()
