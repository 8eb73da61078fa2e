"""`pagedmoe compress --precisions`: lossy expert forms written offline are what --expert-precision
dynamic loads (same values as quantising on the fly), with compress-time quality costs."""
from __future__ import annotations

import json

import torch

from tiny_models import make_tiny_checkpoint


def test_compress_precisions_round_trip(tmp_path):
    from pagedmoe import LLM
    from pagedmoe.cli import main

    src, out = tmp_path / "src", tmp_path / "out"
    make_tiny_checkpoint("qwen3_moe", src, seed=5, num_hidden_layers=2, dtype=torch.bfloat16)
    assert main(["compress", str(src), str(out), "--device", "cpu", "--precisions", "int8", "int4"]) == 0
    folder = out / "expert-lossy"
    assert (folder / "int8.safetensors").is_file() and (folder / "int4.safetensors").is_file()
    quality = json.loads((folder / "quality.json").read_text())
    assert len(quality["rel_error"]) == 2 * 8
    assert all(0 < v["int8"] < v["int4"] < 0.5 for _, _, v in quality["rel_error"])

    ids = list(range(3, 40))
    logits, used = [], []
    for path in (src, out):
        llm = LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=64, expert_precision="dynamic",
                  num_kv_blocks=64)
        e = llm.engine
        e.expert_store.dynamic.build_all({k: "int4" for k in e.expert_store.dynamic.keys})
        logits.append(e.score(ids))
        used.append(e.get_stats()["precision_offline_forms_used"])
        if path == out:   # the compress-time costs seeded the manager's quality costs
            assert e.precision.costs.rel_error[(0, 0)]["int4"] == quality["rel_error"][0][2]["int4"]
    assert used == [0, 16]
    assert torch.equal(logits[0], logits[1])
