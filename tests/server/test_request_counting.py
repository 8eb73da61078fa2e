"""Each request is counted once in the request metrics (request_success_total or num_requests_aborted_total), with
the reason that ended it, whatever the order in which the engine and the client finish."""
from __future__ import annotations

import asyncio
import time

import httpx

from fault_injection import OomOnce
from server_utils import MODEL_NAME, ServerThread, make_engine


def _value(metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value("pagedmoe:" + name, {"model_name": MODEL_NAME, **labels}) or 0.0


def test_a_client_leaving_after_its_request_finished_is_not_counted_again(tiny_model_dir):
    from pagedmoe.sampling_params import SamplingParams
    from pagedmoe.server.async_engine import AsyncEngine
    from pagedmoe.server.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL_NAME)
    bridge = AsyncEngine(make_engine(tiny_model_dir), metrics=metrics)
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def run():
        bridge.start()
        done = bridge.submit("done", [(None, [4, 8, 15])], params)
        # The loop is blocked here, so the finished output cannot reach the handle: the engine finishes the
        # request, then its client goes away before the output was read.
        deadline = time.monotonic() + 30
        while _value(metrics, "request_success_total", finished_reason="length") < 1:
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.01)
        done.close("disconnect")
        bridge.submit("gone", [(None, [4, 8, 15])], params).close("disconnect")   # left at once: one abort
        await bridge.shutdown()       # the engine thread applies the queued aborts before it stops

    asyncio.run(run())
    assert _value(metrics, "request_success_total", finished_reason="length") == 1
    assert _value(metrics, "num_requests_aborted_total", reason="disconnect") == 1


def test_samples_ended_by_a_sibling_failure_are_counted_as_errors(tiny_model_dir):
    """n=2, one sequence at a time: sample 0's second step fails (out of memory), so the request fails and
    sample 1 (waiting) is aborted with it. Both count as "error": the client did nothing."""
    from server_utils import slow_down

    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    engine.runner.execute = OomOnce(engine.runner.execute, at=2)
    slow_down(engine, 0.02)           # sample 1 is still running when the abort reaches the engine
    body = {"model": MODEL_NAME, "prompt": [4, 8, 15, 16], "max_tokens": 50, "n": 2, "ignore_eos": True}
    with ServerThread(engine) as s:
        assert httpx.post(s.base_url + "/v1/completions", json=body, timeout=60).status_code == 500
        m = s.wait_idle()
    assert m['pagedmoe:num_requests_aborted_total{reason="error"}'] == 2
    assert m.get('pagedmoe:num_requests_aborted_total{reason="client"}', 0) == 0
    assert m.get('pagedmoe:request_success_total{finished_reason="length"}', 0) == 0


def test_prompt_tokens_are_counted_when_their_prefill_ends(tiny_model_dir):
    """vLLM's prompt_tokens_total: a request's whole prompt, once, when its prefill is done (at its first token):
    not at admission, not chunk by chunk, not for a request aborted or failed before its first token."""
    from pagedmoe.sampling_params import SamplingParams

    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("aborted", None, params, prompt_token_ids=list(range(3, 13)))
    engine.abort_request("aborted")
    engine.add_request("long", None, params, prompt_token_ids=list(range(3, 43)))    # 40 tokens: 3 chunks
    assert engine.get_stats()["prompt_tokens_total"] == 0
    engine.step()
    engine.step()
    assert engine.get_stats()["prompt_tokens_total"] == 0       # two chunks in, no token yet
    engine.step()
    assert engine.get_stats()["prompt_tokens_total"] == 40
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.execute = OomOnce(engine.runner.execute, at=1)   # its prefill fails: never processed
    engine.add_request("failed", None, params, prompt_token_ids=list(range(3, 13)))
    assert engine.step()[0].error is not None
    assert engine.get_stats()["prompt_tokens_total"] == 40
