"""Out of GPU memory is survivable and named (issue 19 item 3), with torch's OOM injected on the CPU:
- while starting: "out of GPU memory while <what> (<GiB>), budget <GiB>", never a corrupt checkpoint;
- inside a step: that step's requests fail with the reason and free their KV blocks; the engine (offline API)
  and the server keep serving, and what they serve next is right."""
from __future__ import annotations

import pytest
import torch

from fault_injection import OOM, OomOnce, raise_oom
from pagedmoe.cli import main
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_oom")
    make_tiny_checkpoint("mixtral", path, seed=5, num_hidden_layers=2)
    return path


# -- while starting --------------------------------------------------------------------------------------------
def test_oom_while_loading_a_tensor_is_named_not_a_corrupt_file(ckpt, monkeypatch, capsys):
    from pagedmoe import LLM
    from pagedmoe.models.moe_decoder import MoEForCausalLM
    from pagedmoe.oom import DeviceOutOfMemoryError

    load = MoEForCausalLM.load_tensor

    def oom_on_q_proj(self, name, tensor, params):
        if name == "model.layers.1.self_attn.q_proj.weight":
            raise torch.OutOfMemoryError(OOM)
        return load(self, name, tensor, params)

    monkeypatch.setattr(MoEForCausalLM, "load_tensor", oom_on_q_proj)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        LLM(str(ckpt), device="cpu", max_model_len=64, gpu_memory_gb=0.5)
    msg = str(info.value)
    size = 64 * 64 * 4 / 2 ** 30  # the tiny q_proj, float32
    assert msg == (f"out of GPU memory while loading tensor 'model.layers.1.self_attn.q_proj.weight' of "
                   f"model.safetensors ({size:.2f} GiB), budget 0.50 GiB"), msg
    assert isinstance(info.value, torch.OutOfMemoryError)  # `except torch.OutOfMemoryError` still catches it
    assert main(["generate", str(ckpt), "--device", "cpu", "--max-model-len", "64", "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert "out of GPU memory while loading tensor" in err and "no --gpu-memory-gb budget" in err
    assert "corrupt" not in err and "truncated" not in err


def test_oom_while_allocating_the_kv_cache_is_named(ckpt, monkeypatch):
    from pagedmoe import LLM
    from pagedmoe.oom import DeviceOutOfMemoryError
    from pagedmoe.worker import model_runner

    monkeypatch.setattr(model_runner, "allocate_kv_cache", raise_oom)
    with pytest.raises(DeviceOutOfMemoryError, match=r"^out of GPU memory while allocating the KV cache \(\d+ "
                                                     r"blocks\) \(\d+\.\d\d GiB\), budget 0\.25 GiB$"):
        LLM(str(ckpt), device="cpu", max_model_len=64, gpu_memory_gb=0.25)


def test_oom_elsewhere_at_start_still_names_the_budget(ckpt, monkeypatch):
    from pagedmoe import LLM
    from pagedmoe.engine import startup as llm_engine
    from pagedmoe.oom import DeviceOutOfMemoryError

    monkeypatch.setattr(llm_engine, "ActivityTable", raise_oom)
    with pytest.raises(DeviceOutOfMemoryError, match=r"^out of GPU memory while starting the engine, budget 1\.00"):
        LLM(str(ckpt), device="cpu", max_model_len=64, gpu_memory_gb=1)


# -- inside a step ---------------------------------------------------------------------------------------------
def _greedy(max_tokens):
    from pagedmoe import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("where", ["runner", "experts"])
def test_oom_in_a_step_fails_its_requests_and_the_engine_serves_on(ckpt, where):
    """Prompt A finishes in step 2, B is in step 4 when it runs out of memory: A's output is intact, B fails with
    the reason, its blocks are free, and the same LLM then generates B exactly as an untouched one does.
    `experts`: the OOM comes from inside the forward of a paged model (the pager mid-step)."""
    from pagedmoe import LLM
    from pagedmoe.llm import GenerationError

    flags = dict(device="cpu", max_model_len=64, cpu_moe=where == "experts")
    prompts = [[5, 9, 13], [7, 2, 11, 3]]
    params = [_greedy(2), _greedy(8)]
    reference = LLM(str(ckpt), **flags).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(ckpt), **flags)
    engine = llm.engine
    free = engine.kv.num_free_blocks
    if where == "runner":
        engine.runner.execute = OomOnce(engine.runner.execute, at=4)
    else:
        moe = engine.model.moe_layers()[1]
        moe.experts_fn = OomOnce(moe.experts_fn, at=4)
    with pytest.raises(GenerationError, match=r"^1 of 2 requests failed: out of GPU memory while running a step "
                                              r"of 1 request \(1 token\), no --gpu-memory-gb budget") as info:
        llm.generate(prompts, params, use_tqdm=False)
    ok, failed = info.value.outputs
    assert ok.error is None and ok.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert failed.outputs[0].finish_reason == "error" and "--max-num-batched-tokens" in failed.error
    assert len(failed.outputs[0].token_ids) == 3  # the tokens of the steps that ran (prefill, 2 decodes)
    assert engine.kv.num_free_blocks == free and not engine.has_unfinished_requests() and not engine.requests
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in reference]


def test_generate_cli_prints_what_finished_then_one_line(ckpt, monkeypatch, capsys):
    from pagedmoe.engine.llm_engine import LLMEngine

    step = LLMEngine.step
    counter = {"n": 0}

    def failing_second_step(self):
        counter["n"] += 1
        if counter["n"] == 2:
            self.runner.execute = OomOnce(self.runner.execute, at=1)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", failing_second_step)
    rc = main(["generate", str(ckpt), "--device", "cpu", "--max-model-len", "64", "--max-tokens", "4",
               "--prompt", "x", "--ignore-eos"])
    captured = capsys.readouterr()
    assert rc == 1
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith("pagedmoe generate: error: 1 of 1 requests failed: out of GPU memory while running a step")
    assert "Traceback" not in captured.err


def test_benchmarks_let_a_step_oom_stop_them(ckpt):
    """A benchmark with failed requests would report a throughput of what was left: its OOM propagates (bench
    sweep records the point as out of memory)."""
    from pagedmoe.bench.throughput import run_throughput
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", max_model_len=64))
    engine.runner.execute = OomOnce(engine.runner.execute, at=5)  # past run_throughput's warm-up
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        run_throughput(engine, 2, 8, 4, show_progress=False)
    assert not engine.survive_step_oom


def test_chat_reports_a_failed_turn_and_chats_on(ckpt, monkeypatch, capsys):
    """`pagedmoe chat`: a turn whose step runs out of memory is one error line; the next turn is answered."""
    import builtins

    from pagedmoe.entrypoints import streaming

    lines = iter(["first", "second", ""])
    monkeypatch.setattr(builtins, "input", lambda _prompt="": next(lines))
    stream, calls = streaming.stream, {"n": 0}

    def oom_on_first_turn(engine, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            engine.runner.execute = OomOnce(engine.runner.execute, at=1)
        return stream(engine, *args, **kwargs)

    monkeypatch.setattr(streaming, "stream", oom_on_first_turn)
    assert main(["chat", "--device", "cpu", "--max-model-len", "256", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("chat: error: ")]
    assert len(errors) == 1 and "out of GPU memory while running a step" in errors[0], captured.err
    assert calls["n"] == 2 and captured.out.strip(), captured.out  # the second turn's reply
    assert "Traceback" not in captured.err
