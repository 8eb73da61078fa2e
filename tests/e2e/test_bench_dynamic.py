"""benchmarks/bench_dynamic.py's logic on the default model (4 layers, 8 short requests): the burst preempts
under the static exact plan and not under dynamic precision, and the steady window's ABBA slices add up to
the window. A smoke run of the script the GPU session runs (run_all.sh dynamic), not a measurement."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark (run_all.sh dynamic)")
def test_bench_dynamic_script_runs_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OUT=str(tmp_path), PAGEDMOE_NO_PROGRESS="1",
               BENCH_DYNAMIC_CONFIG=str(ROOT / "src/pagedmoe/default_model"), BENCH_DYNAMIC_LAYERS="4",
               BENCH_DYNAMIC_REQS="8", BENCH_DYNAMIC_PROMPT="64", BENCH_DYNAMIC_OUTPUT="16")
    proc = subprocess.run([sys.executable, "benchmarks/bench_dynamic.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench_dynamic.json").read_text())
    assert res["static_exact"]["num_preemptions"] > 0          # KV forced to 60% of the burst's need
    assert res["dynamic"]["num_preemptions"] == 0
    assert res["dynamic"]["num_kv_blocks"] > res["static_exact"]["num_kv_blocks"]
    st = res["steady"]
    assert [s["controller"] for s in st["slices"]] == [True, False, False, True, True, False, False, True]
    assert math.isclose(st["dynamic_s"] + st["held_s"], st["window_s"], rel_tol=1e-9)
    assert st["dynamic_steps"] + st["held_steps"] == st["window_steps"] > 0
    assert st["dynamic_output_tokens"] + st["held_output_tokens"] == st["window_output_tokens"]
    assert math.isclose(res["controller_cost"], st["held_output_throughput"] / st["dynamic_output_throughput"] - 1)
    assert "controller cost:" in proc.stdout
