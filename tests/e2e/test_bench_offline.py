"""`pagedmoe bench throughput|latency` on a tiny checkpoint: vLLM's output line, JSON, floors."""
import json
import re

import pytest

from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench")
    make_tiny_checkpoint("mixtral", path, seed=4)
    return path


def test_bench_throughput_line_and_json(ckpt, tmp_path, capsys):
    from pagedmoe.cli import main

    out = tmp_path / "t.json"
    assert main(["bench", "throughput", str(ckpt), "--num-prompts", "6", "--input-len", "12", "--output-len", "5",
                 "--max-model-len", "64", "--device", "cpu", "--output-json", str(out)]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("Throughput:")]
    assert len(line) == 1
    assert re.fullmatch(r"Throughput: \d+\.\d\d requests/s, \d+\.\d\d total tokens/s, \d+\.\d\d output tokens/s",
                        line[0])
    r = json.loads(out.read_text())
    assert r["num_requests"] == 6 and r["num_output_tokens"] == 30 and r["total_num_tokens"] == 6 * 17
    assert r["config"]["input_len"] == 12 and "git_commit" in r and "versions" in r


def test_bench_throughput_line_is_unique_with_the_progress_bar(ckpt, capsys, monkeypatch):
    """With the progress bar on (an interactive run), stdout and stderr together (`2>&1 | tee log`) hold one
    line starting with "Throughput:", the result: the bar is vLLM's "Processed prompts", not a second one."""
    from pagedmoe.cli import main

    monkeypatch.delenv("PAGEDMOE_NO_PROGRESS", raising=False)
    assert main(["bench", "throughput", str(ckpt), "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                 "--max-model-len", "64", "--device", "cpu", "--load-format", "dummy"]) == 0
    captured = capsys.readouterr()
    lines = [l for text in (captured.out, captured.err) for l in text.replace("\r", "\n").splitlines()]
    assert len([l for l in lines if l.startswith("Throughput:")]) == 1, lines
    assert any(l.startswith("Processed prompts") for l in lines), lines


@pytest.mark.parametrize("bad", [["--batch-size", "0"], ["--batch-size", "4", "-1"], ["--input-len", "0"],
                                 ["--output-len", "0"]])
def test_bench_latency_refuses_empty_sizes_in_one_line(ckpt, capsys, bad):
    from pagedmoe.cli import main

    assert main(["bench", "latency", str(ckpt), "--load-format", "dummy", "--device", "cpu", "--max-model-len", "64",
                 *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pagedmoe bench: error: --batch-size, --input-len and --output-len must be >= 1", err


def test_bench_latency_reports_floor(ckpt, tmp_path, capsys):
    from pagedmoe.cli import main

    out = tmp_path / "l.json"
    assert main(["bench", "latency", str(ckpt), "--batch-size", "1", "3", "--input-len", "10", "--output-len", "4",
                 "--max-model-len", "64", "--device", "cpu", "--hbm-bandwidth", "1e12",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Batch 1: decode step" in text and "Batch 3: decode step" in text and "HBM floor" in text
    res = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in res] == [1, 3]
    for r in res:
        assert r["decode_steps"] == 3  # output 4 tokens: the first comes from the prefill step
        assert r["decode_floor_ms"] > 0 and r["step_bytes"]["kv"] > 0
        assert r["temperature"] == 1.0   # vLLM's bench latency samples at temperature 1.0, top_p 1.0
    # More sequences read more KV and touch at least as many experts.
    assert res[1]["step_bytes"]["kv"] > res[0]["step_bytes"]["kv"]
    assert res[1]["step_bytes"]["experts"] >= res[0]["step_bytes"]["experts"]
    assert main(["bench", "latency", str(ckpt), "--batch-size", "1", "--input-len", "10", "--output-len", "3",
                 "--max-model-len", "64", "--device", "cpu", "--temperature", "0", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["temperature"] == 0.0
    capsys.readouterr()
    assert main(["bench", "latency", str(ckpt), "--batch-size", "1", "--input-len", "10", "--output-len", "3",
                 "--max-model-len", "64", "--device", "cpu", "--temperature", "-1"]) != 0
    assert "--temperature must be >= 0" in capsys.readouterr().err


def test_bench_latency_output_len_1_has_no_decode_steps(ckpt, tmp_path, capsys):
    """--output-len 1: the prefill step samples the only token. No "median of 0 ... nan" line, no per-step
    expert traffic (it would be the prefill's); the JSON holds null, not NaN or "nan"."""
    from pagedmoe.cli import main

    out = tmp_path / "l.json"
    assert main(["bench", "latency", str(ckpt), "--batch-size", "2", "--input-len", "10", "--output-len", "1",
                 "--max-model-len", "64", "--device", "cpu", "--output-json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "nan" not in "\n".join(lines).lower() and not any("decode step (median" in l for l in lines), lines
    decode = [l for l in lines if "decode steps" in l]
    assert len(decode) == 1 and decode[0].startswith("Batch 2: no decode steps (--output-len 1"), decode
    assert "HBM floor" in decode[0]
    assert not any("GB/step" in l for l in lines), lines
    text = out.read_text()
    assert "nan" not in text.lower(), text
    r = json.loads(text)["results"][0]
    assert r["decode_steps"] == 0 and r["decode_step_ms"] == [] and r["prefill_time_s"] > 0
    for key in ("median_decode_step_ms", "mean_decode_step_ms", "floor_over_measured", "expert_bytes_moved_per_step",
                "routed_expert_bytes_per_step"):
        assert r[key] is None, key


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bench_latency_reads_no_counter_between_decode_steps(ckpt, monkeypatch, async_scheduling):
    """Reading a counter waits for the device: between decode steps it absorbed the step in flight outside the
    timer (--async-scheduling on the H200: 0.8 ms per batch-1 step against 4.3 ms run back to back)."""
    from pagedmoe.bench import latency
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_model_len=64,
                                    async_scheduling=async_scheduling))
    reads, real = [], latency._expert_counters
    monkeypatch.setattr(latency, "_expert_counters",
                        lambda e: reads.append((e.step_time["decode_steps"], e.has_unfinished_requests())) or real(e))
    before = engine.step_time["decode_steps"]
    r = latency.run_latency(engine, 2, 10, 5, hbm_bw=1e12)
    assert r["decode_steps"] == engine.step_time["decode_steps"] - before - 2  # less the warm-up's two
    # read during the warm-up and prefill (no decode step timed yet), then once after the last step
    assert all(not unfinished or n <= before + 2 for n, unfinished in reads[:-1])
    assert reads[-1][1] is False and len(reads) < r["decode_steps"]
    assert r["routed_expert_bytes_per_step"] > 0
    # the request's wall time spans every timed step and what ran between them (the counter reads)
    assert r["request_latency_s"] >= r["prefill_time_s"] + sum(r["decode_step_ms"]) / 1e3 > 0


@pytest.mark.parametrize("placement", ["resident", "paged"])
def test_steady_state_fills_the_kv_cache(ckpt, placement):
    """The steady-state window runs with as many sequences as the workload keeps in flight, every step a
    decode step of all of them, the KV cache (nearly) full at the end and nothing preempted; afterwards the
    engine is idle with every block free."""
    from pagedmoe.bench.throughput import run_steady_state
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_model_len=64, num_kv_blocks=40,
                                    block_size=8, max_num_batched_tokens=64, expert_placement=placement))
    r = run_steady_state(engine, input_len=20, output_len=12, decode_steps=4)
    assert r["num_requests"] == 40 * 8 // 32  # KV tokens // (input + output)
    # fill phase: ceil(10 * 32 / 64) + 1 = 6 steps of slack, 4 in the window
    assert r["prompt_len"] == 20 + 12 - 4 - 8 - 6 - 1  # window, eager timing steps, fill slack
    assert r["window_decode_steps"] == 4 and r["mean_decode_batch"] == 10 and r["num_preemptions"] == 0
    assert r["eager_timing"]["steps"] == 8 and r["eager_timing"]["mean_step_ms"] > 0
    assert 0.7 < r["kv_cache_usage_at_end"] <= 1.0
    assert r["output_tokens_per_second"] > 0 and r["decode_tokens_per_second"] > r["output_tokens_per_second"]
    if placement == "paged":
        assert r["window_expert_stats"]["expert_steps"] >= 4
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_steady_state_refuses_a_window_longer_than_the_output(ckpt):
    from pagedmoe.bench.throughput import run_steady_state
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_model_len=64, num_kv_blocks=40, block_size=8))
    with pytest.raises(ValueError, match="leaves no prompt"):
        run_steady_state(engine, input_len=4, output_len=4, decode_steps=8)


def test_steady_state_says_why_when_the_fill_outruns_its_plan(ckpt):
    """A fill slower than planned (here: fewer batched tokens than the plan assumed; on the GPU, a dynamic
    precision cascade) lets the first sequences finish before the window: the error says so."""
    from pagedmoe.bench.throughput import run_steady_state
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_model_len=64, num_kv_blocks=40,
                                    block_size=8, max_num_batched_tokens=64))
    engine.scheduler.max_num_batched_tokens = 14          # the plan still counts on 64 a step
    with pytest.raises(RuntimeError, match=r"steady state broken: .* sequences finished early: the fill took "
                                           r"\d+ steps where 6 were planned"):
        run_steady_state(engine, input_len=20, output_len=12, decode_steps=4)


def test_paged_runs_report_expert_traffic(ckpt, tmp_path, capsys, caplog):
    """Paged placement: LLM.generate logs the pager's traffic at the end of the run, and bench throughput
    prints it and returns the counters of the timed part."""
    import logging

    from pagedmoe import LLM, SamplingParams
    from pagedmoe.cli import main

    llm = LLM(str(ckpt), device="cpu", cpu_moe=True, max_model_len=64)
    with caplog.at_level(logging.INFO, logger="pagedmoe"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    line = [r.message for r in caplog.records if r.message.startswith("expert paging:")]
    assert len(line) == 1 and "GB host->device over 4 steps" in line[0]
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", str(ckpt), "--num-prompts", "3", "--input-len", "8", "--output-len", "3",
                 "--max-model-len", "64", "--device", "cpu", "--cpu-moe", "--output-json", str(out)]) == 0
    assert "expert paging:" in capsys.readouterr().out
    r = json.loads(out.read_text())
    pager = llm.engine.pager
    assert r["expert_traffic"]["expert_bytes_h2d"] == pager.bytes_per_forward * r["expert_traffic"]["expert_steps"] > 0
