"""--gpu-memory-gb bounds all device memory the process holds (GPU): Qwen3-30B-A3B's shape cut to 8 layers
(random weights, `--load-format dummy`) under `pagedmoe bench throughput` at tight budgets, each run in a
fresh process whose device memory an independent poller reads from torch.cuda.mem_get_info (the CUDA
context, torch's pool, VMM mappings alike). The peak stays within the budget + 2%; a budget that cannot hold
the model is refused at start in one line naming the minimum."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
GiB = 1024 ** 3

# The child: poll the device's use from before CUDA is touched to the end, run the CLI, report the peak.
CHILD = r"""
import json, sys, threading
import torch
peak, stop = [0], threading.Event()
def poll():
    while not stop.is_set():
        free, total = torch.cuda.mem_get_info()
        peak[0] = max(peak[0], total - free)
        stop.wait(0.002)
t = threading.Thread(target=poll, daemon=True)
t.start()
from pagedmoe.cli import main
rc = None
try:
    rc = main(sys.argv[2:])
except SystemExit as e:
    rc = e.code
finally:
    stop.set()
    t.join()
    json.dump({"rc": rc, "peak_bytes": peak[0]}, open(sys.argv[1], "w"))
sys.exit(0 if rc is None else rc)
"""


@pytest.fixture(scope="module")
def qwen3_8_layers(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # the device's use is read as a whole: other workers' memory would count as this run's
        pytest.skip("reads the whole device's memory: run alone (benchmarks/run_all.sh gputests does)")
    path = tmp_path_factory.mktemp("qwen3-8")
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    config["num_hidden_layers"] = 8      # 1.44 GiB of backbone, 9 GiB of experts
    (path / "config.json").write_text(json.dumps(config))
    return path


def _run(tmp_path, args: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "child.json"
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    before = total - free                # this process and any other: constant while the child runs
    proc = subprocess.run([sys.executable, "-c", CHILD, str(report), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PAGEDMOE_NO_PROGRESS": "1"})
    child = json.loads(report.read_text()) if report.exists() else {}
    child["process_peak_bytes"] = child.get("peak_bytes", before) - before
    return proc, child


WORKLOAD = ["--load-format", "dummy", "--max-model-len", "1024", "--input-len", "512", "--output-len", "32",
            "--num-prompts", "192", "--max-num-seqs", "256"]


@pytest.mark.parametrize("flags,budget", [
    (["--expert-placement", "paged"], 10.0),  # the measured minimum is 9.04 GiB (13799e8)
    (["--expert-placement", "resident"], 16.0),
    (["--expert-precision", "dynamic"], 12.0),
], ids=["paged", "resident", "dynamic"])
def test_peak_device_memory_stays_within_the_budget(qwen3_8_layers, tmp_path, flags, budget):
    out = tmp_path / "bench.json"
    proc, child = _run(tmp_path, ["bench", "throughput", str(qwen3_8_layers), *WORKLOAD, *flags,
                                  "--gpu-memory-gb", str(budget), "--output-json", str(out)])
    assert proc.returncode == 0 and child["rc"] == 0, proc.stderr[-3000:]
    peak = child["process_peak_bytes"]
    assert peak <= budget * GiB * 1.02, f"peak {peak / GiB:.2f} GiB over the {budget} GiB budget\n{proc.stderr[-3000:]}"
    rec = json.loads(out.read_text())["device_memory"]
    assert rec["budget_gib"] == pytest.approx(budget) and rec["peak_gib"] <= budget * 1.02
    # the engine's own count agrees with the independent one to within the context estimate
    assert abs(rec["peak_gib"] - peak / GiB) < 0.75
    assert "device memory: peak" in proc.stdout
    # it is a tight budget: the KV cache took what was left, so the peak is close to the budget
    assert peak >= 0.75 * budget * GiB


@pytest.mark.parametrize("placement,budget", [("paged", "5"), ("resident", "12")])
def test_a_budget_that_cannot_hold_the_model_is_refused_at_start_with_the_minimum(qwen3_8_layers, tmp_path,
                                                                                   placement, budget):
    proc, child = _run(tmp_path, ["bench", "throughput", str(qwen3_8_layers), *WORKLOAD,
                                  "--expert-placement", placement, "--gpu-memory-gb", budget])
    assert proc.returncode == 2 and child["rc"] == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pagedmoe bench: error:")]
    assert len(errors) == 1 and "needs" in errors[0] and "Traceback" not in proc.stderr
    assert child["process_peak_bytes"] < 3 * GiB      # refused before the experts were loaded
