"""Lossy precisions as tiers of the ExpertTable (issue 7, static modes): every expert held on the device as
fp8 / int8 / int4 and dequantised by the pager into the layer's compute buffer. The reference is the same
model with its resident expert rows overwritten by quantise -> dequantise values: logits must be equal."""
from __future__ import annotations

import pytest
import torch

from tiny_models import greedy_logits, make_tiny_checkpoint, spy_logits

PRECISIONS = ["fp8", "int8", "int4"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_quant")
    # H=64, I=32: int4 groups shorter than 128 along both weights' K are exercised
    make_tiny_checkpoint("mixtral", path, seed=51, num_hidden_layers=3)
    return path


def _fake_quantize_store(store, precision):
    """Overwrite every resident expert row with quantise -> dequantise values (in the store's dtype)."""
    from pagedmoe.codecs.quant import fake_quantize
    from pagedmoe.experts.layout import row_part

    H, I = store.hidden, store.inter
    for layer in range(store.table.num_layers):
        for e in range(store.table.num_experts):
            row = store.row(layer, e)
            for kind in ("w13", "w2"):
                w = row_part(row, H, I, kind)
                w.copy_(fake_quantize(w.clone(), precision))


def _trace(path, fake_precision=None, **flags):
    from pagedmoe import LLM

    llm = LLM(str(path), device="cpu", max_model_len=96, **flags)
    if fake_precision is not None:
        _fake_quantize_store(llm.engine.expert_store, fake_precision)
    captured, _ = greedy_logits(llm, (9, 21, 4), max_tokens=5, seed=7)
    return captured, llm.engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_static_precision_logits_equal_fake_quantized_resident(ckpt, precision, dtype):
    from pagedmoe.codecs.quant import expert_bytes

    ref, _ = _trace(ckpt, fake_precision=precision, dtype=dtype)
    exact, _ = _trace(ckpt, dtype=dtype)
    got, engine = _trace(ckpt, dtype=dtype, expert_precision=f"static-{precision}")
    assert len(ref) == len(got) == len(exact)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not all(torch.equal(a, b) for a, b in zip(exact, got))  # the lossy tier did change the weights
    store, num_moe = engine.expert_store, len(engine.model.moe_layers())
    E = engine.model.dims.num_experts
    stats = engine.get_stats()
    assert stats["experts"] == {f"quantized/{precision}": E * num_moe}
    # Device bytes are quant.bytes_of's, scales included; no host tier, no raw rows kept.
    assert store.quantized_bytes == num_moe * E * expert_bytes(precision, store.hidden, store.inter)
    assert stats["expert_quantized_bytes"] == store.quantized_bytes
    assert store.device_bytes == store.quantized_bytes + store.buffer_bytes
    assert store.host_bytes == 0 and stats["expert_bytes_h2d"] == 0
    assert all(q is not None and q.device == store.device for q in store.quantized)
    with pytest.raises(RuntimeError, match="quantized"):
        store.row(0, 0)
    elem = torch.empty(0, dtype=store.dtype).element_size()
    assert engine.pager.dequantized_bytes_per_forward == num_moe * E * store.expert_numel * elem
    assert stats["expert_bytes_dequantized"] == engine.pager.dequantized_bytes_per_forward * engine.num_steps


def test_exact_mode_is_unchanged(ckpt):
    ref, _ = _trace(ckpt)
    got, engine = _trace(ckpt, expert_precision="exact")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert engine.expert_store.quantized_bytes == 0 and "quantized" not in str(engine.get_stats()["experts"])


def test_quantized_tier_frees_device_memory_for_kv(ckpt):
    from pagedmoe import LLM

    common = dict(device="cpu", max_model_len=64)
    probe = LLM(str(ckpt), **common).engine.plan
    budget = (probe.weight_bytes + probe.activation_bytes + 20 * probe.kv_bytes_per_block + 100) / 1024 ** 3
    resident = LLM(str(ckpt), gpu_memory_gb=budget, expert_placement="resident", **common).engine
    int4 = LLM(str(ckpt), gpu_memory_gb=budget, expert_precision="static-int4", **common).engine
    freed = resident.expert_store.device_bytes - int4.expert_store.device_bytes
    assert freed > 0
    per_block = int4.plan.kv_bytes_per_block
    gained = int4.plan.num_kv_blocks - resident.plan.num_kv_blocks
    assert freed // per_block <= gained <= freed // per_block + 1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_static_precision_needs_no_host_tier(ckpt, precision, monkeypatch):
    """A static lossy precision holds every expert quantized on the device: a host memory limit far below one
    expert (given, or detected) does not refuse it, and nothing lands in host memory. The same limit refuses
    the exact paged placement, whose experts do live in host memory."""
    from pagedmoe import LLM
    from pagedmoe.engine import startup as llm_engine

    tiny = 1024 / 1024 ** 3  # 1 KiB
    common = dict(device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="host memory limit"):
        LLM(str(ckpt), cpu_moe=True, host_memory_gb=tiny, **common)
    engine = LLM(str(ckpt), expert_precision=f"static-{precision}", host_memory_gb=tiny, **common).engine
    assert engine.expert_store.host_bytes == 0 and engine.expert_store.quantized_bytes > 0
    monkeypatch.setattr(llm_engine, "detect_host_budget_bytes", lambda: 1024)
    engine = LLM(str(ckpt), expert_precision=f"static-{precision}", **common).engine
    assert engine.expert_store.host_bytes == 0


def test_table_places_a_quantized_tier():
    from pagedmoe.experts.table import ExpertKey, ExpertTable

    table = ExpertTable(2, 5)
    table.place([{0}, ()], [{1}, ()], [{2, 4}, range(5)], "int4")
    assert [(e.tier, e.slot, e.precision) for e in (table.entry(ExpertKey(0, i)) for i in range(5))] == [
        ("resident", 0, "bf16"), ("compressed", 0, "bf16"), ("quantized", 0, "int4"), ("host", 0, "bf16"),
        ("quantized", 1, "int4")]
    assert table.counts()[("quantized", "int4")] == 7
    with pytest.raises(ValueError, match="quantized and in another tier"):
        table.place([{0}, ()], None, [{0}, ()], "int8")
    with pytest.raises(ValueError, match="precision"):
        table.place([(), ()], None, [{0}, ()], "int3")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_store_quantizes_written_rows_and_dequantizes_into_any_rows(precision):
    """Rows written part by part are quantised once complete; the dequantised rows equal per-expert
    fake quantisation, for consecutive ids (one slice) and scattered ids (index_copy_)."""
    from pagedmoe.codecs.quant import fake_quantize
    from pagedmoe.experts.store import ExpertStore
    from pagedmoe.experts.table import ExpertTable

    H, I = 136, 24  # H > 128 with a short last int4 group; odd number of groups along I
    table = ExpertTable(2, 5)
    table.place([{0}, ()], None, [{1, 2, 3}, {0, 2, 4}], precision)
    store = ExpertStore(table, H, I, torch.bfloat16, torch.device("cpu"), paged=True)
    gen = torch.Generator().manual_seed(4)
    w = {(l, e): torch.randn(3 * I * H, generator=gen).mul_(0.05).to(torch.bfloat16)
         for l in range(2) for e in range(5)}
    for l, e in [(0, 1), (0, 2), (0, 3), (1, 0), (1, 2), (1, 4)]:
        store.write(l, e, "gate", w[l, e][:I * H].view(I, H))
        store.write(l, e, "up", w[l, e][I * H:2 * I * H].view(I, H))
    assert store.quantized == [None, None]
    for e in (1, 2, 3):
        store.write(0, e, "w2", w[0, e][2 * I * H:].view(H, I))
    assert store.quantized[0] is not None and store.quantized[1] is None
    store.finalize()  # layer 1's w2 parts were never written: quantised as staged (uninitialised is fine)
    for layer, ids in ((0, [1, 2, 3]), (1, [0, 2, 4])):
        packed = torch.full((5, store.stride), 7.0, dtype=torch.bfloat16)
        store.quantized[layer].dequantize_into(packed)
        for e in range(5):
            if e not in ids:
                assert torch.all(packed[e] == 7.0)  # other rows untouched
                continue
            if layer == 0:
                want = torch.cat([fake_quantize(w[0, e][:2 * I * H].view(2 * I, H), precision).reshape(-1),
                                  fake_quantize(w[0, e][2 * I * H:].view(H, I), precision).reshape(-1)])
                assert torch.equal(packed[e, :3 * I * H], want)
        # (layer 1's unwritten parts may hold NaNs: compared bit for bit with NaN == NaN)
        assert torch.allclose(packed[ids, :3 * I * H], store.quantized[layer].dequantize_rows(torch.bfloat16),
                              rtol=0, atol=0, equal_nan=True)


def test_expert_precision_flags(ckpt):
    from pagedmoe import LLM
    from pagedmoe.config import EngineConfig

    assert EngineConfig(expert_precision="dynamic").placement() == ("paged", 0)   # tests/models/test_dynamic*.py
    with pytest.raises(ValueError, match="expert_precision must be one of"):
        EngineConfig(expert_precision="int8")
    with pytest.raises(ValueError, match="cannot take effect"):
        LLM(str(ckpt), device="cpu", expert_placement="resident", expert_precision="static-int8")
    for flags in (dict(cpu_moe=True), dict(num_gpu_experts=2), dict(num_compressed_experts=2, dtype="bfloat16"),
                  dict(expert_compression="lossless", dtype="bfloat16")):
        with pytest.raises(ValueError, match="contradicts"):
            LLM(str(ckpt), device="cpu", expert_precision="static-int4", **flags)
    cfg = EngineConfig(expert_precision="static-fp8")
    assert cfg.quantized_precision() == "fp8" and cfg.placement() == ("paged", 0)
    assert EngineConfig().quantized_precision() is None and EngineConfig().expert_precision == "exact"


def test_expert_precision_cli_and_env(monkeypatch):
    import argparse

    from pagedmoe.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--expert-precision", "static-int4"])).expert_precision \
        == "static-int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--expert-precision", "int4"])
    monkeypatch.setenv("PAGEDMOE_EXPERT_PRECISION", "static-int8")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).quantized_precision() == "int8"


