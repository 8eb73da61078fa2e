"""The --gpu-memory-gb bound's accounting on fake capacities (no GPU): the process-memory monitor over a faked
torch.cuda.mem_get_info, the reserve start-up keeps, and the KV cache sized from measured memory."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pagedmoe.planning import kv_sizing as m
from pagedmoe.planning.kv_sizing import GiB, BudgetError

MiB = 1 << 20


@pytest.fixture
def fake_cuda(monkeypatch):
    """A 100 GiB device with 10 GiB in use at start; `state` sets free memory and torch's reservation."""
    from pagedmoe.worker import device_memory as dm

    state = {"free": 90 * GiB, "total": 100 * GiB, "reserved": 0, "nvml": None}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["reserved"] // 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device=None: None)
    monkeypatch.setattr(dm, "_nvml_process_bytes", lambda idx: state["nvml"])
    return state


def make_monitor(period_s=0.001):
    from pagedmoe.worker.device_memory import DeviceMemoryMonitor

    return DeviceMemoryMonitor(torch.device("cuda", 0), period_s=period_s)


def test_monitor_counts_the_process_not_other_processes(fake_cuda):
    mon = make_monitor()
    # without NVML the context is estimated; the rest of the 10 GiB in use belongs to other processes
    assert mon.others_bytes == 10 * GiB - m.CUDA_CONTEXT_BYTES
    assert mon.context_bytes == m.CUDA_CONTEXT_BYTES and mon.context_source == "estimate"
    assert mon.stages["context"] == m.CUDA_CONTEXT_BYTES
    fake_cuda["free"] = 70 * GiB                       # the process grew by 20 GiB
    assert mon.used_bytes() == 20 * GiB + m.CUDA_CONTEXT_BYTES
    fake_cuda["free"] = 85 * GiB
    assert mon.mark("after") == 5 * GiB + m.CUDA_CONTEXT_BYTES and mon.stages["after"] == mon.used_bytes()
    assert mon.peak_bytes == 20 * GiB + m.CUDA_CONTEXT_BYTES   # the peak stays
    rec = mon.record(budget_bytes=20 * GiB)
    assert rec["peak_over_budget"] == pytest.approx((20 * GiB + m.CUDA_CONTEXT_BYTES) / (20 * GiB))
    assert rec["budget_gib"] == 20 and rec["stages_gib"]["after"] == pytest.approx(5 + m.CUDA_CONTEXT_BYTES / GiB)
    fake_cuda["reserved"] = 3 * GiB        # torch's share of a stage, and its peak allocation, are recorded too
    mon.mark("pool")
    rec = mon.record()
    assert rec["torch_reserved_stages_gib"] == {"after": 0, "pool": 3} and rec["torch_peak_allocated_gib"] == 1.5
    from pagedmoe.bench.common import device_memory_line

    assert device_memory_line(rec).endswith("torch's peak reservation 3.00 GiB (peak allocation 1.50 GiB)")
    mon.reset_peak()
    assert mon.peak_bytes == 5 * GiB + m.CUDA_CONTEXT_BYTES


def test_monitor_names_where_the_peak_was(fake_cuda):
    """The peak's sample keeps the last stage marked before it and torch's reservation then: memory beyond the
    reservation at the peak was held outside torch's pool (the fused tier's start-up peak on the H100, session35)."""
    from pagedmoe.bench.common import device_memory_line

    mon = make_monitor()
    fake_cuda["reserved"], fake_cuda["free"] = 40 * GiB, 50 * GiB
    mon.mark("kv_cache")
    fake_cuda["free"] = 45 * GiB                        # 5 GiB more, none of it torch's
    mon.used_bytes()
    fake_cuda["reserved"], fake_cuda["free"] = 41 * GiB, 49 * GiB
    mon.mark("cuda_graphs")                             # below the peak: the peak's record stays
    assert (mon.peak_stage, mon.peak_torch_reserved_bytes) == ("kv_cache", 40 * GiB)
    rec = mon.record()
    assert rec["peak_after_stage"] == "kv_cache" and rec["torch_reserved_at_peak_gib"] == 40
    assert "(after start-up stage kv_cache, torch's pool 40.00 GiB of it)" in device_memory_line(rec)
    assert mon.peak_summary() == "after stage kv_cache, torch's pool 40.00 GiB of it"


def test_monitor_takes_nvml_figure_and_torch_pool_as_its_own(fake_cuda):
    fake_cuda["nvml"] = 1 * GiB                         # NVML: this process holds 1 GiB
    fake_cuda["reserved"] = 512 * MiB
    mon = make_monitor()
    assert mon.others_bytes == 9 * GiB and mon.context_source == "nvml"
    assert mon.context_bytes == 512 * MiB               # NVML's figure less torch's pool
    assert mon.used_bytes() == 1 * GiB


