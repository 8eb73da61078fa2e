"""The embedded default model: transformers agrees with pagedmoe, eval runs on CPU, generate prints text."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedmoe.config import default_model_path
from tiny_models import spy_logits


def test_default_model_is_shipped_in_the_package():
    path = Path(default_model_path())
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert 0 < size <= 40e6


def test_logits_match_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedmoe import LLM, SamplingParams

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.encode("import os\n\ndef read_config(path):\n    ")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    llm = LLM(device="cpu", dtype="float32", max_model_len=256)  # no model: the default one
    captured = spy_logits(llm.engine)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert (captured[0][0] - ref).abs().max().item() <= 1e-4


def test_ci_sized_eval_under_two_minutes(tmp_path):
    from pagedmoe.cli import main

    out = tmp_path / "eval.json"
    start = time.perf_counter()
    assert main(["eval", "--max-tokens", "3000", "--device", "cpu", "--output-json", str(out)]) == 0
    elapsed = time.perf_counter() - start
    r = json.loads(out.read_text())
    assert r["tokens"] == 3000
    assert r["perplexity"] < 40  # the unigram baseline is ~1300 (docs/default-model.md)
    assert r["top1_accuracy"] > 0.3
    assert elapsed < 120


def test_readme_main_job_prints_text():
    src = str(Path(__file__).resolve().parents[2] / "src")
    r = subprocess.run([sys.executable, "-m", "pagedmoe.cli", "generate", "--prompt", "def fibonacci(n):",
                        "--max-tokens", "32", "--device", "cpu"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": src})
    assert r.returncode == 0, r.stderr
    body = r.stdout.split("--- prompt:", 1)[1]
    assert "def fibonacci(n):" in body and len(body) > 60