def test_default_model_perplexity_by_precision():
    """A few held-out windows of the default model (files 6-24, as docs/quality.md): int8 and fp8 within
    noise of exact, int4 a little worse but within a few percent."""
    from pagedmoe import LLM
    from pagedmoe.entrypoints.eval import default_dataset, evaluate, load_documents

    docs = load_documents(default_dataset())[6:]
    ppl = {}
    for mode in ("exact", "static-int8", "static-fp8", "static-int4"):
        engine = LLM(device="cpu", max_model_len=512, expert_precision=mode).engine
        ppl[mode] = evaluate(engine, docs, context=512, max_tokens=2048, show_progress=False)["perplexity"]
    assert 5 < ppl["exact"] < 20
    assert abs(ppl["static-int8"] / ppl["exact"] - 1) < 0.005, ppl
    assert abs(ppl["static-fp8"] / ppl["exact"] - 1) < 0.01, ppl
    assert 1.0 < ppl["static-int4"] / ppl["exact"] < 1.05, ppl


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("buffers", ["plain", "vmm"])
def test_static_precision_on_cuda(ckpt, eager, buffers):
    """On CUDA the pager dequantises on its copy stream (inside the decode CUDA graphs when not eager)."""
    from pagedmoe import LLM, SamplingParams

    def run(fake, **flags):
        llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_model_len=96, enforce_eager=eager, **flags)
        if fake:
            _fake_quantize_store(llm.engine.expert_store, "int4")
        captured = spy_logits(llm.engine, to_host=True)
        llm.generate([{"prompt_token_ids": [5, 9, 13, 2, 77]}, {"prompt_token_ids": [3] * 17}],
                     SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        return captured, llm.engine

    ref, _ = run(True, expert_placement="paged", num_gpu_experts=8, expert_buffers="plain")
    got, engine = run(False, expert_precision="static-int4", expert_buffers=buffers)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(q.device.type == "cuda" for q in engine.expert_store.quantized)
