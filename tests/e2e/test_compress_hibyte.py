"""`pagedmoe compress --format hibyte` (candidate lossless version 3, codecs/hibyte.py): byte-exact decompress,
identical logits from the compressed folder, corrupted experts refused by name, readers of versions 1-2 refuse
it in one line, shapes it cannot hold refused for experts."""
from __future__ import annotations

import json

import pytest
import torch

from test_compress import (_files, _header, cli, compressed_folder, decompresses_exactly_with_the_same_logits,
                           refused_by_name)
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_bf16_h")
    # experts [64, 64]: a multiple of 64 columns and of 16 rows, as the format needs
    make_tiny_checkpoint("mixtral", path, seed=13, dtype=torch.bfloat16, max_shard_size="200KB", intermediate_size=64)
    return path


@pytest.fixture(scope="module")
def packed(src, tmp_path_factory):
    return compressed_folder(tmp_path_factory, src, "hibyte")


def test_hibyte_folder_roundtrip_and_logits(src, packed, tmp_path):
    assert _files(packed) == _files(src)
    for shard in packed.glob("*.safetensors"):
        _, header = _header(shard)
        info = json.loads(header["__metadata__"]["pagedmoe.lossless"])
        if not info["tensors"]:
            continue  # a shard of backbone tensors only
        assert info["version"] == 3 and all(len(h["checksums"]) == h["num_parts"] for h in info["tensors"].values())
        assert all(k + ".lx.tile_raw" in header for k in info["tensors"])
    decompresses_exactly_with_the_same_logits(src, packed, tmp_path)


@pytest.mark.parametrize("array", ["lo", "code", "base", "tile_raw"])
def test_hibyte_corrupted_expert_refused_by_name(packed, tmp_path, capsys, array):
    # a changed raw-tile index is caught by the array checks before the crc32s
    refused_by_name(packed, tmp_path, capsys, array, r": the raw-tile indices" if array == "tile_raw" else r".*crc32")


def test_older_readers_refuse_version_3_in_one_line(packed):
    from pagedmoe.codecs.lossless import CorruptCheckpointError
    from pagedmoe.codecs.lossless_io import load_compressed

    shard = next(packed.glob("*.safetensors"))
    with pytest.raises(CorruptCheckpointError, match=r"v3, this reader takes pagedmoe-lossless-bf16 v1 / v2"):
        load_compressed(str(shard), versions=(1, 2))
    compressed, _ = load_compressed(str(shard))
    assert compressed and all(ct.version == 3 for ct in compressed.values())


def test_expert_shapes_it_cannot_hold(tmp_path, capsys):
    make_tiny_checkpoint("mixtral", tmp_path / "m", seed=2, dtype=torch.bfloat16)  # w2 [64, 32]: 32 columns
    assert cli("compress", tmp_path / "m", tmp_path / "o", "--format", "hibyte", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert "multiple of 64 columns" in err and "--format tiled takes any shape" in err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("*.safetensors"))