def test_poller_catches_a_peak_between_readings(fake_cuda):
    mon = make_monitor().start()
    try:
        base = mon.samples
        fake_cuda["free"] = 50 * GiB                    # a transient no caller reads
        deadline = time.monotonic() + 5
        while mon.samples < base + 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        fake_cuda["free"] = 89 * GiB
    finally:
        mon.stop()
    assert mon.peak_bytes == 40 * GiB + m.CUDA_CONTEXT_BYTES


def test_polling_pauses_during_graph_capture(fake_cuda, monkeypatch):
    """worker/cuda_graph.py captures inside polling_paused: no thread reads the device meanwhile."""
    from pagedmoe.worker import device_memory as dm

    mon = make_monitor()
    monkeypatch.setitem(dm._MONITORS, 0, mon)
    mon.start()
    try:
        with dm.polling_paused():
            time.sleep(0.01)                           # a reading in flight finishes before the gate closes
            before = mon.samples
            time.sleep(0.05)
            assert mon.samples == before
        deadline = time.monotonic() + 5
        while mon.samples == before and time.monotonic() < deadline:
            time.sleep(0.005)
        assert mon.samples > before
    finally:
        mon.stop()


def test_pure_accounting():
    assert m.process_device_bytes(100, 30, 20) == 50 and m.process_device_bytes(100, 90, 20) == 0
    assert m.others_at_start(100, 80, 5) == 15 and m.others_at_start(100, 99, 5) == 0
    # graphs: the largest bucket's activations (they end at the hidden states: no logits in the pool)
    g = m.graph_pool_bytes([1, 2, 4], 64, 32, 2, 1000, 2)
    assert g == m.estimate_activation_bytes(4, 0, 64, 32, 2, 1000, 2)
    assert m.graph_pool_bytes([], 64, 32, 2, 1000, 2) == 0
    # prefill graphs: their tokens' activations when more than the decode bucket's
    g = m.graph_pool_bytes([1, 2, 4], 64, 32, 2, 1000, 2, prefill_tokens=512)
    assert g == m.estimate_activation_bytes(512, 0, 64, 32, 2, 1000, 2)
    assert m.prefill_buckets(512) == [16, 32, 64, 128, 256, 512] and m.prefill_buckets(100) == [16, 32, 64, 100]
    assert m.prefill_buckets(8) == [8] and m.prefill_buckets(0) == []
    # a build: one layer of exact experts + the quantiser's float32 temporaries of one expert
    assert m.dynamic_build_bytes(8, 100, 50) == 800 + 600
    r = m.device_reserve_bytes(1000 * MiB, 100 * MiB, 0, 600 * MiB)
    assert r == 600 * MiB + 100 * MiB + m.WORKSPACE_BYTES + int(m.FRAGMENTATION_FRACTION * 1100 * MiB)


def test_plan_memory_keeps_the_reserve_and_names_the_minimum_with_it():
    plan = m.size_kv_cache(20 * GiB, 10 * GiB, 1 * GiB, 1 * MiB, 16, 1024, 10 ** 6, reserve_bytes=2 * GiB)
    assert plan.num_kv_blocks == 7 * 1024 and plan.reserve_bytes == 2 * GiB
    assert "reserved 2.00 GiB" in plan.summary()
    with pytest.raises(BudgetError, match=r"the reserve \(2.00 GiB.*the minimum is 13.06 GiB") as e:
        m.size_kv_cache(13 * GiB, 10 * GiB, 1 * GiB, 1 * MiB, 16, 1024, 10 ** 6, reserve_bytes=2 * GiB)
    assert "\n" not in str(e.value)          # one line
    need = 13 * GiB + 64 * MiB       # the minimum it names is enough
    assert m.size_kv_cache(need, 10 * GiB, 1 * GiB, 1 * MiB, 16, 1024, 10 ** 6, reserve_bytes=2 * GiB).num_kv_blocks == 64


