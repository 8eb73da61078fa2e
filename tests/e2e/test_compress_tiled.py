"""`pagedmoe compress --format tiled` (lossless format version 2): byte-exact decompress, identical logits from
the compressed folder, corrupted experts refused by name, the fused [E, ...] layout one part per expert."""
from __future__ import annotations

import filecmp
import json

import pytest
import torch

from test_compress import (_files, _fused, _header, cli, compressed_folder, decompresses_exactly_with_the_same_logits,
                           refused_by_name)
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_bf16_t")
    make_tiny_checkpoint("mixtral", path, seed=12, dtype=torch.bfloat16, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def packed(src, tmp_path_factory):
    return compressed_folder(tmp_path_factory, src, "tiled")


def test_tiled_folder_roundtrip_and_logits(src, packed, tmp_path, capsys):
    assert _files(packed) == _files(src)
    for shard in packed.glob("*.safetensors"):
        _, header = _header(shard)
        info = json.loads(header["__metadata__"]["pagedmoe.lossless"])
        assert info["version"] == 2 and all(h["tile_cols"] == 64 for h in info["tensors"].values())
        assert all(k + ".lx.nibbles" in header for k in info["tensors"])
    decompresses_exactly_with_the_same_logits(src, packed, tmp_path)


@pytest.mark.parametrize("array", ["raw", "nibbles", "base"])
def test_tiled_corrupted_expert_refused_by_name(packed, tmp_path, capsys, array):
    refused_by_name(packed, tmp_path, capsys, array)


def test_tiled_fused_experts_and_refusals(tmp_path, capsys):
    make_tiny_checkpoint("qwen3_moe", tmp_path / "q", seed=4, dtype=torch.bfloat16)
    src = tmp_path / "fused"
    _fused(tmp_path / "q", src)
    packed = tmp_path / "c"
    assert cli("compress", src, packed, "--format", "tiled", "--device", "cpu") == 0
    _, header = _header(packed / "model.safetensors")
    assert json.loads(header["__metadata__"]["pagedmoe.lossless"])["tensors"][
        "model.layers.0.mlp.experts.gate_up_proj"]["num_parts"] == 8
    assert cli("decompress", packed, tmp_path / "d", "--device", "cpu") == 0
    assert filecmp.cmp(src / "model.safetensors", tmp_path / "d" / "model.safetensors", shallow=False)
    assert cli("compress", src, tmp_path / "o", "--format", "tiled", "--max-code-len", "10") == 2
    assert "--max-code-len" in capsys.readouterr().err and not (tmp_path / "o").exists()
