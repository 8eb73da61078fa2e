"""Tuned fused-MoE tile tables (kernels/fused_moe_tuned.py): lookup by shape and batch, the fallback to
default_config, bad tables, the launcher taking a table's tiles, and benchmarks/tune_fused_moe.py writing a
table that loads (a quick grid on a tiny shape under the interpreter)."""
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' import (see test_fused_moe.py)

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagedmoe.kernels import fused_moe as fm  # noqa: E402
from pagedmoe.kernels import fused_moe_tuned as fmc  # noqa: E402
from pagedmoe.models.layers.moe import experts_loop  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interp import fix_interpreter_index  # noqa: E402

    fix_interpreter_index()

CFG_1 = dict(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=2, block_n2=16, block_k2=64,
             num_warps2=4, num_stages2=2, split_k=1, swap_ab=False)
CFG_16 = dict(CFG_1, block_n=32, block_n2=32, split_k=0)


@pytest.fixture
def table(tmp_path, monkeypatch):
    def write(shapes, name="t.json"):
        path = tmp_path / name
        path.write_text(json.dumps({"device": "x", "dtype": "float16", "shapes": shapes}))
        monkeypatch.setenv(fmc.ENV, str(path))
        fmc.clear_cache()
        return path
    yield write
    fmc.clear_cache()


def test_lookup_takes_the_next_tuned_batch(table):
    table({fmc.shape_key(4, 32, 32, 2): {"16": CFG_16, "1": CFG_1}})
    look = lambda T, E=4: fmc.tuned_config(T, 2, E, 32, 32, torch.float16, DEVICE)  # noqa: E731
    assert look(1) == fm.FusedMoEConfig(**CFG_1)
    assert look(8) == look(16) == fm.FusedMoEConfig(**CFG_16)               # the next tuned batch up
    assert look(17) is None and look(500) is None                            # past the table: default_config
    assert look(2) is None and look(7) is None                               # a gap (16 > 2 T): default_config
    assert look(1, E=8) is None                                              # shape not tuned: default_config
    assert fmc.tuned_config(1, 2, 4, 32, 32, torch.float32, DEVICE) is None  # float32 keeps its small tiles


def test_no_table_and_bad_tables(table, monkeypatch, tmp_path):
    monkeypatch.setenv(fmc.ENV, "off")
    fmc.clear_cache()
    assert fmc.tuned_config(1, 2, 4, 32, 32, torch.float16, DEVICE) is None
    monkeypatch.setenv(fmc.ENV, str(tmp_path / "missing.json"))
    fmc.clear_cache()
    with pytest.raises(ValueError, match="no such file"):
        fmc.tuned_config(1, 2, 4, 32, 32, torch.float16, DEVICE)
    path = table({fmc.shape_key(4, 32, 32, 2): {"1": dict(CFG_1, block_q=3)}})
    with pytest.raises(ValueError, match=f"{path}.*unknown FusedMoEConfig fields"):
        fmc.tuned_config(1, 2, 4, 32, 32, torch.float16, DEVICE)
    table({fmc.shape_key(4, 32, 32, 2): {"1": dict(CFG_1, block_n=24)}})
    with pytest.raises(ValueError, match="malformed.*power of two"):
        fmc.tuned_config(1, 2, 4, 32, 32, torch.float16, DEVICE)
    (tmp_path / "junk.json").write_text("{not json")
    monkeypatch.setenv(fmc.ENV, str(tmp_path / "junk.json"))
    fmc.clear_cache()
    with pytest.raises(ValueError, match="malformed"):
        fmc.tuned_config(1, 2, 4, 32, 32, torch.float16, DEVICE)


def test_table_names():
    assert fmc.table_name("NVIDIA H200", torch.bfloat16) == "fused_moe_NVIDIA_H200_bfloat16.json"
    assert fmc.table_name("NVIDIA H100 80GB HBM3", torch.float16) == "fused_moe_NVIDIA_H100_80GB_HBM3_float16.json"


def _layer(T, E, H, I, A, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(T)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=DEVICE) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g, device=DEVICE) * I ** -0.5).to(dtype)
    x = torch.randn(T, H, generator=g, device=DEVICE).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g, device=DEVICE), -1), A, dim=-1)
    return x, w13, w2, weights, ids


def test_launcher_uses_the_table_else_the_defaults(table, monkeypatch):
    dtype = torch.float16
    x, w13, w2, weights, ids = _layer(3, 4, 32, 32, 2, dtype)
    ref = experts_loop(x.double(), w13.double(), w2.double(), weights, ids).float()
    calls = []
    orig = fm.default_config
    monkeypatch.setattr(fm, "default_config", lambda *a, **k: calls.append(a) or orig(*a, **k))
    table({fmc.shape_key(4, 32, 32, 2): {"4": CFG_1}})
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert calls == []  # the table's tiles, not the defaults
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3
    table({fmc.shape_key(8, 32, 32, 2): {"4": CFG_1}})  # another shape only: the defaults
    out = fm.fused_moe(x, w13, w2, weights, ids)
    assert len(calls) == 1 and ((out.float() - ref).norm() / ref.norm()).item() < 2e-3


def test_tuner_writes_a_table_that_loads(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import tune_fused_moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert tune_fused_moe.main(["--models", "4,32,32,2", "--batches", "1", "3", "--dtype", "float16", "--device",
                                device, "--copies", "1", "--quick", "--out", str(tmp_path)]) == 0
    name = fmc.table_name(torch.cuda.get_device_name() if device == "cuda" else "cpu", torch.float16)
    written = json.loads((tmp_path / name).read_text())
    assert set(written["shapes"][fmc.shape_key(4, 32, 32, 2)]) == {"1", "3"}
    monkeypatch.setenv(fmc.ENV, str(tmp_path / name))
    fmc.clear_cache()
    try:
        got = fmc.tuned_config(2, 2, 4, 32, 32, torch.float16, DEVICE)
        assert dataclasses.asdict(got) == written["shapes"][fmc.shape_key(4, 32, 32, 2)]["3"]
    finally:
        fmc.clear_cache()
    # --resume keeps the entries it finds and tunes only the rest
    assert tune_fused_moe.main(["--models", "4,32,32,2", "--batches", "1", "3", "5", "--dtype", "float16",
                                "--device", device, "--copies", "1", "--quick", "--out", str(tmp_path / "b"),
                                "--resume", str(tmp_path / name)]) == 0
    again = json.loads((tmp_path / "b" / name).read_text())["shapes"][fmc.shape_key(4, 32, 32, 2)]
    assert set(again) == {"1", "3", "5"} and again["1"] == written["shapes"][fmc.shape_key(4, 32, 32, 2)]["1"]
