"""`pagedmoe compress` / `decompress` on tiny bf16 checkpoints: byte-exact round trip of every file,
identical logits from the compressed folder, corrupted experts refused by name, bad input refused."""
from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must precede the kernels' import: triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tiny_models import greedy_logits, make_tiny_checkpoint  # noqa: E402


def cli(*argv) -> int:
    from pagedmoe.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_bf16")
    make_tiny_checkpoint("mixtral", path, seed=11, dtype=torch.bfloat16, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) == 2
    return path


@pytest.fixture(scope="module")
def packed(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "c"
    assert cli("compress", src, out, "--device", "cpu") == 0
    return out


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _header(p: Path) -> tuple[int, dict]:
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, json.loads(raw[8 : 8 + n])


def _logits_trace(path, **flags):
    """Logits of every sampling step of a small greedy batch."""
    from pagedmoe import LLM

    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=64, **flags)
    return greedy_logits(llm, (7, 19, 3), max_tokens=4, seed=5)[0]


def test_compressed_folder_is_complete_and_experts_are_compressed(src, packed, capsys):
    assert _files(packed) == _files(src)  # same shard names, index, config and tokenizer files
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"):
        assert filecmp.cmp(src / name, packed / name, shallow=False)
    for shard in packed.glob("*.safetensors"):
        _, header = _header(shard)
        meta = header["__metadata__"]
        assert meta["format"] == "pt"  # the original metadata is kept
        lossless = json.loads(meta["pagedmoe.lossless"])["tensors"]
        plain = [k for k in header if k != "__metadata__" and ".lx." not in k]
        assert lossless and all(".experts." in k for k in lossless)
        assert not any(".experts." in k for k in plain)  # every expert tensor is compressed
        assert all(header[k + ".lx.raw"]["dtype"] == "U8" for k in lossless)


def test_ratios_printed(src, tmp_path, capsys):
    assert cli("compress", src, tmp_path / "c", "--device", "cpu", "--no-verify") == 0
    out = capsys.readouterr().out
    for kind in ("experts.w1", "experts.w2", "experts.w3", "attention", "embeddings", "all tensors"):
        assert kind in out
    # on these tiny tensors the per-block lane lengths cost a lot: experts only just shrink
    ratio = float(next(line for line in out.splitlines() if line.startswith("experts.w1")).split()[-1])
    assert 0.5 < ratio < 1.0


def test_decompress_is_byte_exact(src, packed, tmp_path):
    out = tmp_path / "d"
    assert cli("decompress", packed, out, "--device", "cpu") == 0
    assert _files(out) == _files(src)
    for rel in _files(src):
        assert filecmp.cmp(src / rel, out / rel, shallow=False), rel
        assert _sha(src / rel) == _sha(out / rel)


def test_compressed_logits_identical(src, packed):
    ref, got = _logits_trace(src), _logits_trace(packed)
    assert len(ref) == len(got) == 4
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_generate_cli_on_compressed(src, packed, tmp_path):
    outs = []
    for i, path in enumerate((src, packed)):
        js = tmp_path / f"out{i}.json"
        assert cli("generate", path, "--device", "cpu", "--dtype", "bfloat16", "--max-model-len", "64",
                   "--prompt", "def add(a, b):", "--max-tokens", "6", "--ignore-eos", "--output-json", js) == 0
        outs.append(json.loads(js.read_text()))
    assert outs[0] == outs[1]


