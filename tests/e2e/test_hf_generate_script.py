"""benchmarks/hf_generate.py (the HF transformers figures of docs/benchmarks.md) on the CPU with the default
model's config: random weights, `generate` for the asked number of tokens, its JSON. A smoke run of the
script the GPU session runs (run_all.sh hf, hf-offload-*); on the CPU the offload path builds its device map and
places every weight in host memory, which runs the code that fills the offloaded weights on the GPU machine."""
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


def test_hf_generate_offload_path_builds_on_cpu(tmp_path):
    """--gpu-memory-gb: the model on the meta device, accelerate's device map, every weight generated and put
    where the map says (on the CPU all of them land in host memory, as the offloaded ones do on the GPU)."""
    out = tmp_path / "hf.json"
    proc = subprocess.run([sys.executable, "benchmarks/hf_generate.py", "src/pagedmoe/default_model", "--device", "cpu",
                           "--batch", "2", "--input-len", "16", "--output-len", "3", "--gpu-memory-gb", "0.01",
                           "--host-memory-gb", "4", "--output-json", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["output_len"] == 3 and res["output_tokens_per_s"] > 0
    # the default model's ~22 M bf16 parameters, every one in host memory
    assert 0.03 < res["offloaded_gb"] < 0.06