# -- the engine's KV sizing from measured memory (engine/startup.py::plan_kv_cache on fakes) -------------------------
def fake_engine(monkeypatch, budget_gib, measured, dynamic_floor=0, profile=1 * GiB, eager=True):
    """An object whose _plan_memory() runs the engine's KV sizing (engine/startup.py::plan_kv_cache) on fakes."""
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine import startup

    calls = []

    def profile_step_bytes(*args, **kw):
        calls.append(args)
        return profile

    monkeypatch.setattr(startup, "profile_step_bytes", profile_step_bytes)
    dims = SimpleNamespace(num_layers=48, num_kv_heads=8, head_dim=128, hidden_size=256, moe_intermediate_size=128,
                           top_k=2, vocab_size=1000)
    store = SimpleNamespace(device_bytes=8 * GiB + dynamic_floor, dynamic_bytes=dynamic_floor,
                            dynamic=object() if dynamic_floor else None, dynamic_build_bytes=GiB if dynamic_floor else 0)
    params = [SimpleNamespace(numel=lambda: GiB, element_size=lambda: 2)]      # 2 GiB of backbone
    model = SimpleNamespace(dims=dims, expert_store=store, parameters=lambda: params)
    marks = {}
    memory = SimpleNamespace(total_bytes=140 * GiB, others_bytes=0,
                             mark=lambda stage: marks.setdefault(stage, measured))
    config = EngineConfig(model="x", gpu_memory_gb=budget_gib, max_model_len=1024, max_num_seqs=64,
                          max_num_batched_tokens=2048, enforce_eager=eager)
    e = SimpleNamespace(_plan_memory=lambda: startup.plan_kv_cache(config, model, torch.device("cuda", 0),
                                                                   torch.bfloat16, 1024, memory, eager))
    return e, calls


def test_kv_gets_the_budget_less_what_is_measured_and_reserved(monkeypatch):
    # 10 GiB of weights allocated, the device shows 11 GiB: 1 GiB of context, torch cache, driver memory
    e, calls = fake_engine(monkeypatch, 20, measured=11 * GiB)
    plan = e._plan_memory()
    assert len(calls) == 1 and plan.activation_bytes == 1 * GiB      # measured by the profile step
    reserve = 1 * GiB + m.device_reserve_bytes(1 * GiB)
    assert plan.reserve_bytes == reserve
    per_block = plan.kv_bytes_per_block
    assert plan.num_kv_blocks == (20 * GiB - 10 * GiB - 1 * GiB - reserve) // per_block
    assert plan.weight_bytes + plan.activation_bytes + plan.reserve_bytes + plan.kv_bytes <= 20 * GiB


def test_graphs_are_reserved_unless_eager(monkeypatch):
    eager, _ = fake_engine(monkeypatch, 20, measured=11 * GiB)
    graphs, _ = fake_engine(monkeypatch, 20, measured=11 * GiB, eager=False)
    assert graphs._plan_memory().reserve_bytes > eager._plan_memory().reserve_bytes


def test_dynamic_floor_is_not_counted_twice_and_the_build_is_reserved(monkeypatch):
    # dynamic: the experts' 3 GiB floor is counted in the weights but built after the KV cache; no profile
    e, calls = fake_engine(monkeypatch, 30, measured=11 * GiB, dynamic_floor=3 * GiB)
    plan = e._plan_memory()
    assert not calls and plan.weight_bytes == 13 * GiB
    assert plan.reserve_bytes == 1 * GiB + m.device_reserve_bytes(plan.activation_bytes, 0, GiB)


def test_a_budget_too_small_is_refused_with_a_minimum_that_works(monkeypatch):
    e, _ = fake_engine(monkeypatch, 12, measured=11 * GiB)
    with pytest.raises(BudgetError, match="the minimum is") as err:
        e._plan_memory()
    need_gib = float(str(err.value).split("the minimum is ")[1].split(" GiB")[0])
    ok, _ = fake_engine(monkeypatch, need_gib + 0.01, measured=11 * GiB)
    assert ok._plan_memory().num_kv_blocks >= 1024 // 16


# -- serving: the server exports its device memory, bench serve reads it back --------------------------------
def test_server_exports_device_memory_and_bench_serve_reads_it(monkeypatch):
    import httpx

    from pagedmoe.bench.serve import server_device_memory
    from pagedmoe.server.metrics import ServerMetrics

    stats = {"device_memory_used_bytes": 20 * GiB, "device_memory_peak_bytes": 23 * GiB,
             "gpu_memory_budget_bytes": 24 * GiB}
    metrics = ServerMetrics("m")
    metrics.attach_engine(lambda: stats, {})
    text = metrics.render().decode()
    assert 'pagedmoe:device_memory_peak_bytes{model_name="m"}' in text
    seen = {}

    def get(url, headers=None, timeout=None):
        seen.update(url=url, headers=headers)
        return httpx.Response(200, text=text, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    got = server_device_memory("http://h:1", "key")
    assert seen == {"url": "http://h:1/metrics", "headers": {"Authorization": "Bearer key"}}
    assert got == {"used_gib": 20.0, "peak_gib": 23.0, "budget_gib": 24.0, "peak_over_budget": 23 / 24}
    # a server without the gauges (CPU, another server): nothing recorded
    stats.clear()
    text = metrics.render().decode()
    assert "device_memory" not in text and server_device_memory("http://h:1", None) == {}
