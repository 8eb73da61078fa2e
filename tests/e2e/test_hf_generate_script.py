"""benchmarks/hf_generate.py (the HF transformers figures of docs/benchmarks.md) on the CPU with the default
model's config: random weights, `generate` for the asked number of tokens, its JSON. A smoke run of the
script the GPU session runs (run_all.sh hf); the offload path needs a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hf_generate_script_runs_on_cpu(tmp_path):
    out = tmp_path / "hf.json"
    proc = subprocess.run([sys.executable, "benchmarks/hf_generate.py", "src/pagedmoe/default_model", "--device", "cpu",
                           "--batch", "2", "--input-len", "16", "--output-len", "4", "--output-json", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert (res["batch"], res["input_len"], res["output_len"]) == (2, 16, 4)
    assert res["output_tokens_per_s"] > 0 and res["offloaded_gb"] == 0.0
    assert "attention mask is not set" not in proc.stderr