def test_serve_on_compressed(src, packed):
    import sys

    import httpx

    sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
    from server_utils import MODEL_NAME, ServerThread, make_engine

    from pagedmoe import LLM, SamplingParams

    ref = LLM(str(src), device="cpu", dtype="bfloat16", max_model_len=64).generate(
        ["def add(a, b):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    with ServerThread(make_engine(packed, device="cpu", dtype="bfloat16", max_model_len=64)) as s:
        r = httpx.post(s.base_url + "/v1/completions", timeout=60,
                       json={"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 6,
                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref[0].outputs[0].text


def compressed_folder(tmp_path_factory, src: Path, fmt: str) -> Path:
    out = tmp_path_factory.mktemp(f"packed_{fmt}") / "c"
    assert cli("compress", src, out, "--format", fmt, "--device", "cpu") == 0
    return out


def decompresses_exactly_with_the_same_logits(src: Path, packed: Path, tmp_path: Path) -> None:
    """`pagedmoe decompress` gives back every source file byte for byte, and the compressed folder loads to the
    source's logits."""
    out = tmp_path / "d"
    assert cli("decompress", packed, out, "--device", "cpu") == 0
    for rel in _files(src):
        assert filecmp.cmp(src / rel, out / rel, shallow=False), rel
    ref, got = _logits_trace(src), _logits_trace(packed)
    assert len(ref) == len(got) == 4 and all(torch.equal(a, b) for a, b in zip(ref, got))


def refused_by_name(packed: Path, tmp_path: Path, capsys, array: str, why: str = r".*crc32") -> None:
    """Expert 5 of layer 1's w2 corrupted in one of its lossless arrays: the loader and decompress refuse it by name
    (why: the rest of the message, its crc32 unless a structural check catches the change first)."""
    from pagedmoe import LLM
    from pagedmoe.models.loader import CheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    _flip(shard, f"{name}.lx.{array}", at=3)
    with pytest.raises(CheckpointError, match=r"experts\.5\.w2\.weight: expert 5 of layer 1 \(w2\) is corrupted"
                                              + why):
        LLM(str(bad), device="cpu", dtype="bfloat16", max_model_len=64)
    assert cli("decompress", bad, tmp_path / "d", "--device", "cpu") == 2
    assert "expert 5 of layer 1 (w2) is corrupted" in capsys.readouterr().err


def _flip(shard: Path, array: str, at: int = 5) -> None:
    start, header = _header(shard)
    b, e = header[array]["data_offsets"]
    assert e - b > at
    data = bytearray(shard.read_bytes())
    data[start + b + at] ^= 0x10
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("array", ["raw", "stream"])
def test_corrupted_expert_refused_by_name(src, packed, tmp_path, capsys, array):
    from pagedmoe import LLM
    from pagedmoe.models.loader import CheckpointError

    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    _flip(shard, f"{name}.lx.{array}")
    with pytest.raises(CheckpointError, match=r"experts\.5\.w2\.weight: expert 5 of layer 1 \(w2\) is corrupted"
                                              r".*crc32"):
        LLM(str(bad), device="cpu", dtype="bfloat16", max_model_len=64)
    out = tmp_path / "d"
    assert cli("decompress", bad, out, "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert shard.name in err and "expert 5 of layer 1 (w2) is corrupted" in err and "crc32" in err
    assert not (out / shard.name).exists() and not list(out.glob("*.partial"))  # nothing half-written


def test_triton_decoder_path_matches(src, packed):
    """The CUDA loading path (Triton decoder), run by the interpreter on the CPU."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or the Triton interpreter")
    from pagedmoe.models.compressed import iter_file_tensors

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shard = sorted(packed.glob("*.safetensors"))[-1]
    want = load_file(str(src / shard.name))
    checked = 0
    for name, t in iter_file_tensors(shard, device, decoder="triton"):
        assert torch.equal(t.cpu().view(torch.int16) if t.dtype == torch.bfloat16 else t.cpu(),
                           want[name].view(torch.int16) if t.dtype == torch.bfloat16 else want[name])
        checked += ".experts." in name
        if checked >= 3:  # the interpreter is slow: a few experts are enough
            break
    assert checked == 3


def _fused(src: Path, dst: Path) -> None:
    """The qwen3 checkpoint in the HF v5 fused layout: experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    for layer in range(2):
        pre = f"model.layers.{layer}.mlp.experts."
        ids = range(8)
        w[pre + "gate_up_proj"] = torch.stack([torch.cat([w.pop(f"{pre}{e}.gate_proj.weight"),
                                                          w.pop(f"{pre}{e}.up_proj.weight")]) for e in ids])
        w[pre + "down_proj"] = torch.stack([w.pop(f"{pre}{e}.down_proj.weight") for e in ids])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_all_weights_and_fused_experts(tmp_path, capsys):
    from pagedmoe import LLM
    from pagedmoe.models.loader import CheckpointError

    make_tiny_checkpoint("qwen3_moe", tmp_path / "q", seed=4, dtype=torch.bfloat16)
    src = tmp_path / "fused"
    _fused(tmp_path / "q", src)
    packed = tmp_path / "c"
    assert cli("compress", src, packed, "--all-weights", "--max-code-len", "10", "--device", "cpu") == 0
    start, header = _header(packed / "model.safetensors")
    lossless = json.loads(header["__metadata__"]["pagedmoe.lossless"])["tensors"]
    gate_up = lossless["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up["num_parts"] == 8 and gate_up["max_code_len"] == 10  # one checksummed part per expert
    assert "model.embed_tokens.weight" in lossless  # big enough to shrink
    assert "model.norm.weight" in header  # too small to shrink: kept as is
    ref, got = _logits_trace(src), _logits_trace(packed)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and len(ref) == len(got)
    assert cli("decompress", packed, tmp_path / "d", "--device", "cpu") == 0
    assert filecmp.cmp(src / "model.safetensors", tmp_path / "d" / "model.safetensors", shallow=False)
    # flip a byte inside expert 6's raw bytes of layer 1's down_proj [8, 64, 32]
    _flip(packed / "model.safetensors", "model.layers.1.mlp.experts.down_proj.lx.raw", at=6 * 64 * 32 + 17)
    with pytest.raises(CheckpointError, match=r"down_proj: part 6 \(expert 6 of a stacked tensor\) fails its crc32"):
        LLM(str(packed), device="cpu", dtype="bfloat16", max_model_len=64)


def _fake_checkpoint(path: Path, dtype) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(8, 4).to(dtype),
               "model.norm.weight": torch.ones(4, dtype=dtype)}, str(path / "model.safetensors"))
    return path


def test_refusals(tmp_path, capsys):
    fp32 = _fake_checkpoint(tmp_path / "fp32", torch.float32)
    assert cli("compress", fp32, tmp_path / "o1") == 2
    err = capsys.readouterr().err
    assert "F32" in err and "bfloat16" in err and not (tmp_path / "o1").exists()

    bf16 = _fake_checkpoint(tmp_path / "bf16", torch.bfloat16)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "model-stale.safetensors").write_bytes(b"x")
    (busy / "notes.txt").write_text("keep")
    assert cli("compress", bf16, busy, "--device", "cpu") == 2
    assert "not empty" in capsys.readouterr().err
    assert cli("compress", bf16, bf16, "--force") == 2
    assert "is the input folder" in capsys.readouterr().err
    assert cli("compress", bf16, busy, "--device", "cpu", "--force") == 0
    assert sorted(p.name for p in busy.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert cli("compress", busy, tmp_path / "o2", "--device", "cpu") == 2
    assert "already compressed" in capsys.readouterr().err
    assert cli("decompress", bf16, tmp_path / "o3") == 2
    assert "no shards written by `pagedmoe compress`" in capsys.readouterr().err
    assert cli("compress", bf16, tmp_path / "o4", "--max-code-len", "20") == 2
    assert "max_code_len" in capsys.readouterr().err
    # OUT inside MODEL: not copied into itself; decompress refuses a non-empty DIR
    assert cli("compress", bf16, bf16 / "c", "--device", "cpu") == 0
    assert _files(bf16 / "c") == ["config.json", "model.safetensors"]
    assert cli("decompress", bf16 / "c", busy) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli("decompress", bf16 / "c", tmp_path / "o5") == 0
    assert filecmp.cmp(bf16 / "model.safetensors", tmp_path / "o5" / "model.safetensors", shallow=False)


def _corrupt_second_shard(packed: Path, bad: Path) -> Path:
    """A copy of `packed` whose second shard (the first decompresses fine) has one expert array bit flipped."""
    shutil.copytree(packed, bad)
    shard = sorted(bad.glob("*.safetensors"))[1]
    _flip(shard, next(k for k in _header(shard)[1] if k.endswith(".lx.raw")), at=3)
    return shard


@pytest.mark.parametrize("out_state", ["absent", "empty", "kept file"])
def test_failed_decompress_leaves_nothing_so_a_rerun_works(src, packed, tmp_path, capsys, out_state):
    """A corrupt second shard: the first, already written, is removed with everything else this run wrote (and
    OUT, when the run made it), so the rerun on the repaired input needs no --force; a file that was in OUT
    before stays."""
    bad, out = tmp_path / "bad", tmp_path / "d"
    shard = _corrupt_second_shard(packed, bad)
    if out_state != "absent":
        out.mkdir()
    if out_state == "kept file":
        (out / "notes").mkdir()
        (out / "notes" / "mine.txt").write_text("keep")
    before = _files(out) if out.exists() else None
    force = ["--force"] if out_state == "kept file" else []   # a non-empty OUT needs --force, as before
    assert cli("decompress", bad, out, "--device", "cpu", *force) == 2
    assert shard.name in capsys.readouterr().err
    assert (_files(out) if out.exists() else None) == before
    shutil.copy2(packed / shard.name, shard)   # the input repaired
    assert cli("decompress", bad, out, "--device", "cpu", *force) == 0
    assert _files(out) == sorted(_files(src) + (before or []))
    assert all(filecmp.cmp(src / rel, out / rel, shallow=False) for rel in _files(src))


def test_failed_compress_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    from pagedmoe.entrypoints import compress

    real, calls = compress.compress_file, []

    def second_fails(file, *args, **kwargs):
        calls.append(file)
        if len(calls) == 2:
            raise ValueError(f"{file.name}: boom")
        return real(file, *args, **kwargs)

    monkeypatch.setattr(compress, "compress_file", second_fails)
    assert cli("compress", src, tmp_path / "c", "--device", "cpu") == 2
    assert "boom" in capsys.readouterr().err and len(calls) == 2 and not (tmp_path / "c").exists()


def test_truncated_or_missing_source_is_named(tmp_path, capsys):
    bf16 = _fake_checkpoint(tmp_path / "bf16", torch.bfloat16)
    shard = bf16 / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert cli("compress", bf16, tmp_path / "o1", "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert "truncated, 10 bytes shorter than its header says" in err and not (tmp_path / "o1").exists(), err
    assert cli("compress", tmp_path / "nope", tmp_path / "o2", "--device", "cpu") == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "o2").exists()
