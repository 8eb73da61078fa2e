"""benchmarks/profile_step.py on CPU (the CPU ops stand in for kernels): decode and --prefill records."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *flags):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PAGEDMOE_NO_PROGRESS="1", OMP_NUM_THREADS="1")
    # --max-model-len 256 (>= 8 in + 128 out, --output-len's default): the KV cache for 256 x 256 tokens, not the
    # 2048 x 256 of the model's context (3 GiB of zeros on the CPU, 2-4 s of each run)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--device", "cpu",
                           "--num-steps", "2", "--max-model-len", "256", "--out", str(tmp_path), *flags], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_prefill_profile_against_its_compute_floor(tmp_path):
    out = _run(tmp_path, "--prefill", "--input-len", "16", "--max-num-batched-tokens", "64")
    assert "=== prefill 4 x 16 = 64 tokens" in out and "compute floor" in out
    r = json.loads((tmp_path / "profile_prefill_64.json").read_text())
    assert r["prompts_per_step"] == 4 and len(r["wall_ms"]) == 2 and len(r["profiled_wall_ms"]) == 2
    assert "under the profiler" in out and "back to back (8 prompts queued at once" in out
    assert r["back_to_back_ms"] > 0
    assert r["floor_ms"] > 0 and r["tflop_per_step"] > 0 and r["classes"]["moe"]["launches_per_step"] > 0


def test_decode_profile_per_batch(tmp_path):
    out = _run(tmp_path, "--batch-size", "2", "--input-len", "8")
    assert "=== batch 2" in out
    r = json.loads((tmp_path / "profile_b2.json").read_text())
    assert r["batch_size"] == 2 and r["kernel_ms_per_step"] > 0 and "moe" in r["classes"]


def _event(name, start, end, cuda):
    from types import SimpleNamespace

    import torch

    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))


def test_gpu_gaps_splits_a_step_into_lead_stalls_and_tail():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_step as ps
    finally:
        sys.path.pop(0)
    events = [_event(ps.STEP_MARK, 0, 1000, False), _event(ps.STEP_MARK, 0, 1000, True),   # the mark's GPU twin
              _event("a", 100, 300, True), _event("b", 305, 400, True),          # 5 us: launch spacing
              _event("c", 350, 380, True),                                       # inside b: no gap
              _event("d", 500, 900, True),                                       # 100 us stall after b
              _event("aten::mm", 950, 960, False),                               # host op: not a kernel
              _event(ps.STEP_MARK, 2000, 2500, False), _event("e", 2010, 2400, True)]
    g = ps.gpu_gaps(events)
    assert g["lead_us"] == 100 + 10 and g["tail_us"] == 100 + 100
    assert g["idle_us"] == 100 and g["small_idle_us"] == 5
    assert g["gaps"] == [(100, "b", "d")]
